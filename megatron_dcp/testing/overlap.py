"""megatron's communication-overlap options for the training-run helpers (``testing.dcp_step``): what
``megatron.training`` sets up for ``--overlap-grad-reduce``, ``--overlap-param-gather`` (with
``--align-param-gather``) and the interleaved schedule's p2p overlap, so that a test runs the
same schedule hooks as a real training run (tests/integration/test_comm_overlap.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class CommOverlap:
    """Which communication overlaps megatron runs; the default overlaps nothing.

    ``grad_reduce``: DDP's ``overlap_grad_reduce`` (buckets reduced asynchronously during the
    last micro-batch's backward pass; the schedules hold them back through ``no_sync_func`` and,
    with VPP, start them per chunk through ``grad_sync_func``: megatron.training's
    ``--align-grad-reduce`` default). ``param_gather``: ``overlap_param_gather`` (distributed
    optimizer only: the optimizer step leaves the all-gather to the next forward's pre-hooks).
    ``align_param_gather``: the interleaved schedule dispatches those all-gathers itself
    (``param_sync_func``). ``bucket_size``: DDP's bucket size in elements (small: several
    buckets, each reduced as soon as its gradients are ready). ``p2p``: the interleaved
    schedule's ``overlap_p2p_comm`` (unbatched p2p, waited on just before use), megatron.training's
    default with VPP; ``p2p_warmup_flush``: also in the warm-up and flush phases
    (``--overlap-p2p-communication-warmup-flush``)."""

    grad_reduce: bool = False
    param_gather: bool = False
    align_param_gather: bool = False
    bucket_size: Optional[int] = None
    p2p: bool = False
    p2p_warmup_flush: bool = False


NO_OVERLAP = CommOverlap()


def ddp_config_fields(overlap: CommOverlap) -> dict:
    """The ``DistributedDataParallelConfig`` fields of ``overlap``."""
    return dict(
        overlap_grad_reduce=overlap.grad_reduce,
        overlap_param_gather=overlap.param_gather,
        align_param_gather=overlap.align_param_gather,
        bucket_size=overlap.bucket_size,
    )


def use_p2p_overlap(config: Any, overlap: CommOverlap) -> None:
    """The p2p settings of ``overlap`` on a TransformerConfig, as megatron.training sets them
    (batched p2p off with the overlap: megatron refuses both); none without ``overlap.p2p``."""
    if overlap.p2p:
        config.overlap_p2p_comm, config.batch_p2p_comm = True, False
        config.overlap_p2p_comm_warmup_flush = overlap.p2p_warmup_flush


def install_schedule_hooks(models: Sequence[Any], overlap: CommOverlap) -> None:
    """The schedule hooks megatron.training's ``train`` installs for ``overlap`` on the DDP
    ``models`` (one per model chunk; a list of them with VPP)."""
    config = models[0].config

    def per_chunk(functions: list) -> Any:
        return functions[0] if len(functions) == 1 else functions

    use_p2p_overlap(config, overlap)
    if overlap.grad_reduce:
        config.no_sync_func = per_chunk([model.no_sync for model in models])
        config.grad_sync_func = per_chunk([model.start_grad_sync for model in models])
    if overlap.param_gather and overlap.align_param_gather:
        config.param_sync_func = per_chunk([model.start_param_sync for model in models])


def finish_param_gather(models: Sequence[Any], overlap: CommOverlap) -> None:
    """After the last optimizer step: with ``param_gather`` the updated shards are gathered only
    by the next forward's pre-hooks, so gather them now (megatron.training's end of training:
    ``disable_forward_pre_hook`` with its synchronous all-gather)."""
    if overlap.param_gather:
        for model in models:
            model.disable_forward_pre_hook()
