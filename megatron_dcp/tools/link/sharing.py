"""How the ranks of a shaped run share its probed link: the per-rank figures bench-train gives
training as the cost model's prior."""

from __future__ import annotations

from typing import Dict


def per_rank_bandwidth(probed_bytes_per_s: float, nproc: int, nodes: int) -> Dict[str, float]:
    """The bandwidth one rank can count on when it sends its ring neighbour, by link.

    One node (``nodes == 1``): every rank talks over the one shaped loopback, whose tbf is a
    single token bucket shared by all traffic in both directions, so when all ranks exchange at
    once each gets ``probed / nproc`` (``"intra"``). Two nodes: only the veth is shaped, one
    bucket per end's egress, shared by the ``nproc / 2`` ranks of that node that send across
    it, so ``probed / (nproc / 2)`` (``"inter"``); the unshaped loopback inside a node is left
    to the cost model's profile (no ``"intra"``).
    """
    if nodes == 1:
        return {"intra": probed_bytes_per_s / nproc}
    return {"inter": probed_bytes_per_s / (nproc // nodes)}
