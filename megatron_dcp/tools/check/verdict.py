"""The findings of ``megatron-dcp check``: what each layout's run is missing or got wrong, the
one verdict line (PASS or FAIL with the figure) and the JSON of everything."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_dcp.tools.check.reordered import CHECK_ARMS
from megatron_dcp.tools.check.layout_runs import LayoutResult
from megatron_dcp.tools.check.tolerance import CEILING, ERROR_FACTOR, FLOOR_ULPS, Difference

PREFIX = "megatron-dcp check:"
WORST_KEPT = 10  # gradient tensors listed per layout in the JSON, largest margin first


def worst(differences: Sequence[Difference]) -> Optional[Difference]:
    return max(differences, key=lambda d: d.margin, default=None)


def failures(result: LayoutResult) -> List[str]:
    """Why ``result`` fails, one phrase each (none: it passes). In a low-precision stage DCP
    against static CP is shown, not decided (``tools.check.stages``)."""
    where = result.where
    if result.error is not None:
        return [f"{where}: training failed: {result.error.splitlines()[0]}"]
    found = []
    if not result.mixes():
        sizes = " ".join(map(str, result.cp_sizes.get("dcp", [])))
        found.append(f"{where}: DCP planned one CP size per batch ({sizes}): no mix was checked")
    if result.static_sizes() != [result.layout.cp]:
        found.append(f"{where}: static CP planned CP sizes {result.static_sizes()}")
    if len({tuple(tokens) for tokens in result.tokens.values()}) != 1:
        found.append(f"{where}: the arms counted different loss tokens {result.tokens}")
    if not result.loss or not result.gradients:
        found.append(f"{where}: the workers recorded no loss or gradients")
    found += reference_failures(result)
    if result.low_precision:
        return found
    for difference in (worst(result.loss), worst(result.gradients)):
        if difference is not None and not difference.passed:
            found.append(
                f"{where}: {difference.name} differs from static CP by {difference.relative:.2g} "
                f"relative, {difference.margin:.3g}x its tolerance"
            )
    return found


def reference_failures(result: LayoutResult) -> List[str]:
    """Why the comparison with the reference arm fails (module docstring of ``reference_arm``).
    A quantity the tolerance cannot decide fails only in float32: a low-precision stage defers
    it to the float32 stage."""
    where = result.where
    if result.reference_error is not None:
        return [f"{where}: {result.reference_error}"]
    if not result.reference:
        return [f"{where}: the reference arm compared nothing"]
    found = [f"{where}: {mismatch}" for mismatch in result.reference_tokens[:1]]
    undecided = result.undecided()
    if undecided and not result.low_precision:
        d = max(undecided, key=lambda d: d.allowed / d.magnitude)
        found.append(
            f"{where}: cannot decide: {d.name}'s tolerance is {d.allowed / d.magnitude:.2g} of "
            f"its magnitude, over the ceiling {CEILING:g}"
        )
    top = worst(result.decided())
    if top is not None and not top.finite:
        found.append(f"{where}: {top.name} is not a number: {top.difference} from the reference "
                     f"(largest value {top.magnitude})")  # fmt: skip
    elif top is not None and not top.passed:
        found.append(
            f"{where}: {top.name} differs from the reference by {top.difference:.3g} "
            f"({top.relative:.2g} of its largest value {top.magnitude:.3g}), "
            f"{top.margin:.3g}x its tolerance"
        )
    return found


def verdict_line(results: Sequence[LayoutResult], problems: Sequence[str]) -> str:
    if problems:
        return f"{PREFIX} FAIL: " + "; ".join(problems)
    stages: Dict[str, List[LayoutResult]] = {}
    for result in results:
        stages.setdefault(result.stage, []).append(result)
    parts = [stage_summary(mine) for mine in stages.values()]
    speed = results[0].speed or {}
    return (
        f"{PREFIX} PASS: " + "; ".join(parts) + f"; smoke speed, not a benchmark: DCP "
        f"{speed.get('dcp_tokens_per_s', 0):.0f} tokens/s, speedup over static CP "
        f"{speed.get('dcp_speedup', 0):.2f}x"
    )


def stage_summary(results: Sequence[LayoutResult]) -> str:
    """One stage's part of the PASS line: what it decided, and how close it came."""
    first = results[0]
    reference = [d for r in results for d in r.decided()]
    deferred = sum(len(r.undecided()) for r in results)
    sizes = sorted({s for r in results for batch in r.cp_sizes["dcp"] for s in batch})
    layouts = ", ".join(str(r.layout) for r in results)
    label = f"{first.stage}: " if first.stage else ""
    line = (
        f"{label}static CP and DCP equal the reference (float64, no DCP, one sequence at a time) "
        f"on {layouts} (DCP's CP sizes {sizes}): gradients max rel. diff "
        f"{max(d.relative for d in reference):.1e} (at most "
        f"{max(d.margin for d in reference):.2f} of the tolerance)"
    )
    if first.low_precision:
        return line + (
            f" in the {len(reference)} of {len(reference) + deferred} quantities "
            f"{first.stage} resolves, the other {deferred} decided in fp32"
        )
    losses = [d for r in results for d in r.loss]
    grads = [d for r in results for d in r.gradients]
    return line + (
        f"; DCP equals static CP: loss {max(d.relative for d in losses):.1e}, gradients "
        f"{max(d.relative for d in grads):.1e} (at most "
        f"{max(d.margin for d in [*losses, *grads]):.2f})"
    )


