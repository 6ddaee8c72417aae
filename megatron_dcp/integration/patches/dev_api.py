"""The ``upstream`` group of the patch table: megatron-core dev's dynamic-CP names on 0.19.x
(what they do: :mod:`megatron_dcp.integration.megatron_dev_api`). Each name's entry applies only
where the installed megatron-core lacks it, so a megatron-core that has it natively is left alone.
One entry is no dev name: ``upstream_mtp_ratios`` (always) gives the micro-batches verl hands
megatron's schedules the global MTP token ratios (docs/rl.md, "MTP under verl"). The last three,
where verl 0.9 is imported, run verl's value model (its critic,
:mod:`~megatron_dcp.integration.patches.verl_critic`) and its top-k distillation loss
(:mod:`~megatron_dcp.integration.patches.verl_distill`) under dynamic CP, and the one wrapper of
verl's check that lifts those two refusals
(:mod:`~megatron_dcp.integration.patches.verl_refusals`)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Tuple

from megatron_dcp.integration.patches.mtp_loss import active_mtp_ratios, mtp_token_ratios
from megatron_dcp.integration.patches.table import MISSING, Condition, Patch, resolve
from megatron_dcp.integration.patches.verl_critic import CRITIC_PATCHES
from megatron_dcp.integration.patches.verl_distill import VERL_DISTILL_PATCHES
from megatron_dcp.integration.patches.verl_refusals import REFUSAL_PATCHES

PARALLEL_STATE = "megatron.core.parallel_state"
DATA_SCHEDULE = "megatron.core.datasets.data_schedule"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
LIST_ITERATOR = type(iter([]))
CONFIG_FIELD = "dynamic_context_parallel"
# The config classes whose generated __init__ must accept the field (dataclass subclasses
# generate their own __init__, which does not call their parent's).
CONFIG_CLASSES = (
    "megatron.core.model_parallel_config:ModelParallelConfig",
    "megatron.core.transformer.transformer_config:TransformerConfig",
    "megatron.core.transformer.transformer_config:MLATransformerConfig",
)
UPSTREAM_NAMES = (
    f"{DATA_SCHEDULE}:DefaultDynamicCPScheduler",
    f"{PARALLEL_STATE}:get_dynamic_data_context_parallel_groups",
    f"{PARALLEL_STATE}:initialize_model_parallel({CONFIG_FIELD}=)",
    f"{CONFIG_CLASSES[0]}.{CONFIG_FIELD}",
)


def _attribute(target: str) -> Any:
    return getattr(*resolve(target), MISSING)


def has_name(name: str) -> bool:
    """Whether megatron-core has one of :data:`UPSTREAM_NAMES` (natively or patched in)."""
    if name.endswith(f"({CONFIG_FIELD}=)"):
        initialize = _attribute(name.split("(")[0])
        return CONFIG_FIELD in inspect.signature(initialize).parameters
    return _attribute(name) is not MISSING


def _lacks(name: str) -> Condition:
    return Condition(f"megatron-core lacks {name.split(':')[-1]}", lambda: not has_name(name))


def _scheduler(owner: Any, original: Any) -> Any:
    from megatron_dcp.integration.megatron_dev_api import DefaultDynamicCPScheduler

    return DefaultDynamicCPScheduler


def _group_getter(owner: Any, original: Any) -> Callable[..., Any]:
    from megatron_dcp.integration.megatron_dev_api import dynamic_group

    def get_dynamic_data_context_parallel_groups(check_initialized=True, group_size=None):
        """This rank's dynamic DP×CP group of ``group_size`` ranks (megatron_dcp)."""
        return dynamic_group(group_size, check_initialized)

    return get_dynamic_data_context_parallel_groups


def _initialize(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """``initialize_model_parallel`` with the keyword: megatron's, then the dynamic groups."""
    from megatron_dcp.integration.megatron_dev_api import create_dynamic_groups

    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, dynamic_context_parallel: bool = False, **kwargs):
        original(*args, **kwargs)
        if dynamic_context_parallel:
            create_dynamic_groups()

    signature = inspect.signature(original)
    keyword = inspect.Parameter(CONFIG_FIELD, inspect.Parameter.KEYWORD_ONLY, default=False)
    initialize_model_parallel.__signature__ = signature.replace(
        parameters=[*signature.parameters.values(), keyword]
    )
    return initialize_model_parallel


