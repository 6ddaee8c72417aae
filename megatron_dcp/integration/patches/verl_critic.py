"""The ``upstream`` group's verl entry for value models: verl 0.9's PPO critic under dynamic CP.

verl 0.9.1 refuses a value model under dynamic CP (``_check_dcp_unsupported_features`` in
``verl/workers/engine/megatron/transformer_impl.py``: "Dynamic CP currently supports language
models only"), and rightly so as it stands: its value engine's ``forward_step``
(``MegatronEngineWithValueHead``) hands verl's THD forward neither the micro-batch's dynamic CP
size nor its router padding mask. Without ``local_cp_size`` verl's ``preprocess_thd_engine`` and
``postprocess_thd_engine`` shard, gather and un-zigzag on the *static* CP group, while verl's
scheduler gave each rank the samples of its *dynamic* group: a rank of a CP-1 group splits its
own sequences with a static sibling that holds other ones (wrong values, or a collective that
does not match), and ``PackedSeqParams`` names no ``cp_group``.

Everything after the forward is already right for a per-token output of width 1 (docs/rl.md,
"verl's critic under DCP"): ``postprocess_thd_engine`` all-gathers the group's chunks and
un-zigzags each sequence whatever the trailing shape (``[1, T_local, 1]`` here), verl's value
forward squeezes the width, ``postprocess_dynamic_cp_batch`` puts the group leaders' samples
back in batch order, and the value right-shift (the value at position t−1 predicts response
token t) is verl's ``no_padding_2_padding``, applied per sequence on whole sequences: inside
the value loss on the micro-batch (after the CP gather) and in the trainer after the order is
restored.

So one entry, applied only where verl 0.9 is imported in the process: the value engine's
forward step under DCP passes what the language-model engine passes (``local_cp_size``, the
padding mask). While it is applied, the wrapper of verl's check (:mod:`.verl_refusals`) lets
value models through.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

from megatron_dcp.integration.patches.table import Patch
from megatron_dcp.integration.patches.verl_refusals import (
    PASSES_LOCAL_CP_SIZE,
    VERL_ENGINE,
    VERL_IMPORTED,
)

VALUE_FORWARD = f"{VERL_ENGINE}:MegatronEngineWithValueHead.forward_step"


def _micro_batch_group(batch: Any) -> Tuple[int, Any]:
    """The dynamic CP size and router padding mask verl's scheduler put on a micro-batch."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DCP_PADDING_MASK

    size = tu.get_non_tensor_data(data=batch, key="local_cp_size", default=None)
    padding = tu.get_non_tensor_data(data=batch, key=DCP_PADDING_MASK, default=None)
    if size is None or padding is None:
        raise RuntimeError(
            "verl's value model under dynamic CP: the micro-batch has no local_cp_size or "
            "padding mask; it must come from verl's DynamicCPScheduler (forward_backward_batch)"
        )
    return size, padding


def value_forward_on_group(engine: Any, batch: Any, model: Any, postprocess: Callable) -> tuple:
    """verl's value forward of one DCP micro-batch on the micro-batch's own CP group: per-token
    values ``[samples, len]`` (nested, in the micro-batch's order, whole sequences on every rank
    of the group) and the postprocess verl's schedule calls with the model output."""
    from verl.models.mcore import get_mcore_engine_forward_fn
    from verl.utils.device import get_device_id
    from verl.utils.megatron_utils import unwrap_model

    batch = batch.to(get_device_id())
    local_cp_size, padding = _micro_batch_group(batch)
    inputs = engine.prepare_model_inputs(batch)
    input_ids = inputs["input_ids"]
    forward = get_mcore_engine_forward_fn(engine.model_config.hf_config)
    values = forward(
        model,
        input_ids,
        inputs["multi_modal_inputs"],
        value_model=True,
        pad_token_id=engine.model_config.tokenizer.pad_token_id,
        data_format="thd",  # DCP requires use_remove_padding (verl's check)
        local_cp_size=local_cp_size,
        router_padding_mask=padding.to(input_ids.device).unsqueeze(0),
        cp_layout=engine._get_context_parallel_layout(unwrap_model(model)),
    )
    return values, functools.partial(postprocess, data=batch, local_cp_size=local_cp_size)


def _value_forward_step(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """The value engine's forward step: verl's own without DCP; under DCP the micro-batch's
    group (:func:`value_forward_on_group`)."""

    @functools.wraps(original)
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        if not self.engine_config.dynamic_context_parallel:
            return original(
                self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func
            )
        return value_forward_on_group(self, next(batch_iter), model, postprocess_micro_batch_func)

    setattr(forward_step, PASSES_LOCAL_CP_SIZE, True)
    return forward_step


CRITIC_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "upstream_verl_value_forward",
        "upstream",
        (VALUE_FORWARD,),
        "verl 0.9's value engine does not pass the micro-batch's local_cp_size and padding "
        "mask to its THD forward, so under dynamic CP it shards and gathers on the static CP "
        "group while verl's scheduler gave each rank its dynamic group's samples.",
        _value_forward_step,
        when=VERL_IMPORTED,
    ),
)
