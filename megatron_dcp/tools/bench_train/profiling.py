"""``bench-train --profile``: where a training step's time goes, per arm, from ``torch.profiler``.

While a profiled step runs, :func:`marked_regions` names its parts with ``record_function`` ranges
(``dcp::<region>``):

- per micro-batch: megatron's ``forward_step`` and ``backward_step``;
- in the model: embedding, norms, QKV and output projections, RoPE, core attention, the K/V
  exchange inside it (the CP all-gather), MLP, output layer, loss;
- outside the model: the global batch's preparation (reading the samples, planning, routing,
  packing), on the main thread or on the prefetch thread.

:func:`attribute` turns the profiler's events into seconds per region, one pass: every event's
own (self) time goes to the innermost ``dcp::`` range around it. A backward op has no range
around it; it goes to the region of the forward op that made its autograd node (the same
``sequence_nr``), so each region is split into its forward and its backward time. Collectives
(gloo and NCCL ops) are counted apart as well, by the region they run in. What no region claims
is counted as such: inside a step, the schedule's and megatron's own host work; outside, the
rest of the call. The profiler's overhead inflates every op a little, the many small ones most:
the report gives the profiled call's wall time beside the unprofiled median.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_dcp.integration.patches.table import swapped_attribute

PREFIX = "dcp::"
FORWARD_STEP, BACKWARD_STEP = "forward step", "backward step"
# Preparation of the global batch (DCPForwardBackward): reading, planning, routing, packing.
PREPARATION = ("read samples", "plan", "route", "pack")
# Model submodules by the end of their qualified name, the first match wins.
MODULE_REGIONS: Tuple[Tuple[str, str], ...] = (
    ("core_attention", "core attention"),
    ("linear_qkv", "QKV/out projections"),
    ("linear_proj", "QKV/out projections"),
    ("mlp", "MLP"),
    ("output_layer", "output layer"),
    ("layernorm", "norms"),
    ("embedding", "embedding"),
)
# Functions wrapped in a range while profiling: (module, attribute, region).
FUNCTION_REGIONS: Tuple[Tuple[str, str, str], ...] = (
    ("megatron.core.pipeline_parallel.schedules", "forward_step", FORWARD_STEP),
    ("megatron.core.pipeline_parallel.schedules", "backward_step", BACKWARD_STEP),
    ("megatron.core.transformer.attention", "apply_rotary_pos_emb", "RoPE"),
    ("megatron_dcp.runtime.attention", "gather_sequence_tokens", "K/V exchange"),
    ("megatron_dcp.integration.forward_backward", "take_samples", "read samples"),
    ("megatron_dcp.integration.forward_backward", "plan_with", "plan"),
)
METHOD_REGIONS: Tuple[Tuple[str, str, str, str], ...] = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "compute_language_model_loss", "loss"),
    ("megatron_dcp.integration.forward_backward", "DCPForwardBackward", "route", "route"),
    ("megatron_dcp.integration.forward_backward", "DCPForwardBackward", "pack", "pack"),
)  # fmt: skip
COLLECTIVE_MARKS = ("gloo:", "nccl:", "c10d::", "record_param_comms")
UNCLAIMED_STEP = "schedule and step host work"
UNCLAIMED = "outside the steps"
BACKWARD_ENGINE = "autograd engine"


def ranged(function: Callable, region: str) -> Callable:
    """``function`` inside a ``dcp::<region>`` range."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(PREFIX + region):
            return function(*args, **kwargs)

    return call


def module_region(name: str) -> Optional[str]:
    """The region of a model submodule by its qualified name (None: not one of the regions)."""
    leaf = name.rsplit(".", 1)[-1]
    for suffix, region in MODULE_REGIONS:
        if leaf.endswith(suffix):
            return region
    return None


