"""The ``upstream`` group's verl entries: verl 0.9's value model (its PPO critic) under dynamic CP.

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

So two entries, applied only where verl 0.9 is imported in the process (verl imports
``megatron_dcp.verl_plugin`` itself, inside ``import verl``): the value engine's forward step
under DCP passes what the language-model engine passes (``local_cp_size``, the padding mask),
and the check then lets value models through; every other refusal of verl's check stays. The
lift holds only while the forward entry is applied. The same wrapper of the check (the table's
only one) also lifts verl's distillation refusal while :mod:`.verl_distill`'s entry is applied.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, Tuple

from megatron_dcp.integration.patches.table import Condition, Patch

VERL_ENGINE = "verl.workers.engine.megatron.transformer_impl"
VERL_VERSION = "0.9."
VALUE_FORWARD = f"{VERL_ENGINE}:MegatronEngineWithValueHead.forward_step"
DCP_CHECK = f"{VERL_ENGINE}:_check_dcp_unsupported_features"
PASSES_LOCAL_CP_SIZE = "passes_local_cp_size"  # marks megatron_dcp's value forward step


def verl_engine_present() -> bool:
    """verl 0.9 is imported in this process and its Megatron engine imports."""
    verl = sys.modules.get("verl")
    if verl is None or not str(getattr(verl, "__version__", "")).startswith(VERL_VERSION):
        return False
    try:
        importlib.import_module(VERL_ENGINE)
    except ImportError:
        return False
    return True


VERL_IMPORTED = Condition("verl 0.9 imported, its Megatron engine importable", verl_engine_present)


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

    forward_step.passes_local_cp_size = True  # PASSES_LOCAL_CP_SIZE
    return forward_step


class LanguageModelView:
    """A model config as verl's DCP check sees it once the value head is lifted: the same in
    every attribute but ``model_type``."""

    model_type = "language_model"

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def value_forward_fixed(engine_module: Any) -> bool:
    """Whether the value engine's forward step is megatron_dcp's (the lift's precondition)."""
    forward = engine_module.MegatronEngineWithValueHead.forward_step
    return bool(getattr(forward, PASSES_LOCAL_CP_SIZE, False))


def _distillation_lifted(batch: Any) -> Any:
    """The batch as verl's check is shown it (:func:`.verl_distill.distillation_lifted`)."""
    # Imported here: verl_distill imports this module (VERL_IMPORTED).
    from megatron_dcp.integration.patches.verl_distill import distillation_lifted

    return distillation_lifted(batch)


def _lifted_check(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's DCP check (the table's one wrapper of it) with two refusals lifted, each only while
    its fixing entry is applied: value models (:func:`value_forward_fixed`) and top-k
    distillation (:func:`.verl_distill.topk_loss_fixed`); its other refusals unchanged."""

    @functools.wraps(original)
    def check(engine_config, model_config, tf_config=None, batch=None):
        value_model = getattr(model_config, "model_type", None) == "value_model"
        if value_model and value_forward_fixed(owner):
            model_config = LanguageModelView(model_config)
        batch = _distillation_lifted(batch)
        return original(engine_config, model_config, tf_config=tf_config, batch=batch)

    return check


# The forward entry first: the lift checks that it is applied.
VERL_PATCHES: Tuple[Patch, ...] = (
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
    Patch(
        "upstream_verl_value_model",
        "upstream",
        (DCP_CHECK,),
        "verl 0.9 refuses value models (its PPO critic) and top-k distillation under dynamic "
        "CP; with the value forward and the teacher's top-k on the micro-batch's group they "
        "run, so only those refusals are lifted, each while its fixing entry is applied.",
        _lifted_check,
        when=VERL_IMPORTED,
    ),
)
