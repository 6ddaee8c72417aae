"""Per-micro-batch CP switching inside megatron-core 0.19.x: every patch of megatron internals.

With DCP each micro-batch brings its own CP group in ``PackedSeqParams`` (``cp_group``,
``local_cp_size``; ``local_cp_size == 1`` with ``cp_group=None`` means "no CP"). Parts of
megatron-core 0.19.2 ignore it and keep using the static CP group they captured at construction.
Each patch below names the upstream behaviour it corrects. All patches:

- are idempotent (a patched function carries ``PATCH_MARK``; applying twice changes nothing),
- switch only when the micro-batch carries DCP parameters (``local_cp_size`` set), so static-CP
  and non-packed runs take megatron's own code path unchanged,
- restore the static state in ``finally`` (an exception mid-forward leaves no stale group),
- are gated on the megatron-core version (:data:`SUPPORTED_VERSIONS`).

The backward passes need no switching: the CP collectives' autograd functions capture the group
they ran with at forward time.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_dcp.integration.megatron_import import import_megatron_core

PATCH_MARK = "_megatron_dcp_patch"
SUPPORTED_VERSIONS = ((0, 19),)


class SoloGroup:
    """Stands for the CP group of a micro-batch that runs without CP (``local_cp_size == 1``).

    Megatron code reached on that path only asks a CP group for ``size()`` and ``rank()``
    (RoPE slicing, MTP rolling, Mamba sizes); a real one-rank communicator per rank would cost a
    ``new_group`` call per rank of the job for nothing.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SoloGroup()"


SOLO_GROUP = SoloGroup()


def micro_batch_cp_group(packed_seq_params: Any) -> Optional[Any]:
    """The CP group a DCP micro-batch runs on: ``packed_seq_params.cp_group``, or
    :data:`SOLO_GROUP` when it runs without CP; None when the micro-batch is not a DCP one
    (no ``local_cp_size``), in which case megatron's static behaviour applies."""
    if packed_seq_params is None or getattr(packed_seq_params, "local_cp_size", None) is None:
        return None
    if packed_seq_params.cp_group is not None:
        return packed_seq_params.cp_group
    if packed_seq_params.local_cp_size != 1:
        raise ValueError(
            f"PackedSeqParams(local_cp_size={packed_seq_params.local_cp_size}, cp_group=None): "
            "a micro-batch with CP needs its cp_group; only local_cp_size=1 may omit it."
        )
    return SOLO_GROUP


@contextmanager
def swapped_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the duration of the block, restoring it even on error."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


Swap = Callable[[Any, Any], ContextManager[None]]


@dataclass(frozen=True)
class Patch:
    """One correction of a megatron-core method: where it lives and what it corrects."""

    name: str
    module: str
    qualname: str
    corrects: str
    swap: Swap

    def target(self) -> Tuple[Any, str]:
        owner = importlib.import_module(self.module)
        *path, attr = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attr


def switching(original: Callable, swap: Swap) -> Callable:
    """Wrap a ``forward`` so that, for a DCP micro-batch, ``swap(self, group)`` is active while
    the original runs. ``packed_seq_params`` is found by name among the call's arguments."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        if params is None and args:
            params = signature.bind_partial(self, *args).arguments.get("packed_seq_params")
        group = micro_batch_cp_group(params)
        if group is None:
            return original(self, *args, **kwargs)
        with swap(self, group):
            return original(self, *args, **kwargs)

    setattr(forward, PATCH_MARK, True)
    return forward


# ------------------------------------------------------------------------------------------------
# The swaps: what each patched forward replaces for the duration of one micro-batch.
# ------------------------------------------------------------------------------------------------


@contextmanager
def swap_pg_collection_cp(module: Any, group: Any) -> Iterator[None]:
    """Replace ``module.pg_collection`` by a shallow copy whose ``cp`` is the micro-batch group
    (the collection object is shared between modules, so it is never mutated)."""
    collection = copy.copy(module.pg_collection)
    collection.cp = group
    with swapped_attribute(module, "pg_collection", collection):
        yield


@contextmanager
def swap_cp_group(module: Any, group: Any) -> Iterator[None]:
    with swapped_attribute(module, "cp_group", group):
        yield


@contextmanager
def swap_mamba_context_parallel(mixer: Any, group: Any) -> Iterator[None]:
    """Run the Mamba mixer with a ``MambaContextParallel`` built for the micro-batch's group
    (cached per group on the mixer: it only holds sizes and references to the parameters)."""
    cache: Dict[int, Any] = mixer.__dict__.setdefault("_dcp_mamba_cp", {})
    if id(group) not in cache:
        cache[id(group)] = (group, mamba_context_parallel_for(mixer.cp, group))
    with swapped_attribute(mixer, "cp", cache[id(group)][1]):
        yield


def mamba_context_parallel_for(static: Any, group: Any) -> Any:
    """A copy of the mixer's ``MambaContextParallel`` re-sized for ``group``."""
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel

    return MambaContextParallel(
        cp_group=group,
        d_inner_local_tp=static.d_inner_local_tp,
        nheads_local_tp=static.nheads_local_tp,
        ngroups_local_tp=static.ngroups_local_tp,
        d_state=static.d_state,
        conv1d_weight_cp1=static.conv1d_weight_cp1,
        conv1d_bias_cp1=static.conv1d_bias_cp1,
        conv1d_padding=static.conv1d_padding,
        dt_bias_cp1=static.dt_bias_cp1,
        A_log_cp1=static.A_log_cp1,
        D_cp1=static.D_cp1,
        D_has_hdim=static.D_has_hdim,
    )