def hook_modules(stack: ExitStack, models: List[torch.nn.Module]) -> None:
    """Ranges around the forward of every region submodule of ``models``."""
    for model in models:
        for name, module in model.named_modules():
            region = module_region(name)
            if region is None:
                continue
            open_ranges: List[Any] = []

            def enter(_module: Any, _inputs: Any, region: str = region, opened=open_ranges) -> None:
                opened.append(torch.ops.profiler._record_function_enter_new(PREFIX + region))

            def leave(_module: Any, _inputs: Any, _output: Any, opened=open_ranges) -> None:
                torch.ops.profiler._record_function_exit(opened.pop())

            stack.callback(module.register_forward_pre_hook(enter).remove)
            stack.callback(module.register_forward_hook(leave).remove)


@contextmanager
def marked_regions(models: List[torch.nn.Module]) -> Iterator[None]:
    """The ``dcp::`` ranges of the module docstring, in place for the block."""
    with ExitStack() as stack:
        for module_name, attribute, region in FUNCTION_REGIONS:
            owner = importlib.import_module(module_name)
            wrapped = ranged(getattr(owner, attribute), region)
            stack.enter_context(swapped_attribute(owner, attribute, wrapped))
        for module_name, class_name, method, region in METHOD_REGIONS:
            owner = getattr(importlib.import_module(module_name), class_name)
            wrapped = ranged(getattr(owner, method), region)
            stack.enter_context(swapped_attribute(owner, method, wrapped))
        hook_modules(stack, models)
        yield


def region_of(event: Any) -> Optional[str]:
    """The innermost ``dcp::`` range around ``event`` (itself included), without the prefix."""
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX):]
        event = event.cpu_parent
    return None


def backward_node(event: Any) -> Optional[Any]:
    """The autograd engine's evaluation of one node that ``event`` runs in, if any."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event
        event = event.cpu_parent
    return None


def is_collective(event: Any) -> bool:
    return any(mark in event.name for mark in COLLECTIVE_MARKS)


def attribute(events: List[Any]) -> Dict[str, Any]:
    """Seconds per (thread role, region, direction) from the profiler's ``events``: see the
    module docstring. Returns ``{"main": {...}, "background": {...}, "collectives": {...},
    "wall_s": ...}``, each inner dict ``"region/forward"`` or ``"region/backward"`` → seconds."""
    main = {e.thread for e in events if e.name == PREFIX + FORWARD_STEP}
    forward_region: Dict[int, str] = {}
    for event in events:
        if event.sequence_nr >= 0 and backward_node(event) is None:
            forward_region.setdefault(event.sequence_nr, forward_name(event))
    totals: Dict[str, Dict[str, float]] = {"main": {}, "background": {}, "collectives": {}}
    for event in events:
        key = event_key(event, forward_region)
        role = "main" if event.thread in main else "background"
        seconds = event.self_cpu_time_total / 1e6
        totals[role][key] = totals[role].get(key, 0.0) + seconds
        if is_collective(event):
            totals["collectives"][key] = totals["collectives"].get(key, 0.0) + seconds
    starts = [e.time_range.start for e in events] or [0]
    ends = [e.time_range.end for e in events] or [0]
    return {**totals, "wall_s": (max(ends) - min(starts)) / 1e6}


def event_key(event: Any, forward_region: Dict[int, str]) -> str:
    """``region/forward`` or ``region/backward`` for one event (see :func:`attribute`)."""
    node = backward_node(event)
    if node is not None:
        return forward_region.get(node.sequence_nr, BACKWARD_ENGINE) + "/backward"
    if region_of(event) == BACKWARD_STEP:
        return BACKWARD_ENGINE + "/backward"
    return forward_name(event) + "/forward"


def forward_name(event: Any) -> str:
    """The region a forward event is counted in: its innermost range, the step's own host work
    for one directly inside a forward step, :data:`UNCLAIMED` outside every range."""
    region = region_of(event)
    if region == FORWARD_STEP:
        return UNCLAIMED_STEP
    return region or UNCLAIMED


@contextmanager
def profiled(models: List[torch.nn.Module], into: Dict[str, Any]) -> Iterator[None]:
    """Profile the block's CPU work with the ranges in place; ``into`` receives
    :func:`attribute`'s figures and ``into["trace"]`` the profiler (for a Chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        with marked_regions(models):
            yield
    into.update(attribute(list(profiler.events())))
    into["trace"] = profiler
