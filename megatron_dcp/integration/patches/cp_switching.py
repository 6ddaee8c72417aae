"""Per-micro-batch CP switching inside megatron-core 0.19.x: the DCP entries of the patch table.

With DCP each micro-batch brings its own CP group in ``PackedSeqParams`` (``cp_group``,
``local_cp_size``; ``local_cp_size == 1`` with ``cp_group=None`` means "no CP"). Parts of
megatron-core 0.19.2 ignore it and keep using the static CP group they captured at construction.
Each entry names the upstream behaviour it corrects. The replaced forwards

- switch only when the micro-batch carries DCP parameters (``local_cp_size`` set), so static-CP
  and non-packed runs take megatron's own code path unchanged,
- restore the static state in ``finally`` (an exception mid-forward leaves no stale group).

The backward passes need no switching: the CP collectives' autograd functions capture the group
they ran with at forward time.
"""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Dict, Iterator, NamedTuple, Optional, Tuple

import torch

from megatron_dcp.integration.patches.table import TE_INSTALLED, Patch, swapped_attribute


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


Swap = Callable[[Any, Any], ContextManager[None]]


def switching(
    original: Callable, swap: Swap, group_of: Callable[[Any], Any] = micro_batch_cp_group
) -> Callable:
    """Wrap a ``forward`` so that, for a DCP micro-batch, ``swap(self, group_of(params))`` is
    active while the original runs (``group_of`` returns None for other micro-batches).
    ``packed_seq_params`` is found by name among the call's arguments."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        if params is None and args:
            params = signature.bind_partial(self, *args).arguments.get("packed_seq_params")
        group = group_of(params)
        if group is None:
            return original(self, *args, **kwargs)
        with swap(self, group):
            return original(self, *args, **kwargs)

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


# ------------------------------------------------------------------------------------------------
# Transformer Engine attention
# ------------------------------------------------------------------------------------------------

TE_STATE = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type")


def cuda_stream() -> Optional[Any]:
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def te_attention_forward(
    cls: type, original: Callable, make_stream: Callable[[], Optional[Any]] = cuda_stream
) -> Callable:
    """``TEDotProductAttention.forward`` that, for a DCP micro-batch, creates TE's CP stream
    when needed and restores the static CP group afterwards. ``cls`` and ``make_stream`` are
    parameters so that tests can run it on a recording stand-in where TE and CUDA are absent."""

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

    return forward


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


def padded_roll_tensor(original: Callable) -> Callable:
    """``multi_token_prediction.roll_tensor`` that, for a DCP micro-batch, locates each packed
    sequence by its padded boundaries (padding carries no loss, so rolling over it changes
    nothing else)."""

    @functools.wraps(original)
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        params = packed_seq_params
        if micro_batch_cp_group(params) is not None and params.cu_seqlens_q_padded is not None:
            params = copy.copy(params)
            params.cu_seqlens_q = params.cu_seqlens_q_padded
        return original(tensor, shifts, dims, cp_group=cp_group, packed_seq_params=params)

    return roll_tensor


# ------------------------------------------------------------------------------------------------
# MoE router statistics
# ------------------------------------------------------------------------------------------------


# The DCP wrapper sets this attribute of a micro-batch's PackedSeqParams to TP × its CP group
# when the model has MoE layers and TP > 1 (``integration.process_groups``).
TP_CP_GROUP_ATTRIBUTE = "dcp_tp_cp_group"


class RouterGroups(NamedTuple):
    """A DCP micro-batch's CP group and, when the wrapper set one, its TP × CP group."""

    cp: Any
    tp_cp: Optional[Any]


def micro_batch_router_groups(packed_seq_params: Any) -> Optional[RouterGroups]:
    """:class:`RouterGroups` of a DCP micro-batch; None for other micro-batches."""
    group = micro_batch_cp_group(packed_seq_params)
    if group is None:
        return None
    return RouterGroups(group, getattr(packed_seq_params, TP_CP_GROUP_ATTRIBUTE, None))


def moe_router_switching(original: Callable) -> Callable:
    """``TransformerLayer._forward_mlp`` running its router on the micro-batch's TP × CP group."""
    return switching(original, swap_moe_router_group, micro_batch_router_groups)


@contextmanager
def swap_moe_router_group(layer: Any, groups: RouterGroups) -> Iterator[None]:
    """Run the layer's MoE router on the micro-batch's tensor×context-parallel group: the one its
    tokens are spread over. With TP = 1 that is the micro-batch's CP group itself; with TP > 1
    the TP × CP group the wrapper attached (``groups.tp_cp``; the TP group for a micro-batch
    without CP), refused without one (``check_moe_router``). Token counts per expert and the
    aux-loss token totals are all-reduced over it, and the per-token-loss scale of the aux and z
    losses uses its size.

    The metrics tracker keeps being handed the static group: it all-reduces each metric over the
    group recorded last, once per step, on every rank, so a per-micro-batch group there would
    pair different groups on different ranks. Summed over the static group and averaged over DP,
    the per-rank shares still add up to every micro-batch's aux loss (docs/runtime.md, MoE)."""
    router = getattr(getattr(layer, "mlp", None), "router", None)
    if router is None or getattr(router, "tp_cp_group", None) is None:
        yield
        return
    group = check_moe_router(layer, router, groups)
    static = router.tp_cp_group
    attach = router.attach_and_log_load_balancing_loss

    def attach_and_log_static(activation, coeff, loss, name, reduce_group, *args, **kwargs):
        reduce_group = static if reduce_group is group else reduce_group
        return attach(activation, coeff, loss, name, reduce_group, *args, **kwargs)

    with swapped_attribute(router, "tp_cp_group", group):
        with instance_override(router, "attach_and_log_load_balancing_loss", attach_and_log_static):
            yield


