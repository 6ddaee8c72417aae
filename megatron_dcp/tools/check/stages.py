"""The precision stages of ``megatron-dcp check``.

A run in float32 is one stage. A run in bf16 or fp16 (on a GPU the check runs bf16 by default,
as megatron trains there) is two:

1. **the run's precision**: the three arms in bf16 (fp16) mixed precision, against the float64
   reference whose tolerance is measured in the same precision. It decides every quantity whose
   measured rounding leaves the tolerance under the ceiling (``tools.check.tolerance``): in a
   tiny GPT about two thirds of them, the loss and the large weight matrices among them.
   Quantities with more rounding than that (norm biases summed over many tokens, say) are
   *deferred*, not passed. DCP against static CP is shown, not decided: static CP in reverse
   order rounds its micro-batches' activations exactly as static CP does, so it cannot measure
   what another packing's bf16 rounding does.
2. **float32**: the same arms, the same samples, the same DCP runtime on the same devices, in
   float32 with an attention that runs in float32 (on a GPU ``--transformer-impl local``: the
   reference THD/CP attention, since Transformer Engine's fused attention has no float32). It
   decides what bf16 cannot resolve, every quantity of it must be decidable, and DCP against
   static CP is decided again.

It runs only when the first stage found nothing: a defect seen in bf16 already fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

LOW_PRECISIONS = ("--bf16", "--fp16")
IMPLEMENTATION = "--transformer-impl"


@dataclass(frozen=True)
class Stage:
    """One stage: its precision (``fp32``, ``bf16`` or ``fp16``), the training flags it runs with
    and its label in the report ("" when it is the only stage)."""

    precision: str
    flags: Tuple[str, ...]
    label: str = ""

    @property
    def low_precision(self) -> bool:
        return self.precision != "fp32"


def precision_of(flags: Sequence[str]) -> str:
    """The run's precision, as the reference arm names it."""
    return "bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32"


def stages_for(flags: Sequence[str], on_gpu: bool) -> List[Stage]:
    """The stages a check of ``flags`` runs (module docstring)."""
    precision = precision_of(flags)
    if precision == "fp32":
        return [Stage("fp32", tuple(flags))]
    fp32 = Stage("fp32", fp32_flags(flags, on_gpu), "fp32")
    return [Stage(precision, tuple(flags), precision), fp32]


def fp32_flags(flags: Sequence[str], on_gpu: bool) -> Tuple[str, ...]:
    """``flags`` without the low precision; on a GPU with the local implementation (the
    reference attention, which computes in float32), replacing the user's ``--transformer-impl``."""
    kept: List[str] = []
    skip_value = False
    for flag in flags:
        if skip_value:
            skip_value = False
        elif flag == IMPLEMENTATION and on_gpu:
            skip_value = True
        elif flag not in LOW_PRECISIONS and not (on_gpu and flag.startswith(IMPLEMENTATION + "=")):
            kept.append(flag)
    return tuple([*kept, IMPLEMENTATION, "local"] if on_gpu else kept)
