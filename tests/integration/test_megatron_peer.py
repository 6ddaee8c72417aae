"""megatron-core 0.19.2's hybrid-CP scheduler as the simulator's peer: the real upstream code, so
these tests import megatron (and torch) when it is installed, and say how the simulator words its
absence when it is not."""

from collections import Counter

import pytest

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.tools.cli import main as cli
from megatron_dcp.tools.peers import megatron_hybrid_cp as peer

SMALL = [
    "simulate",
    "--dp-size",
    "2",
    "--cp-size",
    "2",
    "--max-seqlen-per-dp-cp-rank",
    "512",
    "--distribution",
    "uniform:min=1,max=1000",
    "--num-sequences",
    "24",
]
PEER_AVAILABLE = peer.peer_available()


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_with_peer_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, _ = run(capsys, [*SMALL, "--plot", str(png)])
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if PEER_AVAILABLE:
        assert f"{peer.PEER_NAME} " in out and "groups)" in out
    else:
        assert f"note  {peer.PEER_NAME}: omitted" in out


def test_peer_is_omitted_without_megatron(monkeypatch, capsys):
    def unavailable():
        raise peer.PeerUnavailable("megatron-core is not installed or not importable")

    monkeypatch.setattr(peer, "_scheduler_class", unavailable)
    code, out, _ = run(capsys, SMALL)
    assert code == 0 and f"note  {peer.PEER_NAME}: omitted: megatron-core" in out


@pytest.mark.skipif(not PEER_AVAILABLE, reason="megatron-core not importable")
def test_peer_report_is_consistent():
    seqlens = [3000, 1500, 900, 700, 400, 300, 200, 100, 90, 50, 20, 10]
    domain, cost = Domain(2, 2, 1024), build_cost_model("model")
    result, schedule = peer.simulate_peer(seqlens, domain, cost)
    runs = Counter(i for group in range(schedule.num_groups) for i in schedule.cp_sizes(group))
    assert runs == Counter(range(len(seqlens)))  # every sample in exactly one group
    assert result.critical_path >= result.lower_bound * (1 - 1e-12)
    assert result.num_groups == schedule.num_groups
    passes = [sum(len(g[r]) for g in schedule.sample_id_groups) for r in range(domain.size)]
    assert result.num_microbatches == max(passes)
    assert sum(result.cp_size_histogram.values()) == len(seqlens)


def test_peer_rejects_empty_sequences():
    with pytest.raises(ValueError, match="empty"):
        peer.check_peer_input([5, 0], Domain(1, 2, 8))