def _destroy(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    from megatron_dcp.integration.megatron_dev_api import destroy_dynamic_groups

    @functools.wraps(original)
    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        destroy_dynamic_groups()
        return original(*args, **kwargs)

    return destroy_model_parallel


def _config_init(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """A config ``__init__`` that accepts ``dynamic_context_parallel``. megatron_dcp plans
    outside the pipeline schedule (verl's engine, ``megatron_dcp.adapters``, pretrain_gpt's
    wrapper), so the schedule-driven mode of dev (True) is refused with the fix."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, dynamic_context_parallel: bool = False, **kwargs: Any):
        if dynamic_context_parallel:
            raise ValueError(
                f"{type(self).__name__}(dynamic_context_parallel=True): megatron_dcp plans "
                "each global batch before the pipeline schedule (verl's dynamic CP engine, "
                "megatron_dcp.adapters, or pretrain_gpt --dynamic-context-parallel), not inside "
                "it; pass dynamic_context_parallel=False (verl does)."
            )
        original(self, *args, **kwargs)

    return __init__


def _mtp_depth(model: Any) -> int:
    from megatron.core.utils import get_model_config

    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return int(getattr(get_model_config(chunk), "mtp_num_layers", None) or 0)


def replicated_batch_ratios(micro_batches: list, model: Any) -> Any:
    """The MTP token ratios of the global batch whose verl DCP micro-batches this rank runs (one
    all-reduce of ``1 + depth`` counts over the DP×CP group); None without MTP or for other
    micro-batches."""
    from megatron.core import parallel_state

    from megatron_dcp.integration.megatron_dev_api import replicated_batch_mtp_masks
    from megatron_dcp.runtime.exchange import collective_device

    depth = _mtp_depth(model)
    masks = replicated_batch_mtp_masks(micro_batches) if depth else None
    if masks is None:
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return mtp_token_ratios(masks, depth, group, collective_device(group))


def _replicated_batch_schedule(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """A schedule that, given a list of verl's DCP micro-batches to train on, runs them under
    the global batch's MTP token ratios (``patches.mtp_loss.active_mtp_ratios``)."""

    @functools.wraps(original)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        data_iterator = kwargs.get("data_iterator")
        if kwargs.get("forward_only") or type(data_iterator) is not LIST_ITERATOR:
            return original(*args, **kwargs)
        micro_batches = list(data_iterator)
        kwargs["data_iterator"] = iter(micro_batches)
        with active_mtp_ratios(replicated_batch_ratios(micro_batches, kwargs.get("model"))):
            return original(*args, **kwargs)

    return forward_backward


# Entries that share a condition come in an order where applying one does not end the condition
# of the next (the keyword's entry last, the field's after the constructors).
UPSTREAM_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "upstream_scheduler",
        "upstream",
        (UPSTREAM_NAMES[0],),
        "megatron-core 0.19.x has no DefaultDynamicCPScheduler (dev's dynamic-CP planner).",
        _scheduler,
        when=_lacks(UPSTREAM_NAMES[0]),
    ),
    Patch(
        "upstream_group_getter",
        "upstream",
        (UPSTREAM_NAMES[1],),
        "megatron-core 0.19.x names its per-size DP×CP groups get_hybrid_data_context_"
        "parallel_groups and has no one-rank group.",
        _group_getter,
        when=_lacks(UPSTREAM_NAMES[1]),
    ),
    Patch(
        "upstream_destroy",
        "upstream",
        (f"{PARALLEL_STATE}:destroy_model_parallel",),
        "destroy_model_parallel must also destroy the dynamic groups initialize created.",
        _destroy,
        when=_lacks(UPSTREAM_NAMES[2]),
    ),
    Patch(
        "upstream_initialize",
        "upstream",
        (f"{PARALLEL_STATE}:initialize_model_parallel",),
        "megatron-core 0.19.x's initialize_model_parallel has no dynamic_context_parallel "
        "keyword (engines check its signature).",
        _initialize,
        when=_lacks(UPSTREAM_NAMES[2]),
    ),
    Patch(
        "upstream_config_init",
        "upstream",
        tuple(f"{name}.__init__" for name in CONFIG_CLASSES),
        "megatron-core 0.19.x's config constructors reject dynamic_context_parallel=.",
        _config_init,
        when=_lacks(UPSTREAM_NAMES[3]),
    ),
    Patch(
        "upstream_mtp_ratios",
        "upstream",
        tuple(
            f"{SCHEDULES}:{name}"
            for name in (
                "forward_backward_no_pipelining",
                "forward_backward_pipelining_without_interleaving",
                "forward_backward_pipelining_with_interleaving",
            )
        ),
        "An engine that hands megatron's schedule micro-batches cut from a replicated batch "
        "(verl's dynamic CP) builds their PackedSeqParams itself: megatron weighs each MTP "
        "depth per slice of each micro-batch, so the MTP gradient depends on the packing.",
        _replicated_batch_schedule,
    ),
    Patch(
        "upstream_config_field",
        "upstream",
        (UPSTREAM_NAMES[3],),
        "megatron-core 0.19.x's configs have no dynamic_context_parallel field (its default).",
        lambda owner, original: False,
        when=_lacks(UPSTREAM_NAMES[3]),
    ),
    *CRITIC_PATCHES,
    *VERL_DISTILL_PATCHES,
    *REFUSAL_PATCHES,
)
