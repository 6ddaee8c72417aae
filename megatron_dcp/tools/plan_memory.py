"""Peak memory of planning: tracemalloc's peak over one scheduler's ``schedule()`` call.

tracemalloc hooks every allocation and slows Python down several-fold, so the benchmark measures
memory in a separate run that it never times. The peak counts what the call allocates (its
working data and the plan it returns), not the lengths handed to it nor what was allocated before.
"""

from __future__ import annotations

import tracemalloc
from typing import Any, Callable, Optional, Sequence

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.tools.compare import DEV_PEER_ALIAS, PEER_ALIAS, DomainSpec, scheduler_kwargs

MIB = float(1 << 20)


def traced_peak_bytes(call: Callable[[], Any]) -> int:
    """tracemalloc's peak during ``call()``, in bytes above what was traced when it began.

    Starts and stops tracing around the call, or, when tracing is already on (``python -X
    tracemalloc``), only resets the peak and leaves tracing on."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = call()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(0, peak - before)


def schedule_call(
    name: str, lengths: Sequence[int], spec: DomainSpec, cost: CostModel
) -> Callable[[], Any]:
    """The planning call of ``name`` on ``lengths``, its scheduler already built: a registered
    scheduler's ``schedule()``, the dev peer's, or the 0.19.2 peer's ``schedule_peer`` (which
    builds the upstream scheduler, a handful of scalars, then plans)."""
    if name == PEER_ALIAS:
        from megatron_dcp.tools.peers import megatron_hybrid_cp as peer

        domain = spec.domain()
        peer.check_peer_input(lengths, domain)
        return lambda: peer.schedule_peer(lengths, domain.size, domain.budget)
    if name == DEV_PEER_ALIAS:
        from megatron_dcp.tools.peers.megatron_dev_greedy import DevGreedyPeer

        scheduler = DevGreedyPeer(**scheduler_kwargs(spec, cost))
    else:
        scheduler = build_scheduler(name, **scheduler_kwargs(spec, cost))
    return lambda: scheduler.schedule(lengths)


def schedule_peak_mib(
    name: str, lengths: Sequence[int], spec: DomainSpec, cost: CostModel
) -> Optional[float]:
    """MiB: tracemalloc's peak over one untimed planning call of ``name`` on ``lengths`` (see
    :func:`schedule_call`); None when it cannot plan them (ValueError)."""
    try:
        return traced_peak_bytes(schedule_call(name, lengths, spec, cost)) / MIB
    except ValueError:
        return None
