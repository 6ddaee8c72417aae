"""Per-micro-batch CP switching of megatron-core 0.19.x's Gated DeltaNet layers: the
``gdn_context_parallel`` entry of the ``dcp`` group.

A ``GatedDeltaNet`` runs context parallelism head-parallel, like Mamba: an all-to-all over the CP
group turns each rank's share of every sequence into whole sequences for a share of the heads,
the short convolution and the gated delta rule run on those, and a second all-to-all turns them
back. The layer reads its CP group from ``pg_collection.cp``, and fixes at construction both
``cp_size`` and what depends on it: ``feat_dim_split`` (the widths of the q/k/v, gate, beta and
alpha sections after the all-to-all), the ``seq_len`` it reconstructs, the per-sequence padding
check, the sequence permutation of packed sequences and the head split in
``_prepare_input_for_gated_delta_rule``. For a DCP micro-batch all of them follow its own group
here (``SOLO_GROUP`` when it runs without CP).

The output all-to-all (``_GDNBase._gated_norm_and_a2a``) is switched on its own as well: with
``--recompute-modules gdn_norm_out`` megatron re-runs it in the backward pass, outside the
forward's switch, with the micro-batch's ``packed_seq_params`` among its arguments.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Tuple

from megatron_dcp.integration.patches.cp_switching import swap_pg_collection_cp, switching
from megatron_dcp.integration.patches.table import Patch, swapped_attribute

GDN_MODULE = "megatron.core.ssm.gated_delta_net"


def feat_dim_split_for(module: Any, cp_size: int) -> Tuple[int, ...]:
    """The widths megatron splits a GDN layer's projection into after the CP all-to-all, for a
    group of ``cp_size``: q, k and v fused (the convolution's input), then each other section
    (gate, beta, alpha) on its own, each divided over the group."""
    sections = module.in_proj_split_sections
    return (sum(sections[:3]) // cp_size, *(width // cp_size for width in sections[3:]))


def check_gdn_group(module: Any, cp_size: int) -> None:
    """A ValueError unless the layer's key and value heads per TP rank split evenly over a group
    of ``cp_size`` (its all-to-all hands each rank whole heads); a RuntimeError if megatron's
    layer no longer splits its projection as :func:`feat_dim_split_for` assumes."""
    if feat_dim_split_for(module, module.cp_size) != tuple(module.feat_dim_split):
        raise RuntimeError(
            f"GatedDeltaNet.feat_dim_split {tuple(module.feat_dim_split)} is not its projection "
            f"sections {tuple(module.in_proj_split_sections)} split over CP {module.cp_size}: "
            "the DCP switch was written for megatron-core 0.19.x's layout."
        )
    key_heads, value_heads = module.num_k_heads_local_tp, module.num_v_heads_local_tp
    if key_heads % cp_size or value_heads % cp_size:
        raise ValueError(
            f"a Gated DeltaNet layer with {key_heads} key and {value_heads} value heads per TP "
            f"rank cannot run on a CP group of {cp_size}: its all-to-all gives every rank whole "
            "heads (--linear-num-key-heads and --linear-num-value-heads / TP must divide by every "
            "CP size a plan uses; the entry point checks that at start-up)."
        )


@contextmanager
def swap_gdn_context_parallel(module: Any, group: Any) -> Iterator[None]:
    """Run a GDN layer on the micro-batch's CP group: ``pg_collection`` (a shallow copy whose
    ``cp`` is the group), ``cp_size`` and ``feat_dim_split`` for its size."""
    size = group.size()
    check_gdn_group(module, size)
    with ExitStack() as stack:
        stack.enter_context(swap_pg_collection_cp(module, group))
        stack.enter_context(swapped_attribute(module, "cp_size", size))
        stack.enter_context(
            swapped_attribute(module, "feat_dim_split", feat_dim_split_for(module, size))
        )
        yield


GDN_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "gdn_context_parallel",
        "dcp",
        (
            f"{GDN_MODULE}.gdn:GatedDeltaNet.forward",
            f"{GDN_MODULE}.common:_GDNBase._gated_norm_and_a2a",
        ),
        "GatedDeltaNet's head-parallel all-to-alls run over the static CP group "
        "(pg_collection.cp), and its cp_size and projection split (feat_dim_split) are fixed at "
        "construction: a DCP micro-batch would exchange heads with ranks holding other "
        "sequences, or fail on the split.",
        lambda owner, original: switching(original, swap_gdn_context_parallel),
    ),
)
