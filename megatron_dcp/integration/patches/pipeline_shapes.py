"""Pipeline messages of a DCP step sized from its plan: the ``pipeline_planned_shapes`` entry of
the patch table.

megatron-core 0.19.2 receives a pipeline activation or gradient into a buffer of the shape the
schedule passes, unless ``config.variable_seq_lengths`` is on, which DCP sets (its micro-batches
differ in length). Then every p2p call (``P2PCommunicator._communicate``) first exchanges the
shapes with the neighbouring stages (``_communicate_shapes``: three integers each way, then
``torch.cuda.synchronize()`` and a ``.tolist()`` of what arrived): a host synchronisation per
pipeline message on a GPU, on the training thread.

Under DCP no stage needs to ask. The ranks of one pipeline share a DP×CP position, so they hold
the same local token count T of every micro-batch of the plan, and the tensors between stages are
``[T / TP under sequence parallelism, 1, hidden]``, activations forward and their gradients
backward. Which micro-batch each message carries follows from megatron's schedules:

- every stage runs its forward steps over the (micro-batch, model chunk) pairs in one order
  (:func:`forward_order`: the micro-batches in groups of ``microbatch_group_size_per_vp_stage``,
  each group through every chunk in turn; one chunk without VPP), and its k-th backward step
  runs the k-th forward step's micro-batch on the mirrored chunk (each chunk's backward steps
  take its micro-batches first in, first out);
- a stage sends every forward step's output to the next stage but those of the last stage's
  last chunk (the model's output), and every backward step's input gradient to the previous
  stage but those of the first stage's first chunk (the embedding's);
- p2p delivers each direction between two ranks in order (on gloo, with the direction tags of
  ``gloo_pipeline.py``).

So a stage receives from the previous stage the micro-batches that stage sends forward, in that
order, and from the next stage those it sends backward. While a DCP step runs
(:func:`planned_shapes`), megatron's ``_communicate`` runs with its shape exchange answered from
these queues: no message, no synchronisation. Each shape a stage sends is checked on the host
against the plan, so an order that ever disagreed with megatron's would fail at once, naming the
micro-batch, instead of receiving into a buffer of the wrong size. Outside a DCP step megatron's
own exchange runs (on gloo the tagged one of ``gloo_pipeline.py``).
"""

from __future__ import annotations

import functools
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

from megatron_dcp.integration.patches.table import Patch

Shape = List[int]
NOT_RECEIVED = (0, 0, 0)  # megatron's answer for a direction a call does not receive


def forward_order(num_microbatches: int, num_chunks: int, group_size: int) -> List[Tuple[int, int]]:
    """(micro-batch, model chunk) of each forward step every pipeline stage runs, in order: the
    micro-batches in groups of ``group_size`` (the last group takes every one left), each group
    through chunk 0, 1, ... in turn."""
    order: List[Tuple[int, int]] = []
    for first in range(0, num_microbatches, group_size):
        end = num_microbatches if first + group_size >= num_microbatches else first + group_size
        order += [(mb, chunk) for chunk in range(num_chunks) for mb in range(first, end)]
    return order


@dataclass
class StageMessages:
    """The micro-batch of each pipeline message of one stage, per direction, in order; consumed
    as megatron posts the messages."""

    send_next: Deque[int]
    recv_prev: Deque[int]
    send_prev: Deque[int]
    recv_next: Deque[int]


