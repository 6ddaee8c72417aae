"""The ``upstream`` group's one wrapper of verl 0.9's dynamic-CP check, and what verl's entries
share: the condition they apply under and the marks their fixes carry.

verl 0.9.1's ``_check_dcp_unsupported_features`` (``verl/workers/engine/megatron/transformer_impl.py``)
refuses value models ("Dynamic CP currently supports language models only") and distillation
("Dynamic CP does not support distillation") under dynamic CP, and rightly so as verl stands:
its value forward and its top-k distillation loss shard on the static CP group
(:mod:`.verl_critic`, :mod:`.verl_distill` fix each). The wrapper here lifts each of those two
refusals only while its fixing entry is applied (the fix's mark on verl's function), and leaves
every other refusal of verl's check as it is. Every verl entry applies only where verl 0.9 is
imported in the process (verl imports ``megatron_dcp.verl_plugin`` itself, inside ``import
verl``), so a process without verl never imports verl's engine.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, Tuple

from megatron_dcp.integration.patches.table import Condition, Patch

VERL_ENGINE = "verl.workers.engine.megatron.transformer_impl"
VERL_VERSION = "0.9."
VERL_DISTILL = "verl.trainer.distillation.losses"
DCP_CHECK = f"{VERL_ENGINE}:_check_dcp_unsupported_features"
PASSES_LOCAL_CP_SIZE = "passes_local_cp_size"  # marks megatron_dcp's value forward step
SHARDS_ON_GROUP = "shards_on_micro_batch_group"  # marks megatron_dcp's top-k loss
DISTILL_FLAGS = ("distillation_use_topk", "distillation_only")


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


def topk_loss_fixed() -> bool:
    """Whether verl's top-k loss dispatch is megatron_dcp's (:mod:`.verl_distill`; the
    distillation lift's precondition)."""
    losses = importlib.import_module(VERL_DISTILL)
    return bool(getattr(losses.compute_topk_loss, SHARDS_ON_GROUP, False))


def distillation_lifted(batch: Any) -> Any:
    """The batch verl's DCP check is shown: a shallow copy with the distillation flags off when
    megatron_dcp's top-k loss is applied, else the batch itself (the refusal then stands)."""
    from verl.utils import tensordict_utils as tu

    if batch is None or not topk_loss_fixed():
        return batch
    if not any(tu.get_non_tensor_data(batch, key=key, default=False) for key in DISTILL_FLAGS):
        return batch
    shown = batch.copy()
    tu.assign_non_tensor(shown, **{key: False for key in DISTILL_FLAGS})
    return shown


def _lifted_check(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's DCP check (the table's one wrapper of it) with two refusals lifted, each only while
    its fixing entry is applied: value models (:func:`value_forward_fixed`) and top-k
    distillation (:func:`topk_loss_fixed`); its other refusals unchanged."""

    @functools.wraps(original)
    def check(engine_config, model_config, tf_config=None, batch=None):
        value_model = getattr(model_config, "model_type", None) == "value_model"
        if value_model and value_forward_fixed(owner):
            model_config = LanguageModelView(model_config)
        batch = distillation_lifted(batch)
        return original(engine_config, model_config, tf_config=tf_config, batch=batch)

    return check


REFUSAL_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "upstream_verl_refusals",
        "upstream",
        (DCP_CHECK,),
        "verl 0.9 refuses value models (its PPO critic) and top-k distillation under dynamic "
        "CP; with the value forward and the teacher's top-k on the micro-batch's group they "
        "run, so only those refusals are lifted, each while its fixing entry is applied.",
        _lifted_check,
        when=VERL_IMPORTED,
    ),
)
