"""How far a DCP run's loss and gradients may stray from static CP's: the project's oracle rule
(tests/README.md, "Oracle tolerances"), shared by ``testing.oracle`` and ``megatron-dcp check``.

A correct run differs from the exact values only by the rounding of sums taken in another order.
The rule measures that rounding instead of tuning a number: ``error`` is what reordering the
same sums did to a reference (the oracle tests: the float32 single-process run against its
float64 twin; ``check``: static CP against static CP on the same samples in another order), and
a run passes within :data:`ERROR_FACTOR` times that, floored at :data:`FLOOR_ULPS` float32 ulps of
the quantity's largest magnitude (for a quantity whose measured rounding happened to vanish).
Two runs each within that of the exact values are within twice it of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

ERROR_FACTOR = 8.0
FLOOR_ULPS = 4.0
FLOAT32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps


def tolerance(error: float, magnitude: float) -> float:
    """The allowed distance from the exact value of a quantity whose reference was ``error``
    away from it, its largest magnitude ``magnitude``."""
    return ERROR_FACTOR * max(error, FLOOR_ULPS * FLOAT32_EPS * magnitude)


@dataclass(frozen=True)
class Difference:
    """One quantity (the loss, or one gradient tensor on one rank) of one global batch: its
    largest magnitude under static CP, the distance of static CP reordered from static CP (the
    measured rounding) and of DCP from static CP."""

    name: str
    magnitude: float
    noise: float
    difference: float

    @property
    def allowed(self) -> float:
        """Twice :func:`tolerance`: DCP and static CP are each within it of the exact values."""
        return 2.0 * tolerance(self.noise, self.magnitude)

    @property
    def relative(self) -> float:
        """The difference over the largest magnitude (0 for a quantity that is 0 throughout)."""
        return self.difference / self.magnitude if self.magnitude else self.difference

    @property
    def margin(self) -> float:
        """The difference as a fraction of what is allowed (≤ 1 passes)."""
        if not self.allowed:
            return float("inf") if self.difference else 0.0
        return self.difference / self.allowed

    @property
    def passed(self) -> bool:
        return self.difference <= self.allowed
