"""Multi-latent attention (MLA) on a DCP micro-batch's CP group: the patch-table entry.

megatron-core 0.19.2's ``MLASelfAttention`` has its own ``forward`` (the ``attention_rope``
entry on ``Attention.forward`` does not reach it) and applies RoPE to the decoupled positional
part of Q and K itself, in ``get_query_key_value_tensors``:

- over ``self.pg_collection.cp``, the static CP group captured at construction (unfused:
  ``apply_rotary_pos_emb(cp_group=...)``; fused YaRN: ``cp_rank`` / ``cp_size`` of it);
- with the rotary table cut to the local token count when ``config.context_parallel_size == 1``
  (right for a whole pack on one rank, too short for a pack sharded over a larger DCP group);
- after asserting ``packed_seq_params.local_cp_size is None`` ("hybrid_context_parallel is not
  supported with MLA yet"): the two points above are what a per-micro-batch CP size breaks.

For a DCP micro-batch the entry runs the original with the micro-batch's group as
``pg_collection.cp``, a config whose ``context_parallel_size`` is that group's size, and
``local_cp_size`` hidden from the assertion, whose premise now holds: nothing else in the function
reads the CP size or group. Everything after it (the THD value padding of V to Q's head dimension,
the core attention) gets the micro-batch's own ``PackedSeqParams``: the reference attention and
Transformer Engine (``te_attention`` entry) run on its ``cp_group``. The padding itself reads no
CP state. Static-CP and unpacked forwards take megatron's path unchanged.

Selective recomputation of ``mla_up_proj`` re-runs this RoPE in the backward pass, outside the
switch: ``integration.model_checks.check_mla`` refuses it under DCP.
"""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Tuple

from megatron_dcp.integration.patches.cp_switching import (
    micro_batch_cp_group,
    swap_pg_collection_cp,
)
from megatron_dcp.integration.patches.table import Patch, swapped_attribute


def mla_qkv_switching(original: Callable) -> Callable:
    """``MLASelfAttention.get_query_key_value_tensors`` on the micro-batch's CP group (module
    docstring); ``packed_seq_params`` is found by name among the call's arguments."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_query_key_value_tensors(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        group = micro_batch_cp_group(params)
        if group is None:
            return original(self, *args, **kwargs)
        bound.arguments["packed_seq_params"] = without_local_cp_size(params)
        with swap_mla_cp(self, group):
            return original(*bound.args, **bound.kwargs)

    return get_query_key_value_tensors


def without_local_cp_size(packed_seq_params: Any) -> Any:
    """A copy of ``packed_seq_params`` without ``local_cp_size`` (the original is untouched: the
    core attention still gets it)."""
    params = copy.copy(packed_seq_params)
    params.local_cp_size = None
    return params


@contextmanager
def swap_mla_cp(module: Any, group: Any) -> Iterator[None]:
    """``module.pg_collection.cp`` is ``group`` and ``module.config.context_parallel_size`` its
    size for the block (shallow copies: the collection and the config are shared)."""
    config = copy.copy(module.config)
    config.context_parallel_size = group.size()
    with swap_pg_collection_cp(module, group), swapped_attribute(module, "config", config):
        yield


MLA_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "mla_rope",
        "dcp",
        (
            "megatron.core.transformer.multi_latent_attention:"
            "MLASelfAttention.get_query_key_value_tensors",
        ),
        "MLASelfAttention asserts local_cp_size is None and applies RoPE to the decoupled "
        "positional part of Q and K over the static CP group (pg_collection.cp), cutting the "
        "rotary table to the local token count when the static CP size is 1: wrong positions, "
        "or a shape error, for a micro-batch on another CP group.",
        lambda owner, original: mla_qkv_switching(original),
    ),
)
