"""The patch table: every change megatron_dcp makes to objects it does not own, in one place.

Groups, applied by the functions below (each idempotent; each entry restorable):

- ``dcp``: per-micro-batch CP switching in megatron-core (RoPE, MLA, MTP, Mamba, Gated
  DeltaNet, MoE router, TE attention), the MTP loss weighted by global token counts, and the
  per-micro-batch timer of megatron's forward and backward steps;
- ``pipeline``: the shapes of a DCP step's pipeline messages from its plan, and direction tags
  for pipeline p2p on gloo (no CUDA only);
- ``cpu_backend``: megatron-core on a machine without CUDA (devices, streams, RNG, MLA's local
  down projection under TP);
- ``cpu_training``: megatron.training without CUDA (initialisation, helpers, clipping, fusions);
- ``training``: Python 3.11 support for megatron.training and the DCP schedule hook;
- ``upstream``: megatron-core dev's dynamic-CP names on 0.19.x, where they are missing
  (:func:`install_upstream_api`, which ``megatron_dcp.install_upstream_api`` calls).

``python -m megatron_dcp.integration.patches`` prints the table. A test checks that no module
outside this package assigns to an attribute of megatron (or of any other imported module).
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

from megatron_dcp.integration.cpu.fallback_warnings import ignore_missing_te_apex_warnings
from megatron_dcp.integration.megatron_dev_api import INSTALL, dynamic_groups_created
from megatron_dcp.integration.megatron_import import require_megatron_core
from megatron_dcp.integration.patches.cp_switching import (
    DCP_PATCHES,
    SOLO_GROUP,
    TP_CP_GROUP_ATTRIBUTE,
    micro_batch_cp_group,
    moe_router_switching,
    swap_cp_group,
    swap_mamba_context_parallel,
    swap_moe_router_group,
    swap_pg_collection_cp,
    switching,
    te_attention_forward,
)
from megatron_dcp.integration.patches.cpu_backend import (
    CPU_BACKEND_PATCHES,
    CPU_TRAINING_PATCHES,
    cpu_backend_enabled,
)
from megatron_dcp.integration.patches.dev_api import UPSTREAM_PATCHES
from megatron_dcp.integration.patches.gdn_switching import GDN_PATCHES
from megatron_dcp.integration.patches.gloo_pipeline import PIPELINE_PATCHES
from megatron_dcp.integration.patches.megatron_training import TRAINING_PATCHES, use_schedule
from megatron_dcp.integration.patches.mla_attention import MLA_PATCHES
from megatron_dcp.integration.patches.mla_tensor_parallel import MLA_TP_PATCHES
from megatron_dcp.integration.patches.mtp_loss import MTP_PATCHES
from megatron_dcp.integration.patches.pipeline_shapes import SHAPE_PATCHES
from megatron_dcp.integration.patches.step_timing import TIMING_PATCHES, timed, timing_steps
from megatron_dcp.integration.patches.table import (
    Entry,
    apply,
    check_version,
    is_applied,
    megatron_version,
    restore,
)

PATCHES: Tuple[Entry, ...] = (
    *TRAINING_PATCHES,
    *CPU_BACKEND_PATCHES,
    *MLA_TP_PATCHES,
    *CPU_TRAINING_PATCHES,
    *DCP_PATCHES,
    *MLA_PATCHES,
    *GDN_PATCHES,
    *MTP_PATCHES,
    *TIMING_PATCHES,
    *PIPELINE_PATCHES,
    *SHAPE_PATCHES,
    *UPSTREAM_PATCHES,
)
GROUPS = ("training", "cpu_backend", "cpu_training", "dcp", "pipeline", "upstream")


def entries(*groups: str) -> List[Entry]:
    """The table's entries of ``groups`` (all when none is named), in application order."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown patch groups {sorted(unknown)}; the groups are {GROUPS}")
    return [patch for patch in PATCHES if not groups or patch.group in groups]


def apply_groups(groups: Sequence[str]) -> List[str]:
    """Apply the entries of ``groups`` whose condition holds; the names applied by this call."""
    return [patch.name for patch in entries(*groups) if apply(patch)]


def restore_groups(groups: Sequence[str]) -> List[str]:
    """Restore the applied entries of ``groups`` (reverse order); the names restored."""
    return [patch.name for patch in reversed(entries(*groups)) if restore(patch)]


def apply_patches() -> List[str]:
    """The corrections DCP needs inside megatron-core (groups ``dcp`` and ``pipeline``)."""
    return apply_groups(("dcp", "pipeline"))


def enable_cpu_backend() -> bool:
    """megatron-core without CUDA (group ``cpu_backend``); False, and nothing changed, when CUDA
    is present."""
    apply_groups(("cpu_backend",))
    return cpu_backend_enabled()


def disable_cpu_backend() -> None:
    """Undo :func:`enable_cpu_backend` (on the thread that enabled it)."""
    restore_groups(("cpu_backend",))


def enable_cpu_training() -> bool:
    """megatron.core and megatron.training without CUDA, and megatron.training on Python 3.11;
    True when the CPU backend is active."""
    apply_groups(("training", "cpu_backend", "cpu_training"))
    if cpu_backend_enabled():
        ignore_missing_te_apex_warnings()  # in place already when megatron_import imported it
        # Argument validation requires it for tp or cp > 1 (it orders CUDA kernel launches).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return cpu_backend_enabled()


def install_upstream_api() -> List[str]:
    """Make megatron-core dev's dynamic-CP names available (module docstring). Call it once per
    process before ``parallel_state.initialize_model_parallel``; idempotent. Returns the names
    of the patch-table entries this call applied ([] when all were applied already or native).
    May be the process's first megatron import: megatron-core is imported through the package's
    import path first (the CPU stand-in of its triton module where triton is missing).
    """
    require_megatron_core(INSTALL)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized() and not dynamic_groups_created():
        raise RuntimeError(
            f"{INSTALL} was called after parallel_state.initialize_model_parallel: model "
            "parallelism is initialised without dynamic DP×CP groups. Call it first (before any "
            "engine initialises megatron), or call parallel_state.destroy_model_parallel() and "
            "initialise again with dynamic_context_parallel=True."
        )
    return apply_groups(("upstream", "dcp"))


def describe() -> str:
    """The table, one block per entry: name, group, condition, versions, targets, reason."""
    blocks = []
    for patch in PATCHES:
        versions = ", ".join(f"{major}.{minor}" for major, minor in patch.versions)
        blocks.append(
            f"{patch.name} [{patch.group}; when {patch.when.name}; megatron-core {versions}]\n"
            + "".join(f"  replaces {target}\n" for target in patch.targets)
            + f"  corrects: {patch.corrects}"
        )
    return "\n\n".join(blocks)


__all__ = [
    "GROUPS",
    "PATCHES",
    "SOLO_GROUP",
    "TP_CP_GROUP_ATTRIBUTE",
    "apply_groups",
    "apply_patches",
    "check_version",
    "cpu_backend_enabled",
    "describe",
    "disable_cpu_backend",
    "enable_cpu_backend",
    "enable_cpu_training",
    "entries",
    "install_upstream_api",
    "is_applied",
    "megatron_version",
    "micro_batch_cp_group",
    "moe_router_switching",
    "restore_groups",
    "swap_cp_group",
    "swap_mamba_context_parallel",
    "swap_moe_router_group",
    "swap_pg_collection_cp",
    "switching",
    "te_attention_forward",
    "timed",
    "timing_steps",
    "use_schedule",
]
