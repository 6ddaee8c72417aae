"""Defects ``megatron-dcp check``'s tests plant in its workers, to see the check fail through its
numeric comparison: none of them crashes, each changes numbers (tests only).

``MEGATRON_DCP_CHECK_DEFECT=<name>`` plants one of :data:`DEFECTS` before training applies the
patch table; ``MEGATRON_DCP_CHECK_NOOP_PATCH=<entry>`` turns that entry of the table into a no-op.

- ``zigzag_chunks_swapped``: a rank of a CP group of 2 or more holds its two zigzag chunks of
  each sequence in the other order (tokens, labels and positions alike). Only CP sizes above 1
  see it; the static arm's plan and the DCP arm's groups of 2 both carry it.
- ``labels_shifted``: the packer shifts every sequence's labels by one token (the last comes
  first). Every plan shares it, so DCP still equals static CP: only the reference arm sees it.
- ``loss_mask_shifted``: the packer moves every sequence's loss mask one token later (the last
  comes first): as many loss tokens as before, but not the same ones. Every plan shares it, and
  only data that masks tokens (check's prompts, ``--varlen-prompt-fraction``) can show it.
- ``loss_tokens_off_by_one``: each micro-batch's loss counts one token more than it has, so the
  loss is normalised by the wrong token count. Every plan shares it.
- ``attention_entry_scaled``: the ``attention_rope`` entry of the patch table computes its
  attention output 2**-10 too large. One entry's numbers, shared by every plan.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict

import torch

NOOP_VARIABLE = "MEGATRON_DCP_CHECK_NOOP_PATCH"
DEFECT_VARIABLE = "MEGATRON_DCP_CHECK_DEFECT"
SCALE = 1.0 + 2.0**-10


def _wrapping(wrap: Callable[[Callable], Callable]) -> Callable[[Any, Any], Any]:
    return lambda owner, original: functools.wraps(original)(wrap(original))


def _chunks_swapped(original: Callable) -> Callable:
    def indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        held = original(cu_seqlens_padded, cp_size, cp_rank)
        if cp_size == 1:
            return held
        pieces, offset = [], 0
        for length in cu_seqlens_padded.diff().tolist():
            chunk = length // (2 * cp_size)
            first, second = held[offset : offset + chunk], held[offset + chunk : offset + 2 * chunk]
            pieces += [second, first]
            offset += 2 * chunk
        return torch.cat(pieces) if pieces else held

    return indices


def _rolled(field: str) -> Callable[[Callable], Callable]:
    """A packer that rolls ``field`` of every sample by one token (the last comes first)."""

    def wrap(original: Callable) -> Callable:
        def pack(samples: Any, *args: Any, **kwargs: Any) -> Any:
            rolled = [{**sample, field: torch.roll(sample[field], 1)} for sample in samples]
            return original(rolled, *args, **kwargs)

        return pack

    return wrap


def _tokens_off_by_one(original: Callable) -> Callable:
    def loss(loss_mask: torch.Tensor, losses: torch.Tensor) -> Any:
        loss_sum, num_tokens, report = original(loss_mask, losses)
        report = {"lm loss": report["lm loss"] + torch.tensor([0.0, 1.0])}
        return loss_sum, num_tokens + 1, report

    return loss


def _output_scaled(replacement: Callable) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        output, bias = replacement(*args, **kwargs)
        return output * SCALE, bias

    return forward


def _module_defect(name: str, targets: tuple, wrap: Callable[[Callable], Callable]) -> Any:
    from megatron_dcp.integration.patches.table import Patch

    return Patch(name, "check_defects", targets, "a planted defect", _wrapping(wrap))


def _entry_defect(entry_name: str, wrap: Callable[[Callable], Callable]) -> Any:
    """The patch-table entry ``entry_name`` with its replacement wrapped by ``wrap``."""
    entry = _entry(entry_name)
    return dataclasses.replace(entry, replace=lambda owner, original: wrap(
        entry.replace(owner, original)))  # fmt: skip


# The packer, where it is defined and where the DCP wrapper imported it.
PACKERS = (
    "megatron_dcp.runtime.packing:pack_samples",
    "megatron_dcp.integration.forward_backward:pack_samples",
)
DEFECTS: Dict[str, Callable[[], Any]] = {
    "zigzag_chunks_swapped": lambda: _module_defect(
        "zigzag_chunks_swapped",
        ("megatron_dcp.runtime.packing:local_token_indices",),
        _chunks_swapped,
    ),
    "labels_shifted": lambda: _module_defect("labels_shifted", PACKERS, _rolled("labels")),
    "loss_mask_shifted": lambda: _module_defect(
        "loss_mask_shifted", PACKERS, _rolled("loss_mask")
    ),
    "loss_tokens_off_by_one": lambda: _module_defect(
        "loss_tokens_off_by_one",
        ("megatron_dcp.integration.training.forward_step:per_token_loss",),
        _tokens_off_by_one,
    ),
    "attention_entry_scaled": lambda: _entry_defect("attention_rope", _output_scaled),
}


def _entry(name: str) -> Any:
    from megatron_dcp.integration.patches import entries
    from megatron_dcp.integration.patches.table import Patch

    found = [entry for entry in entries() if entry.name == name]
    if not found or not isinstance(found[0], Patch):
        names = ", ".join(e.name for e in entries() if isinstance(e, Patch))
        raise ValueError(
            f"{NOOP_VARIABLE}={name}: not an attribute entry of the patch table; use one of "
            f"{names}."
        )
    return found[0]


def neutralize(name: str) -> None:
    """Apply the patch-table entry ``name`` as a no-op (it counts as applied, its targets keep
    megatron's originals)."""
    from megatron_dcp.integration.patches.table import apply

    apply(dataclasses.replace(_entry(name), replace=lambda owner, original: original))


def plant(name: str) -> None:
    """Apply the defect ``name`` of :data:`DEFECTS`."""
    from megatron_dcp.integration.patches.table import apply

    if name not in DEFECTS:
        raise ValueError(f"{DEFECT_VARIABLE}={name}: not a planted defect; use one of "
                         f"{', '.join(DEFECTS)}.")  # fmt: skip
    apply(DEFECTS[name]())


def plant_from_environment() -> None:
    """The defect and the no-op entry the test asked for, if any."""
    if os.environ.get(NOOP_VARIABLE):
        neutralize(os.environ[NOOP_VARIABLE])
    if os.environ.get(DEFECT_VARIABLE):
        plant(os.environ[DEFECT_VARIABLE])
