"""Import ``megatron.core`` on machines without triton (CPU-only).

megatron-core 0.19.2 imports ``megatron.core.transformer.moe.ops.paged_stash`` from
``megatron.core.__init__`` (via the pipeline schedules), and that module does an unconditional
``import triton`` to define two MoE paged-stash kernels. Without triton, ``import megatron.core``
fails even though nothing outside MoE paged stashing needs the kernels. When triton is missing we
register a stand-in for exactly that one module; triton itself is never faked (a global fake breaks
``torch._inductor``).

Every entry point that may be a process's first megatron import goes through here: the training
entry points, the test fixtures, and the RL entry points (:func:`require_megatron_core`, called by
``megatron_dcp.install_upstream_api()`` before it touches megatron, and so by
``megatron_dcp.verl_plugin``). Before that first import, on a machine without CUDA, megatron's
warnings that Transformer Engine and Apex are missing are filtered (``cpu.fallback_warnings``).
"""

from __future__ import annotations

import importlib
import sys
import types

from megatron_dcp.integration.cpu.fallback_warnings import ignore_missing_te_apex_warnings

PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"


def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _paged_stash_stand_in() -> types.ModuleType:
    """The constants of the real module; the kernels are ``None`` (MoE paged stash unusable)."""
    module = types.ModuleType(PAGED_STASH_MODULE, "Stand-in for the triton paged-stash kernels.")
    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = None
    module.paged_stash_pop_kernel = None
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    return module


def import_megatron_core() -> bool:
    """Import ``megatron.core`` (idempotent); True when it is available, False when not installed
    or not importable. Registers the paged-stash stand-in only when triton cannot be imported;
    without CUDA, ignores megatron's warnings that Transformer Engine and Apex are missing."""
    if "megatron.core" not in sys.modules:
        ignore_missing_te_apex_warnings()
        if not _triton_importable():
            sys.modules.setdefault(PAGED_STASH_MODULE, _paged_stash_stand_in())
    try:
        importlib.import_module("megatron.core")
    except ImportError:
        return False
    return True


def require_megatron_core(caller: str) -> None:
    """:func:`import_megatron_core`, or an ``ImportError`` saying that ``caller`` needs it."""
    if not import_megatron_core():
        raise ImportError(
            f"{caller} needs megatron-core 0.19.x, which cannot be imported here; install it as "
            "README.md's set-up does (scripts/setup_env.sh)."
        )
