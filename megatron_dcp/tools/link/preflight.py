"""Can this machine run ``--link-rate``? Root, ``unshare``, ``ip``, ``tc`` (and ``nsenter`` for
``--nodes 2``) on PATH, and a tbf qdisc (and, for two nodes, a veth pair) that the kernel lets
``tc`` / ``ip`` create, tried in a throwaway network namespace. What is missing refuses the run
in one line before anything is set up."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Sequence

from megatron_dcp.tools.link.rate import FLAG, tbf_args

CHECK_TIMEOUT_S = 20.0


class LinkUnavailable(ValueError):
    """This machine cannot shape links as ``--link-rate`` asks (a ValueError: the command
    refuses the run before any training starts, as for bad input)."""


def required_tools(nodes: int) -> List[str]:
    return ["unshare", "ip", "tc", *(["nsenter"] if nodes > 1 else [])]


def check_link_support(rate_text: str, bytes_per_s: float, nodes: int) -> None:
    """Raise :class:`LinkUnavailable` (one line naming what is missing) unless every piece
    that ``--link-rate`` (and ``--nodes``) needs is here and works."""
    what = f"{FLAG}={rate_text}"
    if os.geteuid() != 0:
        raise LinkUnavailable(
            f"{what} needs root (it creates network namespaces and tc qdiscs); run as root."
        )
    missing = [tool for tool in required_tools(nodes) if shutil.which(tool) is None]
    if missing:
        names = ", ".join(f"`{tool}`" for tool in missing)
        raise LinkUnavailable(
            f"{what} needs {names} on PATH (util-linux's unshare/nsenter, iproute2's ip/tc), "
            "which could not be found."
        )
    tbf = ["tc", "qdisc", "add", "dev", "lo", "root", *tbf_args(bytes_per_s)]
    failure = in_throwaway_namespace(tbf)
    if failure is not None:
        raise LinkUnavailable(
            f"{what} needs the tbf qdisc (sch_tbf), which `tc` could not create: {failure}"
        )
    if nodes > 1:
        veth = ["ip", "link", "add", "dcpcheck0", "type", "veth", "peer", "name", "dcpcheck1"]
        failure = in_throwaway_namespace(veth)
        if failure is not None:
            raise LinkUnavailable(
                f"{what} --nodes {nodes} needs veth pairs (the veth module), which `ip` could "
                f"not create: {failure}"
            )


def in_throwaway_namespace(command: Sequence[str]) -> "str | None":
    """Run ``command`` in a fresh network namespace that vanishes with it; None when it
    worked, else its first error line."""
    try:
        done = subprocess.run(
            ["unshare", "--net", *command],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[0] if lines else f"exit status {done.returncode}"