def describe(result: LayoutResult) -> List[str]:
    """The lines of one layout's findings."""
    where = result.where
    if result.error is not None:
        return [f"{where}: training failed: {result.error}"]
    sizes = ", ".join(f"{arm} {result.cp_sizes.get(arm)}" for arm in CHECK_ARMS)
    lines = [f"{where}: CP sizes per batch: {sizes}"]
    shown = " (shown, not decided in this precision)" if result.low_precision else ""
    for label, differences in (("loss", result.loss), ("gradients", result.gradients)):
        top = worst(differences)
        if top is not None:
            lines.append(
                f"{where}: {label}{shown}: max rel. diff "
                f"{max(d.relative for d in differences):.2e} over {len(differences)} comparisons; "
                f"worst against its tolerance: {top.name} {top.difference:.3g} (allowed "
                f"{top.allowed:.3g}, {top.margin:.3f} of it)"
            )
    lines += reference_lines(result)
    if result.speed:
        s = result.speed
        shared = " (ranks share cores)" if s["oversubscribed"] else ""
        lines.append(
            f"{where}: smoke speed{shared}, {s['batches']:.0f} batches, not a benchmark: "
            f"step ms static {s['static_step_ms']:.1f}, DCP {s['dcp_step_ms']:.1f} "
            f"({s['dcp_speedup']:.2f}x); DCP {s['dcp_tokens_per_s']:.0f} tokens/s"
        )
    return lines


def reference_lines(result: LayoutResult) -> List[str]:
    """The reference arm's findings: per arm, the worst decided quantity against its tolerance
    (in a low-precision stage, with how many quantities it left to the float32 stage)."""
    where = result.where
    if result.reference_error is not None:
        return [f"{where}: reference arm: {result.reference_error}"]
    lines = []
    for arm in ("static", "dcp"):
        mine = [d for d in result.reference if f" {arm} rank" in d.name]
        decided = [d for d in mine if result.decides(d)]
        top = worst(decided)
        if top is None:
            continue
        deferred = len(mine) - len(decided)
        left = f", {deferred} below {result.stage}'s resolution left to fp32" if deferred else ""
        lines.append(
            f"{where}: {arm} against the reference: max rel. diff "
            f"{max(d.relative for d in decided):.2e} over {len(decided)} comparisons{left}; "
            f"worst against its tolerance: {top.name} {top.difference:.3g} of largest value "
            f"{top.magnitude:.3g} (allowed {top.allowed:.3g}, {top.margin:.3f} of it)"
        )
    return lines


def layout_json(result: LayoutResult) -> Dict[str, Any]:
    ranked = sorted(result.gradients, key=lambda d: d.margin, reverse=True)
    # A low-precision stage ranks what it leaves to float32 after what it decides.
    decided_first = lambda d: (result.decides(d), d.margin)  # noqa: E731
    reference = sorted(result.reference, key=decided_first, reverse=True)
    return {
        "layout": str(result.layout),
        "stage": result.stage or "fp32",
        "low_precision": result.low_precision,
        "error": result.error,
        "cp_sizes": result.cp_sizes,
        "tokens": result.tokens,
        "loss": [difference_json(d) for d in result.loss],
        "gradients": {
            "compared": len(ranked),
            "max_relative": max((d.relative for d in ranked), default=None),
            "worst": [difference_json(d) for d in ranked[:WORST_KEPT]],
        },
        "reference": {
            "error": result.reference_error,
            "compared": len(reference),
            "deferred_to_fp32": len(result.undecided()) if result.low_precision else 0,
            "max_relative": max((d.relative for d in reference), default=None),
            "worst": [difference_json(d) for d in reference[:WORST_KEPT]],
        },
        "speed": result.speed,
        "training_flags": result.training_flags,
        "failures": failures(result),
    }


def difference_json(d: Difference) -> Dict[str, Any]:
    extra = {"allowed": d.allowed, "relative": d.relative, "margin": d.margin, "passed": d.passed,
             "decidable": d.decidable}  # fmt: skip
    return {**asdict(d), **extra}


TOLERANCE_RULE = (
    f"static CP and DCP each within {ERROR_FACTOR:g} x max(measured rounding, {FLOOR_ULPS:g} ulps "
    "of the run's precision at the largest magnitude) of the reference arm's float64 values, per "
    "quantity; measured rounding: the reference at the run's precision in two sample orders; a "
    f"tolerance over {CEILING:g} of the magnitude cannot decide (FAIL). Second line: DCP within "
    "twice that of static CP, rounding measured by static CP with its plan in reverse order. "
    "In bf16/fp16 a quantity over the ceiling is decided by a float32 stage of the same runtime, "
    "and DCP against static CP is decided there (tools/check/tolerance.py, stages.py)"
)


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