def check_moe_router(layer: Any, router: Any, groups: RouterGroups) -> Any:
    """The group the router of this micro-batch reduces over; refuses what the switch cannot
    cover: TP > 1 without a TP × CP group of the right size (a micro-batch not packed by the DCP
    wrapper, e.g. the RL adapter's), and "moe" recomputation (``integration.model_checks.check_moe``
    refuses it at start-up; this guards other entry points)."""
    tp = router.tp_group.size()
    group = groups.cp if tp == 1 else groups.tp_cp
    if group is None or group.size() != tp * groups.cp.size():
        raise ValueError(
            f"DCP with MoE and tensor parallelism {tp}: the router reduces over TP x (the micro-"
            f"batch's CP group of {groups.cp.size()}), and the micro-batch carries no such group "
            f"({TP_CP_GROUP_ATTRIBUTE}={groups.tp_cp!r}); only the DCP wrapper "
            "(build_forward_backward) attaches it."
        )
    if layer.training and getattr(layer.mlp, "moe_layer_recompute", False):
        raise ValueError(
            "DCP with MoE does not support --recompute-modules moe: the router is re-run in the "
            "backward pass, outside the micro-batch's CP group switch."
        )
    return group


@contextmanager
def instance_override(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Shadow a method with an instance attribute for the block, then remove it again."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


# ------------------------------------------------------------------------------------------------
# The entries
# ------------------------------------------------------------------------------------------------


def _switching_patch(name: str, target: str, corrects: str, swap: Swap) -> Patch:
    return Patch(
        name, "dcp", (target,), corrects, lambda owner, original: switching(original, swap)
    )


DCP_PATCHES: Tuple[Patch, ...] = (
    _switching_patch(
        "attention_rope",
        "megatron.core.transformer.attention:Attention.forward",
        "Attention applies rotary embeddings to THD inputs with the static CP group "
        "(self.pg_collection.cp), not the micro-batch's: wrong positions (fused RoPE) or a "
        "split_with_sizes error (unfused RoPE) whenever the two differ.",
        swap_pg_collection_cp,
    ),
    _switching_patch(
        "gpt_mtp_loss",
        "megatron.core.models.gpt.gpt_model:GPTModel.forward",
        "GPTModel passes the static CP group to process_mtp_loss, which rolls labels and loss "
        "masks across the wrong ranks for a DCP micro-batch.",
        swap_pg_collection_cp,
    ),
    _switching_patch(
        "mtp_block",
        "megatron.core.transformer.multi_token_prediction:MultiTokenPredictionBlock.forward",
        "MultiTokenPredictionBlock keeps the static CP group captured at construction.",
        swap_cp_group,
    ),
    _switching_patch(
        "mtp_layer",
        "megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer.forward",
        "MultiTokenPredictionLayer rolls input ids and positions across the static CP group.",
        swap_cp_group,
    ),
    _switching_patch(
        "mamba_mixer",
        "megatron.core.ssm.mamba_mixer:MambaMixer.forward",
        "MambaMixer's context-parallel all-to-alls use the MambaContextParallel built at "
        "construction for the static CP group.",
        swap_mamba_context_parallel,
    ),
    Patch(
        "moe_router_group",
        "dcp",
        ("megatron.core.transformer.transformer_layer:TransformerLayer._forward_mlp",),
        "The MoE router all-reduces tokens per expert and the aux-loss token counts over the "
        "static TP x CP group (pg_collection.tp_cp) and scales aux and z losses by its size; a "
        "DCP micro-batch's tokens are spread over TP x its own CP group: statistics mixed across "
        "micro-batches (or halved) and losses scaled by the wrong size.",
        lambda owner, original: moe_router_switching(original),
    ),
    Patch(
        "te_attention",
        "dcp",
        ("megatron.core.extensions.transformer_engine:TEDotProductAttention.forward",),
        "TEDotProductAttention switches TE to packed_seq_params.cp_group but never restores the "
        "static group (a later non-DCP forward runs on the last micro-batch's group), and it "
        "creates cp_stream only when the static CP size is > 1 (DCP with static CP 1 hands TE "
        "a None stream).",
        lambda owner, original: te_attention_forward(owner, original),
        when=TE_INSTALLED,
    ),
    Patch(
        "mtp_roll_tensor",
        "dcp",
        ("megatron.core.transformer.multi_token_prediction:roll_tensor",),
        "roll_tensor locates each packed sequence's local slice from cu_seqlens_q (real "
        "lengths) divided by the CP size, but the local layout follows cu_seqlens_q_padded: "
        "with padding, every sequence after the first is read at the wrong offset.",
        lambda owner, original: padded_roll_tensor(original),
    ),
)
