"""How far a run's loss and gradients may stray from the exact values: the project's oracle rule
(tests/README.md, "Oracle tolerances"), shared by ``testing.oracle`` and ``megatron-dcp check``.

A correct run differs from the exact values only by the rounding of sums taken in another order.
The rule measures that rounding instead of tuning a number: ``error`` is what reordering the
same sums did to a reference (the oracle tests: the float32 single-process run against its
float64 twin; ``check``'s reference arm: the same, at the run's precision; ``check``'s second
line of evidence: static CP against static CP on the same samples in another order), and a run
passes within :data:`ERROR_FACTOR` times that, floored at :data:`FLOOR_ULPS` ulps of the run's
precision at the quantity's largest magnitude (for a quantity whose measured rounding happened to
vanish). Two runs each within that of the exact values are within twice it of each other.

A tolerance above :data:`CEILING` of the quantity's largest magnitude cannot tell a defect from
rounding. The floor exists for quantities whose measured rounding vanished, so it must never be
the reason a quantity cannot be decided: it is :data:`FLOOR_ULPS` ulps, but at most
:data:`FLOOR_CAP` of the magnitude, so that twice the tolerance of a floored quantity is half the
ceiling at any precision. In float32 the cap never binds (4 ulps is 5e-7); in bf16 (ulp 2**-7)
and fp16 (2**-10) it does, and there a quantity is undecidable only when its *measured* rounding
is over the ceiling. ``check`` in bf16 hands such quantities to its float32 stage
(``tools.check.stages``); a float32 quantity that cannot be decided fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ERROR_FACTOR = 8.0
FLOOR_ULPS = 4.0
FLOAT32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps
CEILING = 0.05  # the largest tolerance, relative to the quantity's largest magnitude, that decides
# The floor's largest share of the magnitude: two runs' floored tolerance is CEILING / 2.
FLOOR_CAP = CEILING / (4 * ERROR_FACTOR)


def floor(magnitude: float, eps: float = FLOAT32_EPS) -> float:
    """The smallest rounding a quantity of largest magnitude ``magnitude`` is granted at a
    precision whose ulp is ``eps``: FLOOR_ULPS ulps, capped at FLOOR_CAP of the magnitude."""
    return min(FLOOR_ULPS * eps, FLOOR_CAP) * magnitude


def tolerance(error: float, magnitude: float, eps: float = FLOAT32_EPS) -> float:
    """The allowed distance from the exact value of a quantity whose reference was ``error``
    away from it, its largest magnitude ``magnitude``, at a precision whose ulp is ``eps``."""
    return ERROR_FACTOR * max(error, floor(magnitude, eps))


@dataclass(frozen=True)
class Difference:
    """One quantity (the loss, or one gradient tensor on one rank) of one global batch: its
    largest magnitude, the measured rounding (``noise``) and the distance found (``difference``).
    ``runs``: 2 for the distance between two runs (DCP against static CP), 1 for a run against
    the exact values (the reference arm); ``eps``: the ulp of the run's precision."""

    name: str
    magnitude: float
    noise: float
    difference: float
    runs: int = 2
    eps: float = FLOAT32_EPS

    @property
    def allowed(self) -> float:
        """``runs`` times :func:`tolerance`: each run is within it of the exact values."""
        return self.runs * tolerance(self.noise, self.magnitude, self.eps)

    @property
    def finite(self) -> bool:
        """Every figure is a number: a NaN or an infinity (an overflowed fp16 gradient, say) is
        never within a tolerance, and never left undecided."""
        return math.isfinite(self.magnitude + self.noise + self.difference)

    @property
    def relative(self) -> float:
        """The difference over the largest magnitude (0 for a quantity that is 0 throughout)."""
        return self.difference / self.magnitude if self.magnitude else self.difference

    @property
    def margin(self) -> float:
        """The difference as a fraction of what is allowed (≤ 1 passes)."""
        if not self.finite:
            return float("inf")
        if not self.allowed:
            return float("inf") if self.difference else 0.0
        return self.difference / self.allowed

    @property
    def passed(self) -> bool:
        return self.finite and self.difference <= self.allowed

    @property
    def decidable(self) -> bool:
        """The tolerance is at most :data:`CEILING` of the largest magnitude (a figure that is
        not finite is decided: it fails)."""
        if not self.finite:
            return True
        return self.allowed <= CEILING * self.magnitude or not self.magnitude
