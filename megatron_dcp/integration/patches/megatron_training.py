"""The megatron.training entries of the patch table: Python 3.11 support, and the hook that makes
``pretrain``'s training and evaluation loops run the DCP forward-backward wrapper."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional, Tuple

from megatron_dcp.integration.patches.table import Condition, Patch

BEFORE_PYTHON_3_12 = Condition("Python < 3.12", lambda: sys.version_info < (3, 12))


class ScheduleSlot:
    """The forward-backward function megatron.training runs while the hook is applied: the DCP
    schedule once one is installed, megatron's own until then."""

    schedule: Optional[Callable[..., Any]] = None


SLOT = ScheduleSlot()


def use_schedule(schedule: Optional[Callable[..., Any]]) -> None:
    """Make the hooked ``get_forward_backward_func`` return ``schedule`` (None: megatron's)."""
    SLOT.schedule = schedule


def _provide_override(owner: Any, original: Any) -> Any:
    from typing_extensions import override

    return override


def _dcp_forward_backward_func(owner: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        if SLOT.schedule is not None:
            return SLOT.schedule
        return original(*args, **kwargs)

    return get_forward_backward_func


TRAINING_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "typing_override",
        "training",
        ("typing:override",),
        "megatron/training/models/gpt.py and hybrid.py import typing.override, new in Python "
        "3.12: importing megatron.training fails on 3.11 without it.",
        _provide_override,
        BEFORE_PYTHON_3_12,
    ),
    Patch(
        "dcp_schedule",
        "training",
        ("megatron.training.training:get_forward_backward_func",),
        "megatron.training's train and evaluate loops run whatever get_forward_backward_func() "
        "returns (megatron's schedules); DCP must plan, route and pack each global batch first.",
        _dcp_forward_backward_func,
    ),
)
