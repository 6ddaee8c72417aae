"""megatron's import-time warnings that Transformer Engine and Apex are missing, filtered on the
CPU backend.

Imported without them, megatron-core 0.19.2 warns nine times in every rank (the optimizers and
multi-tensor helpers fall back to torch, the norm to torch's, MoE experts to local linears).
Without CUDA they are always missing and the CPU backend runs on those fallbacks by design, so
the warnings say nothing new: on a machine without CUDA they are ignored, matched by their exact
messages and only from megatron's modules, and the CPU backend's start-up line says it once,
on rank 0 (``parallel.cpu_notice``). With CUDA nothing is filtered. Every other warning is
shown as before.

The filter must be in place before megatron is first imported: ``megatron_import`` installs it
there, and ``patches.enable_cpu_training`` once more for a process that imported megatron
another way (warnings megatron gives later are filtered then).
"""

from __future__ import annotations

import warnings

# Regular expressions matched at the start of each warning's message (warnings.filterwarnings).
MISSING_TE_APEX_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Only transformer-engine>=[0-9.]+ supports MoE experts, but your version is 0\.0\.0\. ",
)


def ignore_missing_te_apex_warnings() -> bool:
    """Without CUDA, ignore megatron's warnings that Transformer Engine or Apex is missing
    (idempotent: the same filter is not added twice); True when the filter is in place."""
    import torch

    if torch.cuda.is_available():
        return False
    for message in MISSING_TE_APEX_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module="megatron")
    return True
