"""What ``megatron-dcp estimate`` answers: each arm's predicted step time (its plan's critical
path plus the step rest, added as ``link-sweep`` adds it: ``link_sweep.runs.predicted_speedups``),
DCP's CP sizes, the peak tokens per rank, and one verdict line; as a table or as JSON."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_dcp.tools.compare import DomainSpec, format_histogram, render_table
from megatron_dcp.tools.estimate.arm_plans import ARM_SCHEDULERS, ArmPlans, plans_by_batch
from megatron_dcp.tools.estimate.step_rest import StepRest
from megatron_dcp.tools.link_sweep.runs import predicted_speedups
from megatron_dcp.tools.workloads import summarize

# Below this predicted speedup over static CP, the verdict is that DCP will not help.
MIN_GAIN = 1.05
# Sequences that need static CP's whole group hold at least this share of the tokens: the
# verdict names them as the reason DCP cannot help.
LONG_SHARE = 0.5


@dataclass
class Estimate:
    """The data's batches, the domain, the cost model and every arm's plans of them."""

    source: str
    batches: List[List[int]]
    spec: DomainSpec
    cost_model: str
    rest: StepRest
    arms: Dict[str, ArmPlans]
    min_gain: float = MIN_GAIN
    notes: List[str] = field(default_factory=list)
    # Vision-language data: each batch's encoder patches per sample (empty: text), and the cost
    # model's seconds per patch.
    patches: List[List[int]] = field(default_factory=list)
    vision: float = 0.0

    @property
    def lengths(self) -> List[int]:
        return [length for batch in self.batches for length in batch]

    @property
    def has_images(self) -> bool:
        return any(count for batch in self.patches for count in batch)

    def encoder_share(self, arm: str) -> Optional[float]:
        """The vision encoder's share of the arm's predicted step: Σ over the planned batches of
        its seconds on the critical path over Σ of the step times."""
        pairs = [
            (encoder, time)
            for encoder, time in zip(self.arms[arm].encoder_s, self.step_times(arm))
            if encoder is not None and time is not None
        ]
        total = sum(time for _, time in pairs)
        return sum(encoder for encoder, _ in pairs) / total if total else None

    def step_times(self, arm: str) -> List[Optional[float]]:
        """Per batch: the arm's critical path plus the step rest (None: no plan)."""
        return [
            None if report is None else report.critical_path + self.rest.seconds
            for report in self.arms[arm].reports
        ]

    def speedups(self) -> Dict[str, float]:
        """Σ static / Σ arm of (critical path + step rest) over the batches both planned, and DCP
        over dev over the batches all three planned."""
        plans = plans_by_batch(self.arms)
        result = {}
        pair = predicted_speedups(plans, ["static", "dcp"], 0, self.rest.seconds)
        if "dcp" in pair:
            result["dcp_over_static"] = pair["dcp"]
        trio = predicted_speedups(plans, list(ARM_SCHEDULERS), 0, self.rest.seconds)
        if "megatron_dev" in trio:
            result["megatron_dev_over_static"] = trio["megatron_dev"]
            result["dcp_over_megatron_dev"] = trio["dcp"] / trio["megatron_dev"]
        return result


@dataclass(frozen=True)
class Verdict:
    helps: bool
    line: str


def verdict(estimate: Estimate) -> Verdict:
    """DCP's predicted speedup over static CP against ``min_gain``, with the reason when it
    will not help."""
    speedups = estimate.speedups()
    gain = speedups.get("dcp_over_static")
    cp = estimate.spec.cp_size
    if gain is None:
        return static_cannot_run(estimate)
    if gain >= estimate.min_gain:
        dev = speedups.get("dcp_over_megatron_dev")
        than_dev = f"{dev:.2f}× than dev's planner" if dev else "dev's planner could not plan it"
        line = f"DCP is predicted {gain:.2f}× faster than static CP {cp} ({than_dev}) on this data"
        return Verdict(True, line)
    return Verdict(False, f"DCP will not help here: {why_not(estimate, gain)}")


def static_cannot_run(estimate: Estimate) -> Verdict:
    """The verdict when static CP planned no batch (a sequence over its CP size's tokens)."""
    cp, notes = estimate.spec.cp_size, estimate.arms["static"].notes
    reason = notes[0] if notes else "no plan"
    if estimate.arms["dcp"].complete:
        return Verdict(True, f"DCP runs this data and static CP {cp} cannot ({reason})")
    return Verdict(False, f"DCP will not help here: no arm plans every batch ({reason})")


def why_not(estimate: Estimate, gain: float) -> str:
    """Why DCP's plans are (nearly) static CP's: each sequence already whole on one rank, most
    tokens in sequences that need the whole static group anyway, or a gain under the bar."""
    lengths, spec = estimate.lengths, estimate.spec
    predicted = (
        f"predicted {gain:.2f}× over static CP {spec.cp_size}, under the "
        f"--min-gain {estimate.min_gain:.2f}×"
    )
    if spec.cp_size == 1 and max(lengths) <= spec.budget:
        return (
            f"every sequence fits one rank's budget ({spec.budget} tokens) and static CP is 1, "
            f"so static CP already runs each sequence whole on one rank ({predicted})"
        )
    need = spec.cp_size // 2 * spec.budget
    share = sum(length for length in lengths if length > need) / sum(lengths)
    if spec.cp_size > 1 and share >= LONG_SHARE:
        return (
            f"{share:.0%} of the tokens are in sequences longer than {need} tokens, which need "
            f"CP {spec.cp_size} anyway ({predicted})"
        )
    step = statistics.mean(t for t in estimate.step_times("static") if t is not None)
    return (
        f"{predicted}; the step rest, {estimate.rest.seconds * 1e3:.1f} ms of static CP's "
        f"{step * 1e3:.1f} ms step, is the same for every plan"
    )


