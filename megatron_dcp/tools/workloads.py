"""The four reference workloads of the benchmark, and a one-line summary of a batch of lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_dcp.integration.data import lengths
from megatron_dcp.integration.data.lengths import sample_lengths

DISTRIBUTION_FLAG = "--distribution"
LENGTHS_FLAG = "--lengths"


def parse_distribution(spec: str) -> lengths.Distribution:
    """:func:`lengths.parse_distribution` with errors naming ``--distribution``."""
    try:
        return lengths.parse_distribution(spec)
    except ValueError as error:
        raise lengths.renamed(error, DISTRIBUTION_FLAG) from None


def read_lengths(path: str) -> List[int]:
    """:func:`lengths.read_lengths` with errors naming ``--lengths``."""
    try:
        return lengths.read_lengths(path)
    except ValueError as error:
        raise lengths.renamed(error, LENGTHS_FLAG) from None


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: domain layout, per-rank budget and length distribution."""

    name: str
    description: str
    dp_size: int
    cp_size: int
    budget: int
    distribution: str

    @property
    def domain_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def total_tokens(self) -> int:
        """Tokens per global batch: 8 full micro-batches' worth (8 × N × budget)."""
        return 8 * self.domain_size * self.budget

    def lengths(self, seed: int = 0) -> List[int]:
        dist = parse_distribution(self.distribution)
        return sample_lengths(dist, seed, total_tokens=self.total_tokens)


REFERENCE_WORKLOADS: Tuple[Workload, ...] = (
    Workload(
        "lognormal",
        "log-normal, mean 1024, σ 1.5, 128–8192",
        2,
        4,
        2048,
        "lognormal:mean=1024,sigma=1.5,min=128,max=8192",
    ),
    Workload(
        "rl-rollouts",
        "RL rollouts: log-normal median 4096, σ 0.8, ≤32K",
        16,
        4,
        8192,
        "lognormal:median=4096,sigma=0.8,max=32768",
    ),
    Workload(
        "long-sft",
        "long-context SFT: 99% log-normal median 1024 + 1% 32K–256K",
        4,
        16,
        16384,
        "mixture:0.99*lognormal:median=1024,sigma=1.0|0.01*uniform:min=32768,max=262144",
    ),
    Workload("uniform", "uniform 1–32768", 4, 4, 4096, "uniform:min=1,max=32768"),
)


def reference_workload(name: str) -> Workload:
    """Look up a reference workload by name or 1-based index."""
    for index, workload in enumerate(REFERENCE_WORKLOADS, start=1):
        if name in (workload.name, str(index)):
            return workload
    names = ", ".join(w.name for w in REFERENCE_WORKLOADS)
    raise ValueError(f"--workload={name!r}: unknown workload; choose one of {names} (or 1–4).")


def summarize(lengths: Sequence[int]) -> str:
    """One line: count, total, mean, max."""
    total = sum(lengths)
    mean = total / len(lengths) if lengths else 0.0
    return (
        f"{len(lengths)} sequences, {total} tokens, mean {mean:.0f}, max {max(lengths, default=0)}"
    )