@dataclass
class PlannedShapes:
    """The pipeline messages of one DCP step: ``local_tokens[m]`` is this pipeline's token count
    of micro-batch ``m`` (every stage holds the same), ``sequence_divisor`` the TP size under
    sequence parallelism (else 1); without backward messages when ``forward_only``."""

    local_tokens: Tuple[int, ...]
    hidden_size: int
    num_chunks: int = 1
    group_size: int = 1
    sequence_divisor: int = 1
    forward_only: bool = False
    _stages: Dict[Tuple[int, int], StageMessages] = field(default_factory=dict, repr=False)

    def shape(self, microbatch: int) -> Shape:
        """The activation (and gradient) shape of ``microbatch`` between two stages."""
        tokens = self.local_tokens[microbatch] // self.sequence_divisor
        return [tokens, 1, self.hidden_size]

    def sent(self, stage: int, stages: int, forward: bool) -> List[int]:
        """The micro-batches whose tensors ``stage`` sends to the next stage (``forward``) or
        to the previous one, in order."""
        if not forward and self.forward_only:
            return []
        edge = stage == (stages - 1 if forward else 0)  # the model's output, the embedding's
        order = forward_order(len(self.local_tokens), self.num_chunks, self.group_size)
        return [mb for mb, chunk in order if not (edge and chunk == self.num_chunks - 1)]

    def messages(self, stage: int, stages: int) -> StageMessages:
        """``stage``'s queues (made at its first message of the step)."""
        if (stage, stages) not in self._stages:
            self._stages[stage, stages] = StageMessages(
                send_next=deque(self.sent(stage, stages, forward=True)),
                recv_prev=deque(self.sent((stage - 1) % stages, stages, forward=True)),
                send_prev=deque(self.sent(stage, stages, forward=False)),
                recv_next=deque(self.sent((stage + 1) % stages, stages, forward=False)),
            )
        return self._stages[stage, stages]

    def exchange(
        self, stage: int, stages: int, sends: Tuple[Any, Any], receives: Tuple[bool, bool]
    ) -> Tuple[Shape, Shape]:
        """What megatron's ``_communicate_shapes`` returns, from the plan: the shapes received
        from the previous and the next stage (``receives``: whether each is received). The
        tensors ``sends`` (to the next stage, to the previous one; None: no send) are checked
        against it."""
        queues = self.messages(stage, stages)
        self._check_sent(queues.send_next, sends[0], stage, "activation to the next stage")
        self._check_sent(queues.send_prev, sends[1], stage, "gradient to the previous stage")
        previous = self._received(queues.recv_prev, receives[0], stage, "activation")
        following = self._received(queues.recv_next, receives[1], stage, "gradient")
        return previous, following

    def _received(self, queue: Deque[int], received: bool, stage: int, kind: str) -> Shape:
        if not received:
            return list(NOT_RECEIVED)
        if not queue:
            raise RuntimeError(
                f"pipeline stage {stage} receives one {kind} more than the DCP plan's "
                f"{len(self.local_tokens)} micro-batches send it: megatron's schedule no longer "
                "sends in the order integration/patches/pipeline_shapes.py derives"
            )
        return self.shape(queue.popleft())

    def _check_sent(self, queue: Deque[int], tensor: Any, stage: int, kind: str) -> None:
        if tensor is None:
            return
        planned = self.shape(queue.popleft()) if queue else None
        if planned != list(tensor.size()):
            raise RuntimeError(
                f"pipeline stage {stage} sends an {kind} of shape {list(tensor.size())}, but the "
                f"DCP plan sizes that message {planned} (None: no message left): the peer would "
                "receive into a buffer of the wrong size (integration/patches/pipeline_shapes.py)"
            )


# The pipeline messages of the DCP step running now (None outside one).
_ACTIVE: List[Optional[PlannedShapes]] = [None]


@contextmanager
def planned_shapes(shapes: Optional[PlannedShapes]) -> Iterator[None]:
    """While the block runs, megatron's pipeline p2p takes its shapes from ``shapes``."""
    previous, _ACTIVE[0] = _ACTIVE[0], shapes
    try:
        yield
    finally:
        _ACTIVE[0] = previous


class PlannedCommunicator:
    """Stands in for megatron's ``P2PCommunicator`` inside its own ``_communicate``: every
    attribute is the communicator's but the shape exchange, which the plan answers."""

    def __init__(self, communicator: Any, shapes: PlannedShapes) -> None:
        self._communicator = communicator
        self._shapes = shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._communicator, name)

    def _communicate_shapes(
        self, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool
    ) -> Tuple[Shape, Shape]:
        stage, stages = self._communicator.current_stage, self._communicator.total_stages
        sends, receives = (tensor_send_next, tensor_send_prev), (recv_prev, recv_next)
        return self._shapes.exchange(stage, stages, sends, receives)


def planned_communicate(original: Callable) -> Callable:
    """``P2PCommunicator._communicate`` that, during a DCP step, sizes its receive buffers from
    the plan instead of exchanging shapes; megatron's own outside one."""

    @functools.wraps(original)
    def _communicate(self: Any, *args: Any, **kwargs: Any) -> Any:
        shapes = _ACTIVE[0]
        if shapes is None:
            return original(self, *args, **kwargs)
        return original(PlannedCommunicator(self, shapes), *args, **kwargs)

    return _communicate


SHAPE_PATCHES = (
    Patch(
        "pipeline_planned_shapes",
        "pipeline",
        ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",),
        "With variable_seq_lengths, which DCP sets, every pipeline p2p call first exchanges the "
        "tensor shapes with the neighbouring stages, then calls torch.cuda.synchronize() and "
        "reads them with .tolist(): a host synchronisation per message, though every stage of "
        "a DCP step knows each micro-batch's shape from the plan.",
        lambda owner, original: planned_communicate(original),
    ),
)
