"""The parent's side of a ``--link-rate`` run: each node's torchrun under
``unshare --net --pid --fork --kill-child python -m ...namespace_run`` (a fresh network and PID
namespace), the veth between two nodes, and the figures the namespaces probed.

Nothing outlives the run: ``unshare`` is started with PR_SET_PDEATHSIG = SIGKILL (it dies with
the process that started it, even one SIGKILLed); ``--kill-child`` makes its child, the
wrapper, die with it; the wrapper is PID 1 of its PID namespace, so the kernel then kills every
process of that namespace (torchrun and its ranks); with no process left, the network
namespace, its tbf and the veth vanish.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from megatron_dcp.tools.launching.training_runs import (
    Agents,
    NodeLaunch,
    RunLog,
    TrainingRunError,
    run_agents,
    run_pretrain,
)
from megatron_dcp.tools.link.namespace_run import NODE_DEVICE, PREFIX, node_address
from megatron_dcp.tools.link.sharing import per_rank_bandwidth

WRAPPER = "megatron_dcp.tools.link.namespace_run"
RDZV_PORT = 29400
PR_SET_PDEATHSIG = 1
NAMESPACE_WAIT_S = 30.0
VETH_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LinkSpec:
    """A shaped run: the requested rate (as given and in bytes/s), the nodes and ranks, where
    the namespaces write their probe reports, and whether training gets the per-rank figures."""

    rate: str
    bytes_per_s: float
    nodes: int
    nproc: int
    out: Path
    bandwidth_flags: bool = False

    def report(self, node: Optional[int]) -> Path:
        return self.out / ("link.json" if node is None else f"link_node{node}.json")


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the process that starts it dies."""
    parent = os.getpid()

    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return preexec


def node_launch(spec: LinkSpec, node: Optional[int]) -> NodeLaunch:
    """One node's torchrun inside a fresh namespace (``node`` None: the single node)."""
    prefix = ["unshare", "--net", "--pid", "--fork", "--kill-child", sys.executable, "-m", WRAPPER]
    prefix += ["--rate", spec.rate, "--report", str(spec.report(node)), "--nproc", str(spec.nproc)]
    prefix += ["--bandwidth-flags"] if spec.bandwidth_flags else []
    if node is None:  # the local address: the host name may not resolve inside the namespace
        flags = ["--local-addr=127.0.0.1"]
        return NodeLaunch([*prefix, "--"], {"GLOO_SOCKET_IFNAME": "lo"}, flags, die_with_parent())
    prefix += ["--node", str(node), "--nodes", str(spec.nodes), "--"]
    flags = [f"--local-addr={node_address(node)}", f"--rdzv-conf=is_host={int(node == 0)}"]
    return NodeLaunch(prefix, {"GLOO_SOCKET_IFNAME": NODE_DEVICE}, flags, die_with_parent())


def network_namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def link_nodes(agents: List[subprocess.Popen]) -> None:
    """Join the two agents' namespaces by a veth pair, created from inside node 0's namespace
    so that no end is ever in this one."""
    ours = network_namespace(os.getpid())
    deadline = time.monotonic() + NAMESPACE_WAIT_S
    while any(network_namespace(agent.pid) == ours for agent in agents):
        if any(agent.poll() is not None for agent in agents) or time.monotonic() > deadline:
            raise TrainingRunError("--nodes 2: a node's namespace did not come up")
        time.sleep(0.02)
    first, second = (agent.pid for agent in agents)
    command = ["nsenter", f"--net=/proc/{first}/ns/net", "ip", "link", "add", NODE_DEVICE]
    command += ["type", "veth", "peer", "name", NODE_DEVICE, "netns", str(second)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=VETH_TIMEOUT_S)
    if done.returncode:
        raise TrainingRunError(f"--nodes 2: the veth could not be made: {done.stderr.strip()}")


def run_linked(
    flags: List[str],
    spec: LinkSpec,
    entry: str,
    timeout_s: float,
    on_line: Optional[Callable[[str], None]] = None,
) -> Tuple[RunLog, Dict[str, object]]:
    """Train under the shaped link; what it logged, and the link's figures (:func:`figures`).
    ``on_line`` sees each line of a one-node run's output as it comes (progress)."""
    for node in (None, *range(spec.nodes)):
        spec.report(node).unlink(missing_ok=True)
    log_path = spec.out / "train.log"
    try:
        if spec.nodes == 1:
            launch = node_launch(spec, None)
            log = run_pretrain(
                flags, spec.nproc, log_path, timeout_s, entry=entry, launch=launch,
                on_line=on_line,
            )  # fmt: skip
            return log, figures(spec)
        launches = [node_launch(spec, node) for node in range(spec.nodes)]
        agents = Agents(node_address(0), entry, launches)
        log = run_agents(
            flags, spec.nodes, spec.nproc // spec.nodes, RDZV_PORT, spec.out, timeout_s, agents,
            on_started=link_nodes,
        )  # fmt: skip
    except TrainingRunError as error:
        raise link_refusal(error) from None
    log_path.write_text(log.output)
    return log, figures(spec)


def link_refusal(error: TrainingRunError) -> TrainingRunError:
    """A failed run as the user should read it: when the namespace wrapper refused the link
    (its probe, or its set-up) training never started, and its own line is the whole story."""
    text = str(error)
    start = text.find(PREFIX)
    if start < 0:
        return error
    line = text[start + len(PREFIX) :].splitlines()[0].strip()
    return TrainingRunError(f"the shaped link refused the run before training: {line}")


def figures(spec: LinkSpec) -> Dict[str, object]:
    """The ``link`` object of the report: the request, the probed figures and what each rank
    gets of them."""
    nodes = [None] if spec.nodes == 1 else list(range(spec.nodes))
    reports = [json.loads(spec.report(node).read_text()) for node in nodes]
    probed = reports[0]["probed_bytes_per_s"]
    found: Dict[str, object] = {
        "requested": spec.rate,
        "requested_bytes_per_s": spec.bytes_per_s,
        "probed_bytes_per_s": probed,
        "nodes": spec.nodes,
        "per_rank_bytes_per_s": per_rank_bandwidth(probed, spec.nproc, spec.nodes),
        "netns": [report["netns"] for report in reports],
    }
    if spec.nodes > 1:
        found["loopback_bytes_per_s"] = reports[0]["loopback_bytes_per_s"]
    return found