PATCHES: Tuple[Patch, ...] = (
    Patch(
        "attention_rope",
        "megatron.core.transformer.attention",
        "Attention.forward",
        "Attention applies rotary embeddings to THD inputs with the static CP group "
        "(self.pg_collection.cp), not the micro-batch's: wrong positions (fused RoPE) or a "
        "split_with_sizes error (unfused RoPE) whenever the two differ.",
        swap_pg_collection_cp,
    ),
    Patch(
        "gpt_mtp_loss",
        "megatron.core.models.gpt.gpt_model",
        "GPTModel.forward",
        "GPTModel passes the static CP group to process_mtp_loss, which rolls labels and loss "
        "masks across the wrong ranks for a DCP micro-batch.",
        swap_pg_collection_cp,
    ),
    Patch(
        "mtp_block",
        "megatron.core.transformer.multi_token_prediction",
        "MultiTokenPredictionBlock.forward",
        "MultiTokenPredictionBlock keeps the static CP group captured at construction.",
        swap_cp_group,
    ),
    Patch(
        "mtp_layer",
        "megatron.core.transformer.multi_token_prediction",
        "MultiTokenPredictionLayer.forward",
        "MultiTokenPredictionLayer rolls input ids and positions across the static CP group.",
        swap_cp_group,
    ),
    Patch(
        "mamba_mixer",
        "megatron.core.ssm.mamba_mixer",
        "MambaMixer.forward",
        "MambaMixer's context-parallel all-to-alls use the MambaContextParallel built at "
        "construction for the static CP group.",
        swap_mamba_context_parallel,
    ),
)


def megatron_version() -> Tuple[int, ...]:
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def check_version() -> None:
    version = megatron_version()
    if version[:2] not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"megatron_dcp patches megatron-core {SUPPORTED_VERSIONS} internals; found "
            f"{'.'.join(map(str, version))}. Install megatron-core 0.19.x."
        )


def apply_patch(patch: Patch) -> bool:
    """Apply one patch; False when it was already applied."""
    owner, attr = patch.target()
    original = getattr(owner, attr)
    if getattr(original, PATCH_MARK, False):
        return False
    setattr(owner, attr, switching(original, patch.swap))
    return True


def apply_patches() -> List[str]:
    """Apply every patch (idempotent); returns the names of those applied by this call."""
    if not import_megatron_core():
        raise RuntimeError("megatron-core is not importable; see README.md for the install.")
    check_version()
    applied = [patch.name for patch in PATCHES if apply_patch(patch)]
    if patch_te_attention(te_attention_class()):
        applied.append("te_attention")
    if patch_mtp_roll_tensor():
        applied.append("mtp_roll_tensor")
    if patch_pipeline_p2p_tags():
        applied.append("pipeline_p2p_tags")
    return applied


# ------------------------------------------------------------------------------------------------
# Transformer Engine attention
# ------------------------------------------------------------------------------------------------

TE_STATE = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type")


def te_attention_class() -> Optional[type]:
    """megatron's ``TEDotProductAttention`` when Transformer Engine is installed, else None."""
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext.TEDotProductAttention if te_ext.HAVE_TE else None


def cuda_stream() -> Optional[Any]:
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def patch_te_attention(
    cls: Optional[type], make_stream: Callable[[], Optional[Any]] = cuda_stream
) -> bool:
    """Correct 0.19.2's ``TEDotProductAttention.forward`` for DCP (idempotent):

    - it switches TE to ``packed_seq_params.cp_group`` but never restores the static group, so a
      later non-DCP forward (evaluation, static CP) runs on the last micro-batch's group;
    - it creates ``cp_stream`` only when the static CP size is > 1, so DCP with a static CP size
      of 1 hands TE a ``None`` stream: the stream is created lazily here.
    ``cls`` and ``make_stream`` are parameters so that tests can patch a recording stand-in where
    TE and CUDA are absent.
    """
    if cls is None or getattr(cls.forward, PATCH_MARK, False):
        return False
    original = cls.forward

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs):
        params = kwargs.get("packed_seq_params", args[1] if len(args) > 1 else None)
        group = micro_batch_cp_group(params)
        if group is None:
            return original(
                self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs
            )
        ensure_cp_stream(cls, group, make_stream)
        static = {name: getattr(self, name, None) for name in TE_STATE}
        try:
            return original(
                self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs
            )
        finally:
            restore_te_group(cls, self, static)

    setattr(forward, PATCH_MARK, True)
    cls.forward = forward
    return True


