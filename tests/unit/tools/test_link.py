"""bench-train's ``--link-rate`` without a network namespace: tc's rate units, the refusals of
the preflight (not root, a tool missing from PATH, a tbf qdisc the kernel refuses: faked by
scripts on PATH), the flags' checks, the per-rank share of the probed link, the probe's
tolerance, and the report's header line."""

import os
import stat

import pytest

from megatron_dcp.tools.bench_train.report import describe_link
from megatron_dcp.tools.cli.bench_train import bench_train
from megatron_dcp.tools.link import preflight
from megatron_dcp.tools.link.namespace_run import off_by
from megatron_dcp.tools.link.preflight import LinkUnavailable, check_link_support
from megatron_dcp.tools.link.rate import parse_link_rate, tbf_args
from megatron_dcp.tools.link.sharing import per_rank_bandwidth


@pytest.mark.parametrize(
    "text, expected",
    [
        ("200mbit", 25e6),
        ("200Mbit", 25e6),
        ("1gbit", 125e6),
        ("800kbit", 1e5),
        ("8bit", 1.0),
        ("25mbps", 25e6),
        ("1.5gbps", 1.5e9),
        ("3kbps", 3e3),
        ("100bps", 100.0),
        (" 0.5 mbit ", 62500.0),
    ],
)
def test_tc_units_are_bits_and_bytes_per_second(text, expected):
    assert parse_link_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["200", "fast", "200mb", "-5mbit", "mbit", "0bit", ""])
def test_a_bad_rate_names_the_flag_the_value_and_the_forms(text):
    with pytest.raises(ValueError, match=r"--link-rate=.*(give|kbit, mbit, gbit).*mbps"):
        parse_link_rate(text)


def test_the_tbf_bucket_holds_a_loopback_packet_and_10_ms_of_a_fast_rate():
    slow = tbf_args(25e6)
    assert slow[:3] == ["tbf", "rate", "200000000bit"] and int(slow[4]) >= 65536
    assert int(tbf_args(1.25e9)[4]) == 12_500_000


def fake_path(tmp_path, monkeypatch, tools, failing=()):
    """A PATH of fake tools: ``unshare`` drops its flags and runs the rest; a tool in
    ``failing`` prints tc's error and exits 2; the others succeed."""
    for tool in tools:
        script = tmp_path / tool
        if tool == "unshare":
            body = 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"'
        elif tool in failing:
            body = 'echo "Error: Specified qdisc kind is unknown." >&2; exit 2'
        else:
            body = "exit 0"
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 0)


def test_the_preflight_passes_when_everything_is_there(tmp_path, monkeypatch):
    fake_path(tmp_path, monkeypatch, ["unshare", "ip", "tc", "nsenter"])
    check_link_support("200mbit", 25e6, 2)


@pytest.mark.parametrize("missing", ["unshare", "tc", "ip"])
def test_a_missing_tool_refuses_the_run_in_one_line_naming_it(tmp_path, monkeypatch, missing):
    fake_path(tmp_path, monkeypatch, [t for t in ("unshare", "ip", "tc") if t != missing])
    with pytest.raises(LinkUnavailable, match=f"--link-rate=200mbit needs `{missing}` on PATH"):
        check_link_support("200mbit", 25e6, 1)


def test_two_nodes_need_nsenter(tmp_path, monkeypatch):
    fake_path(tmp_path, monkeypatch, ["unshare", "ip", "tc"])
    check_link_support("200mbit", 25e6, 1)
    with pytest.raises(LinkUnavailable, match="needs `nsenter` on PATH"):
        check_link_support("200mbit", 25e6, 2)


def test_a_tbf_the_kernel_refuses_is_named_with_tcs_error(tmp_path, monkeypatch):
    fake_path(tmp_path, monkeypatch, ["unshare", "ip", "tc"], failing=["tc"])
    with pytest.raises(LinkUnavailable) as refused:
        check_link_support("200mbit", 25e6, 1)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "--link-rate=200mbit needs the tbf qdisc (sch_tbf), which `tc` could not create: "
        "Error: Specified qdisc kind is unknown."
    )


def test_a_veth_the_kernel_refuses_is_named_for_two_nodes(tmp_path, monkeypatch):
    fake_path(tmp_path, monkeypatch, ["unshare", "ip", "tc", "nsenter"], failing=["ip"])
    with pytest.raises(LinkUnavailable, match="--nodes 2 needs veth pairs .*: Error: Spec"):
        check_link_support("200mbit", 25e6, 2)


def test_not_root_is_refused(monkeypatch):
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkUnavailable, match="--link-rate=200mbit needs root"):
        check_link_support("200mbit", 25e6, 1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nodes", "2"], "--nodes=2 needs --link-rate"),
        (["--nodes", "2", "--link-rate", "200mbit", "--nproc", "1"], "--nproc=1 is odd"),
        (["--nodes", "3", "--link-rate", "200mbit"], "--nodes=3: 1 or 2 nodes"),
        (["--link-rate", "200"], "--link-rate='200' is not a rate"),
    ],
)
def test_bench_train_refuses_bad_link_flags_before_running(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        bench_train([*flags, "--out", str(tmp_path)])
    assert not os.listdir(tmp_path)


def test_ranks_share_one_loopback_bucket_but_only_their_nodes_veth_end():
    assert per_rank_bandwidth(24e6, 2, 1) == {"intra": 12e6}
    assert per_rank_bandwidth(24e6, 4, 2) == {"inter": 12e6}
    assert per_rank_bandwidth(24e6, 8, 2) == {"inter": 6e6}


def test_a_probe_more_than_20_percent_off_refuses():
    assert off_by(20.5e6, 25e6) is None and off_by(29.5e6, 25e6) is None
    assert "more than 20% off the requested 25.0 MB/s" in off_by(19e6, 25e6)
    assert off_by(31e6, 25e6) is not None


def test_the_header_line_carries_the_request_and_the_probed_figures():
    one = {"requested": "200mbit", "requested_bytes_per_s": 25e6, "probed_bytes_per_s": 25.1e6,
           "nodes": 1}  # fmt: skip
    assert describe_link(None) == ""
    assert describe_link(one) == (
        "; link 200mbit requested (25.0 MB/s), probed 25.1 MB/s (shaped loopback, one node)"
    )
    two = {**one, "nodes": 2, "loopback_bytes_per_s": 1.7e9}
    assert "(veth between 2 nodes; inside a node 1700.0 MB/s)" in describe_link(two)
