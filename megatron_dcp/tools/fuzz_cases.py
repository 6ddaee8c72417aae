"""The fuzzer's inputs: :class:`FuzzCase` (domain settings and lengths, one scheduler input) and
the seeded draws of :func:`draw_case`, which favour the edge cases (odd and non-power-of-two
domains, tiny, near-maximal and too-long lengths)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from megatron_dcp.scheduling.cost import CostModel, build_cost_model
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.tools.plan_check import is_pow2

# Largest domain size N, number of lengths and budget a case draws.
MAX_DOMAIN = 64
MAX_SEQUENCES = 300
MAX_BUDGET = 4096
# A sequence's fixed cost in tokens of linear work a case draws: none, a GPU-like few, and the
# CPU backend's (0.49 ms per attention pass against ~0.02 ms per token: ~100 tokens).
SEQUENCE_TOKENS = (0.0, 0.0, 4.0, 100.0)


@dataclass(frozen=True)
class FuzzCase:
    """One scheduler input: the domain settings and the lengths."""

    dp_size: int
    cp_size: int
    budget: int
    min_cp_size: int
    vpp: Optional[int]
    seqlens: Tuple[int, ...]
    # Each sequence's fixed cost in tokens of linear work (``CostModel.sequence``; 0: the
    # reference model's, which has none).
    sequence_tokens: float = 0.0

    @property
    def size(self) -> int:
        """N = dp·cp."""
        return self.dp_size * self.cp_size

    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of ``build_scheduler`` for this domain."""
        return dict(
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_seqlen_per_dp_cp_rank=self.budget,
            min_cp_size=self.min_cp_size,
            microbatch_group_size_per_vp_stage=self.vpp,
        )

    def cost_model(self) -> CostModel:
        """The cost model the case plans with: the reference model with its sequence cost."""
        cost = build_cost_model()
        return replace(cost, sequence=self.sequence_tokens * cost.linear)

    def domain(self) -> Domain:
        """The domain (raises ValueError on bad settings)."""
        return Domain(self.dp_size, self.cp_size, self.budget, self.min_cp_size)

    def reproducer(self, name: str) -> str:
        """A line of Python that schedules this case with ``name`` (lengths cut when long)."""
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs().items())
        if self.sequence_tokens:
            sequence = self.cost_model().sequence
            args += f", cost_model=replace(build_cost_model(), sequence={sequence!r})"
        lengths = list(self.seqlens)
        text = f"build_scheduler({name!r}, {args}).schedule({lengths})"
        if len(text) > 600:
            shown = f"{lengths[:40]} + ...{len(lengths)} total"
            text = f"build_scheduler({name!r}, {args}).schedule({shown})"
        return text


def draw_domain(rng: random.Random) -> Tuple[int, int, int, int, Optional[int]]:
    """(dp, cp, budget, min_cp, vpp): N in 1..64 (odd and non-powers of two often)."""
    n = rng.choice((rng.randint(1, MAX_DOMAIN), rng.randint(1, 12), 1 << rng.randint(0, 6)))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    pow2_divisors = [d for d in divisors if is_pow2(d)]
    cp = rng.choice(pow2_divisors) if rng.random() < 0.6 else rng.choice(divisors)
    pow2s = [1 << k for k in range(n.bit_length()) if 1 << k <= n]
    min_cp = 1 if rng.random() < 0.5 else rng.choice(pow2s)
    vpp = None if rng.random() < 0.5 else rng.randint(1, 4)
    budget = rng.choice((rng.randint(1, 16), rng.randint(1, MAX_BUDGET), 1 << rng.randint(0, 12)))
    return n // cp, cp, budget, min_cp, vpp


def draw_lengths(rng: random.Random, n: int, budget: int) -> Tuple[int, ...]:
    """0–300 lengths, mostly short lists; a per-case mixture of tiny, typical and near-max."""
    count = rng.choice((rng.randint(0, 8), rng.randint(0, 40), rng.randint(0, MAX_SEQUENCES)))
    cap = n * budget
    weights = [rng.random() for _ in range(4)]
    kinds = rng.choices(("tiny", "typical", "large", "max"), weights=weights, k=count)
    lengths = []
    for kind in kinds:
        if kind == "tiny":
            lengths.append(rng.randint(0, 3))
        elif kind == "typical":
            lengths.append(rng.randint(1, budget))
        elif kind == "large":
            lengths.append(rng.randint(1, cap))
        else:
            lengths.append(max(0, cap - rng.randint(0, 2)))
    if count and rng.random() < 0.05:
        lengths[rng.randrange(count)] = cap + rng.randint(1, budget)  # must be rejected
    return tuple(min(length, cap + budget) for length in lengths)


def draw_case(seed: int, index: int) -> FuzzCase:
    """Case ``index`` of the run with ``seed`` (independent of the other cases)."""
    rng = random.Random(seed * 1_000_003 + index)
    dp, cp, budget, min_cp, vpp = draw_domain(rng)
    lengths = draw_lengths(rng, dp * cp, budget)
    # Its own stream: the domain and lengths of a seed's cases stay what they were before it.
    sequence = random.Random(f"{seed}:{index}:sequence").choice(SEQUENCE_TOKENS)
    return FuzzCase(dp, cp, budget, min_cp, vpp, lengths, sequence)
