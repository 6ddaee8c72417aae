"""Pipeline p2p on gloo: direction tags (an entry of the patch table, only without CUDA)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_dcp.integration.patches.table import NO_CUDA, Patch

FORWARD_TAG, BACKWARD_TAG = 1, 2


def tagged_ops(
    *,
    tensor_send_prev: Optional[torch.Tensor],
    tensor_recv_prev: Optional[torch.Tensor],
    tensor_send_next: Optional[torch.Tensor],
    tensor_recv_next: Optional[torch.Tensor],
    group: Any,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
) -> list:
    """The pipeline p2p operations of one exchange, each tagged with its direction (activations
    forward, gradients backward), so that a send is matched with the receive of its direction
    even when the previous and next stage are the same rank (pipeline size 2)."""
    dist = torch.distributed
    planned = (
        (dist.isend, tensor_send_prev, prev_pipeline_rank, BACKWARD_TAG),
        (dist.irecv, tensor_recv_prev, prev_pipeline_rank, FORWARD_TAG),
        (dist.isend, tensor_send_next, next_pipeline_rank, FORWARD_TAG),
        (dist.irecv, tensor_recv_next, next_pipeline_rank, BACKWARD_TAG),
    )
    return [dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in planned if t is not None]


def tagged_p2p_ops(**exchange: Any) -> list:
    """``_batched_p2p_ops`` with direction tags (:func:`tagged_ops`): the started requests."""
    ops = tagged_ops(**exchange)
    return torch.distributed.batch_isend_irecv(ops) if ops else []


# Shape sends still in flight, held with their tensors until the peer has received them.
_PENDING_SHAPE_SENDS: list = []


def hold_until_sent(requests: list) -> None:
    """Keep send requests (and so their tensors) referenced until they complete; completed ones
    are dropped at each exchange, so the list holds only the few still in flight."""
    _PENDING_SHAPE_SENDS[:] = [r for r in _PENDING_SHAPE_SENDS if not r.is_completed()]
    _PENDING_SHAPE_SENDS.extend(requests)


def tagged_communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """``P2PCommunicator._communicate_shapes`` with direction tags: the shapes of variable-length
    micro-batches, exchanged before the tensors themselves.

    It waits for the shapes it receives, not for those it sends. Megatron waits for both; on
    gloo a send completes only once the peer posts its receive, and when a stage runs all its
    micro-batches in the warm-up of the interleaved schedule (micro-batches × vpp ≤
    2·(pp − 1) + (vpp − 1) · group size, e.g. pp4·vpp2 or pp2·vpp2 with pp micro-batches), the
    next stage's gradient shape waits for a receive that this stage posts only after sending an
    activation, which in turn waits for the next stage's receive behind that shape: a deadlock
    (also without DCP, with any variable sequence lengths). Sends are held until delivered."""

    def shape_of(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

    recv_prev_shape = torch.zeros(3, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.zeros(3, dtype=torch.int64) if recv_next else None
    ops = tagged_ops(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=recv_next_shape,
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    )
    requests = torch.distributed.batch_isend_irecv(ops) if ops else []
    is_send = [op.op is torch.distributed.isend for op in ops]
    for request, send in zip(requests, is_send):
        if not send:
            request.wait()
    hold_until_sent([request for request, send in zip(requests, is_send) if send])
    as_list = lambda shape: [0, 0, 0] if shape is None else shape.tolist()  # noqa: E731
    return as_list(recv_prev_shape), as_list(recv_next_shape)


PIPELINE_PATCHES = (
    Patch(
        "pipeline_p2p_tags",
        "pipeline",
        ("megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",),
        "megatron-core 0.19.2 batches untagged sends and receives to the previous and the next "
        "stage. With two stages both are the same rank, and gloo matches untagged messages "
        "between a pair in posting order: the interleaved (VPP) schedule's simultaneous "
        "forward/backward exchange then delivers activations as gradients and the reverse.",
        lambda owner, original: tagged_p2p_ops,
        when=NO_CUDA,
    ),
    Patch(
        "pipeline_p2p_shape_tags",
        "pipeline",
        ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes",),
        "The shapes of variable-length micro-batches are exchanged with the same untagged "
        "pattern, so with two stages they cross first (a size-mismatch error on gloo); and "
        "megatron waits for the shape sends too, which deadlocks the interleaved schedule on "
        "gloo when a stage runs all its micro-batches in warm-up (pp4·vpp2 with 4 of them).",
        lambda owner, original: tagged_communicate_shapes,
        when=NO_CUDA,
    ),
)
