"""``bench-train --link-rate`` end to end (root only: network namespaces and tc): a 2-rank run
on a shaped loopback reports the probed rate, within 20 % of the request, and passes the
per-rank figure to training; a rate the link cannot carry is refused by the probe; a run
SIGKILLed half-way leaves nothing behind (no process in its namespaces, no tbf on the host's
lo, no ``dcpnet``); ``--nodes 2`` at 4 ranks (over-subscribed) reports the veth's and the
loopback's figures. Tiny model, a few batches."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dcp.tools.cli.bench_train import bench_train

pytestmark = pytest.mark.link_shaping(nodes=2)  # conftest.py skips it without root or tools
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--global-batch-size", "8",
    "--varlen-distribution", "lognormal:median=200,sigma=0.8,min=16,max=1024",
]  # fmt: skip
ARMS = ["--arms", "static,dcp", "--warmup", "1"]
RATE = 25e6  # 200mbit
KILL_TIMEOUT_S = 300


def test_a_shaped_run_reports_the_probed_rate_and_gives_training_its_share(tmp_path, capsys):
    bench = ["--nproc", "2", "--batches", "3", "--link-rate", "200mbit", *ARMS]
    flags = [*TINY, "--max-seqlen-per-dp-cp-rank", "512"]
    assert bench_train([*bench, "--out", str(tmp_path), *flags]) == 0
    link = json.loads((tmp_path / "bench_train.json").read_text())["link"]
    assert link["requested"] == "200mbit" and link["requested_bytes_per_s"] == RATE
    assert link["nodes"] == 1 and abs(link["probed_bytes_per_s"] - RATE) <= 0.2 * RATE
    probed = link["probed_bytes_per_s"]
    header = f"link 200mbit requested (25.0 MB/s), probed {probed / 1e6:.1f} MB/s (shaped loopback"
    assert header in capsys.readouterr().out
    assert link["per_rank_bytes_per_s"] == {"intra": pytest.approx(probed / 2)}
    assert training_flag(tmp_path / "train.log", "dcp_link_bandwidth") == int(probed / 2)


def training_flag(log: Path, name: str) -> float:
    """The value megatron's argument dump gives ``name`` (once per run)."""
    values = set(re.findall(rf"^\s*{name} \.+ (\S+)$", log.read_text(), re.M))
    assert len(values) == 1, f"{name}: {values}"
    return float(values.pop())


def test_a_rate_the_link_cannot_carry_is_refused_by_the_probe(tmp_path, capsys):
    bench = ["--nproc", "2", "--batches", "2", "--link-rate", "1000gbit", *ARMS]
    flags = [*TINY, "--max-seqlen-per-dp-cp-rank", "512"]
    assert bench_train([*bench, "--out", str(tmp_path), *flags]) == 1
    error = capsys.readouterr().err
    refusal = "the shaped link refused the run before training: --link-rate: the probe measured"
    assert refusal in error and "training exited" not in error
    assert "more than 20% off the requested 125000.0 MB/s" in error
    assert not (tmp_path / "plans.jsonl").exists()  # no training started


def holders(inodes) -> dict:
    """Every process whose network namespace is one of ``inodes``: {pid: inode}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                inode = os.stat(entry / "ns" / "net").st_ino
            except OSError:
                continue
            if inode in inodes:
                found[int(entry.name)] = inode
    return found


def wait_for(condition, what: str, timeout_s: float, process=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process is None or process.poll() is None, f"bench-train exited before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def test_a_run_killed_half_way_leaves_no_namespace_no_tbf_and_no_veth(tmp_path):
    bench = ["--nproc", "2", "--nodes", "2", "--batches", "200", "--link-rate", "200mbit"]
    command = [sys.executable, "-m", "megatron_dcp.tools", "bench-train", *bench, *ARMS]
    command += ["--out", str(tmp_path), *TINY, "--max-seqlen-per-dp-cp-rank", "512"]
    log = open(tmp_path / "bench.log", "w")
    run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    inodes = set()
    try:
        plans = tmp_path / "plans.jsonl"
        wait_for(lambda: plans.exists() and plans.stat().st_size, "training", KILL_TIMEOUT_S, run)
        reports = [tmp_path / f"link_node{node}.json" for node in (0, 1)]
        inodes = {json.loads(report.read_text())["netns"] for report in reports}
        assert len(inodes) == 2 and holders(inodes), "the run's namespaces are not in use"
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        wait_for(lambda: not holders(inodes), "the namespaces' processes ended", 30)
    finally:
        log.close()
        for pid in [run.pid] * (run.poll() is None) + list(holders(inodes)):
            os.kill(pid, signal.SIGKILL)
    host = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    assert "tbf" not in host.stdout
    veth = subprocess.run(["ip", "link", "show", "dcpnet"], capture_output=True, text=True)
    assert veth.returncode != 0 and "does not exist" in veth.stderr


def test_two_nodes_report_the_veth_and_the_loopback_inside_a_node(tmp_path, capsys):
    bench = ["--nproc", "4", "--oversubscribe", "--nodes", "2", "--batches", "2"]
    bench += ["--link-rate", "200mbit", *ARMS]
    flags = [*TINY, "--max-seqlen-per-dp-cp-rank", "256"]
    assert bench_train([*bench, "--out", str(tmp_path), *flags]) == 0
    printed = capsys.readouterr().out
    link = json.loads((tmp_path / "bench_train.json").read_text())["link"]
    probed, inside = link["probed_bytes_per_s"], link["loopback_bytes_per_s"]
    assert link["nodes"] == 2 and abs(probed - RATE) <= 0.2 * RATE
    assert inside > 4 * RATE, "the loopback inside a node must not be shaped"
    assert "OVERSUBSCRIBED" in printed
    assert f"probed {probed / 1e6:.1f} MB/s (veth between 2 nodes; inside a node" in printed
    assert link["per_rank_bytes_per_s"] == {"inter": pytest.approx(probed / 2)}
    log = tmp_path / "train.log"
    assert training_flag(log, "dcp_inter_node_link_bandwidth") == int(probed / 2)
    assert training_flag(log, "dcp_ranks_per_node") == 2