def ensure_cp_stream(cls: type, group: Any, make_stream: Callable[[], Optional[Any]]) -> None:
    """Create the CP stream (shared by all instances, as upstream) on first use with CP."""
    if group is not SOLO_GROUP and getattr(cls, "cp_stream", None) is None:
        cls.cp_stream = make_stream()


def restore_te_group(cls: type, module: Any, static: Dict[str, Any]) -> None:
    """Put TE back on the static CP group (through TE's own setter, which updates its state)."""
    super(cls, module).set_context_parallel_group(
        static["cp_group"], static["cp_global_ranks"], static["cp_stream"], static["cp_comm_type"]
    )
    module.cp_group = static["cp_group"]


# ------------------------------------------------------------------------------------------------
# MTP rolling of packed sequences
# ------------------------------------------------------------------------------------------------


def patch_mtp_roll_tensor() -> bool:
    """Correct ``multi_token_prediction.roll_tensor`` for padded THD sequences (idempotent).

    0.19.2 locates each packed sequence's local slice from ``cu_seqlens_q`` (real lengths)
    divided by the CP size, but the local layout is built from the *padded* lengths
    (``cu_seqlens_q_padded``): with padding, every sequence after the first is read at the wrong
    offset. For DCP micro-batches the roll sees the padded boundaries (padding carries no loss,
    so rolling over it changes nothing else).
    """
    from megatron.core.transformer import multi_token_prediction as mtp

    if getattr(mtp.roll_tensor, PATCH_MARK, False):
        return False
    original = mtp.roll_tensor

    @functools.wraps(original)
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        params = packed_seq_params
        if micro_batch_cp_group(params) is not None and params.cu_seqlens_q_padded is not None:
            params = copy.copy(params)
            params.cu_seqlens_q = params.cu_seqlens_q_padded
        return original(tensor, shifts, dims, cp_group=cp_group, packed_seq_params=params)

    setattr(roll_tensor, PATCH_MARK, True)
    mtp.roll_tensor = roll_tensor
    return True


# ------------------------------------------------------------------------------------------------
# Pipeline p2p: direction tags
# ------------------------------------------------------------------------------------------------

FORWARD_TAG, BACKWARD_TAG = 1, 2


def tagged_p2p_ops(
    *,
    tensor_send_prev: Optional[torch.Tensor],
    tensor_recv_prev: Optional[torch.Tensor],
    tensor_send_next: Optional[torch.Tensor],
    tensor_recv_next: Optional[torch.Tensor],
    group: Any,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
) -> list:
    """One batch of pipeline p2p operations, each tagged with its direction (activations
    forward, gradients backward), so that a send is matched with the receive of its direction
    even when the previous and next stage are the same rank (pipeline size 2)."""
    dist = torch.distributed
    planned = (
        (dist.isend, tensor_send_prev, prev_pipeline_rank, BACKWARD_TAG),
        (dist.irecv, tensor_recv_prev, prev_pipeline_rank, FORWARD_TAG),
        (dist.isend, tensor_send_next, next_pipeline_rank, FORWARD_TAG),
        (dist.irecv, tensor_recv_next, next_pipeline_rank, BACKWARD_TAG),
    )
    ops = [dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in planned if t is not None]
    return dist.batch_isend_irecv(ops) if ops else []


def tagged_communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """``P2PCommunicator._communicate_shapes`` with direction tags: the shapes of variable-length
    micro-batches, exchanged before the tensors themselves."""

    def shape_of(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

    recv_prev_shape = torch.zeros(3, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.zeros(3, dtype=torch.int64) if recv_next else None
    for request in tagged_p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=recv_next_shape,
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    ):
        request.wait()
    as_list = lambda shape: [0, 0, 0] if shape is None else shape.tolist()  # noqa: E731
    return as_list(recv_prev_shape), as_list(recv_next_shape)


def patch_pipeline_p2p_tags() -> bool:
    """Correct the pipeline p2p exchange on gloo (idempotent; only when CUDA is absent).

    megatron-core 0.19.2 batches untagged sends and receives to the previous and the next stage.
    With a pipeline of two stages both are the same rank, and gloo matches untagged messages
    between a pair in posting order: the interleaved (VPP) schedule's simultaneous
    forward/backward exchange then delivers activations as gradients and the reverse, and with
    variable sequence lengths the shapes cross first (a size-mismatch error). Tagging each
    message with its direction makes the matching exact.
    """
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    if torch.cuda.is_available() or getattr(p2p._batched_p2p_ops, PATCH_MARK, False):
        return False
    setattr(tagged_p2p_ops, PATCH_MARK, True)
    p2p._batched_p2p_ops = tagged_p2p_ops
    p2p.P2PCommunicator._communicate_shapes = tagged_communicate_shapes
    return True