# ----------------------------------------------------------------------------------------------
# Output


def arm_row(estimate: Estimate, arm: str) -> List[str]:
    plans = estimate.arms[arm]
    title = plans.title(estimate.spec.cp_size)
    encoder = [encoder_cell(estimate.encoder_share(arm))] if estimate.has_images else []
    if not plans.planned:
        return [title, "n/a", "n/a", "", "", "", *encoder]
    times = [t for t in estimate.step_times(arm) if t is not None]
    paths = [report.critical_path for report in plans.planned]
    microbatches = statistics.mean(report.num_microbatches for report in plans.planned)
    return [
        title + ("" if plans.complete else f" ({len(plans.planned)} batches)"),
        f"{statistics.mean(times) * 1e3:.1f}",
        f"{statistics.mean(paths) * 1e3:.1f}",
        f"{microbatches:.1f}",
        f"{plans.peak_tokens_per_rank():.0f}",
        format_histogram(plans.cp_size_histogram()),
        *encoder,
    ]


def encoder_cell(share: Optional[float]) -> str:
    return "n/a" if share is None else f"{share:.1%}"


HEADER = (
    "arm", "step ms", "critical path ms", "micro-batches", "peak tok/rank", "CP sizes (size:seqs)"
)  # fmt: skip
ENCODER_COLUMN = "encoder % of step"


def table(estimate: Estimate) -> str:
    """One row per arm; with the encoder's share of the step where the data has images."""
    rows = [arm_row(estimate, arm) for arm in estimate.arms]
    if estimate.has_images:
        return render_table((*HEADER, ENCODER_COLUMN), rows, "lrrrrlr")
    return render_table(HEADER, rows, "lrrrrl")


def format_estimate(estimate: Estimate) -> str:
    """The header lines, one row per arm (means over the batches), the n/a notes, the verdict."""
    batches = estimate.batches
    lines = [
        f"estimate: {len(batches)} global batches of {len(batches[0])} sequences from "
        f"{estimate.source}",
        f"   {summarize(estimate.lengths)}",
        f"   {estimate.spec.describe()} | cost model {estimate.cost_model} | "
        f"{estimate.rest.describe()}",
        *[f"   note: {note}" for note in estimate.notes],
        table(estimate),
    ]
    for arm, plans in estimate.arms.items():
        for note in plans.notes:
            lines.append(f"n/a  {plans.title(estimate.spec.cp_size)}: {note}")
    lines.append(verdict(estimate).line)
    return "\n".join(lines)


def arm_dict(estimate: Estimate, arm: str) -> Dict[str, Any]:
    plans, times = estimate.arms[arm], estimate.step_times(arm)
    known = [t for t in times if t is not None]
    per_batch = [
        None if report is None else {**report.as_dict(), "step_time_s": time, **encoder}
        for report, time, encoder in zip(plans.reports, times, encoder_fields(plans, estimate))
    ]
    vision = {"encoder_share": estimate.encoder_share(arm)} if estimate.has_images else {}
    return {
        "title": plans.title(estimate.spec.cp_size),
        "scheduler": ARM_SCHEDULERS[arm],
        "step_time_s": statistics.mean(known) if known else None,
        **vision,
        "batches_planned": len(known),
        "peak_tokens_per_rank": plans.peak_tokens_per_rank(),
        "cp_size_histogram": {str(k): v for k, v in plans.cp_size_histogram().items()},
        "notes": plans.notes,
        "per_batch": per_batch,
    }


def encoder_fields(plans: ArmPlans, estimate: Estimate) -> List[Dict[str, Any]]:
    """Per batch, the encoder's seconds on the arm's critical path (vision-language data)."""
    if not estimate.has_images:
        return [{} for _ in plans.reports]
    return [{"encoder_s": seconds} for seconds in plans.encoder_s]


def vlm_dict(estimate: Estimate) -> Dict[str, Any]:
    """Vision-language data: each batch's patches, how many samples had images, the term."""
    if not estimate.patches:
        return {}
    counts = [count for batch in estimate.patches for count in batch]
    return {
        "vlm": {
            "samples_with_images": sum(1 for count in counts if count),
            "samples": len(counts),
            "patches": estimate.patches,
            "vision_s_per_patch": estimate.vision,
        }
    }


def as_dict(estimate: Estimate) -> Dict[str, Any]:
    """Everything the table shows, per batch, with the lengths and the verdict."""
    judged = verdict(estimate)
    return {
        **vlm_dict(estimate),
        "source": estimate.source,
        "notes": estimate.notes,
        "global_batches": len(estimate.batches),
        "global_batch_size": len(estimate.batches[0]),
        "lengths": estimate.batches,
        "layout": estimate.spec.__dict__,
        "cost_model": estimate.cost_model,
        "step_rest": estimate.rest.as_dict(),
        "arms": {arm: arm_dict(estimate, arm) for arm in estimate.arms},
        "speedups": estimate.speedups(),
        "verdict": {"helps": judged.helps, "line": judged.line, "min_gain": estimate.min_gain},
    }


def batches_of(lengths: Sequence[int], size: int) -> List[List[int]]:
    """Global batch ``b`` holds samples ``b·size .. (b+1)·size − 1`` (bench-train's batches)."""
    return [list(lengths[i : i + size]) for i in range(0, len(lengths) - size + 1, size)]
