"""What runs inside a fresh network namespace (and PID namespace) of a ``--link-rate`` run:
configure the links, shape them with tbf, probe them, write the figures, then run training.

    python -m megatron_dcp.tools.link.namespace_run --rate 200mbit --report link.json \\
        [--node 0 --nodes 2] --nproc 2 -- torchrun command ...

One node: ``lo`` up and shaped. Node ``i`` of two: ``lo`` holds 127.0.0.1/16 (a /8 would make
the other node's 127.1.0.x local), the veth end ``dcpnet`` (made by the parent, waited for here)
holds 127.1.0.<i+1>/30, both ends shaped (tbf shapes egress). The probe: one node, between this
process and a forked receiver on the loopback; two nodes, node 1 sends to node 0 across the veth,
and node 0 also probes its own unshaped loopback. The figures go to ``--report`` (JSON, with
this namespace's inode); a probed rate more than :data:`TOLERANCE` off the requested one refuses
the run (exit :data:`REFUSED`, one line on stderr). Run as PID 1 of its PID namespace: when this
process dies, the kernel kills every process of the namespace (torchrun's ranks included).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_dcp.tools.link import probe
from megatron_dcp.tools.link.rate import FLAG, megabytes, parse_link_rate, tbf_args
from megatron_dcp.tools.link.sharing import per_rank_bandwidth

NODE_DEVICE = "dcpnet"
PROBE_PORT = 29390
TOLERANCE = 0.2
REFUSED = 3
SETUP_FAILED = 4
DEVICE_WAIT_S = 30.0
COMMAND_TIMEOUT_S = 20.0
PREFIX = "megatron-dcp link: error:"
# The training flags that carry the per-rank figures of :func:`per_rank_bandwidth`.
BANDWIDTH_FLAGS = {"intra": "--dcp-link-bandwidth", "inter": "--dcp-inter-node-link-bandwidth"}


class SetupFailed(RuntimeError):
    """A command that sets up the namespace failed."""


def node_address(node: int) -> str:
    return f"127.1.0.{node + 1}"


def sh(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode:
        raise SetupFailed(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


def shape(device: str, bytes_per_s: float) -> None:
    sh("tc", "qdisc", "add", "dev", device, "root", *tbf_args(bytes_per_s))


def configure_node(node: int, bytes_per_s: float) -> None:
    """Node ``node``'s loopback and its end of the veth, shaped."""
    deadline = time.monotonic() + DEVICE_WAIT_S
    while True:
        try:
            socket.if_nametoindex(NODE_DEVICE)
            break
        except OSError:
            if time.monotonic() > deadline:
                waited = f"{DEVICE_WAIT_S:.0f} s"
                raise SetupFailed(f"the veth end {NODE_DEVICE} did not appear in {waited}")
            time.sleep(0.05)
    sh("ip", "addr", "add", "127.0.0.1/16", "dev", "lo")
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "addr", "add", f"{node_address(node)}/30", "dev", NODE_DEVICE)
    sh("ip", "link", "set", NODE_DEVICE, "up")
    sh("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
       f"net.ipv4.conf.{NODE_DEVICE}.route_localnet=1")  # fmt: skip
    shape(NODE_DEVICE, bytes_per_s)


def measure(node: Optional[int], bytes_per_s: float) -> Dict[str, float]:
    """Set up this namespace's links and probe them."""
    if node is None:
        sh("ip", "link", "set", "lo", "up")
        shape("lo", bytes_per_s)
        return {"probed_bytes_per_s": probe.probe_between_processes("127.0.0.1", PROBE_PORT)}
    configure_node(node, bytes_per_s)
    if node == 1:
        return {"probed_bytes_per_s": probe.send(node_address(0), PROBE_PORT)}
    loopback = probe.probe_between_processes("127.0.0.1", PROBE_PORT)
    with probe.listen(node_address(0), PROBE_PORT) as listener:
        return {"probed_bytes_per_s": probe.receive(listener), "loopback_bytes_per_s": loopback}


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_dcp.tools.link.namespace_run")
    p.add_argument("--rate", required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--node", type=int, default=None)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--bandwidth-flags", action="store_true",
                   help="append the per-rank figures to the command as training flags")  # fmt: skip
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args


def off_by(probed: float, requested: float) -> Optional[str]:
    """Why the probed figure refuses the run; None when it is within :data:`TOLERANCE`."""
    if abs(probed - requested) <= TOLERANCE * requested:
        return None
    return (
        f"{FLAG}: the probe measured {megabytes(probed)}, more than {TOLERANCE:.0%} off the "
        f"requested {megabytes(requested)}; the link cannot be shaped to this rate here "
        "(above what the unshaped link carries, or below what tbf can hold steady)."
    )


def main(argv: List[str]) -> int:
    args = parse(argv)
    requested = parse_link_rate(args.rate)
    try:
        figures = measure(args.node, requested)
    except (SetupFailed, OSError, subprocess.TimeoutExpired) as error:
        print(f"{PREFIX} {FLAG}={args.rate}: setting up the link failed: {error}", file=sys.stderr)
        return SETUP_FAILED
    report = {
        "node": args.node, "nodes": args.nodes, "requested": args.rate,
        "requested_bytes_per_s": requested, "netns": os.stat("/proc/self/ns/net").st_ino,
        **figures,
    }  # fmt: skip
    args.report.write_text(json.dumps(report))
    refusal = off_by(figures["probed_bytes_per_s"], requested)
    if refusal is not None:
        print(f"{PREFIX} {refusal}", file=sys.stderr)
        return REFUSED
    command = list(args.command)
    if args.bandwidth_flags:
        per_rank = per_rank_bandwidth(figures["probed_bytes_per_s"], args.nproc, args.nodes)
        for link, value in per_rank.items():
            command += [BANDWIDTH_FLAGS[link], str(int(value))]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
