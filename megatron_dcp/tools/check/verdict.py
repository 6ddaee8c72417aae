"""The findings of ``megatron-dcp check``: what each layout's run is missing or got wrong, the
one verdict line (PASS or FAIL with the figure) and the JSON of everything."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_dcp.tools.check.reordered import CHECK_ARMS
from megatron_dcp.tools.check.layout_runs import LayoutResult
from megatron_dcp.tools.check.tolerance import ERROR_FACTOR, FLOOR_ULPS, Difference

PREFIX = "megatron-dcp check:"
WORST_KEPT = 10  # gradient tensors listed per layout in the JSON, largest margin first


def worst(differences: Sequence[Difference]) -> Optional[Difference]:
    return max(differences, key=lambda d: d.margin, default=None)


def failures(result: LayoutResult) -> List[str]:
    """Why ``result`` fails, one phrase each (none: it passes)."""
    where = str(result.layout)
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
    for difference in (worst(result.loss), worst(result.gradients)):
        if difference is not None and not difference.passed:
            found.append(
                f"{where}: {difference.name} differs from static CP by {difference.relative:.2g} "
                f"relative, {difference.margin:.3g}x its tolerance"
            )
    return found


def verdict_line(results: Sequence[LayoutResult], problems: Sequence[str]) -> str:
    if problems:
        return f"{PREFIX} FAIL: " + "; ".join(problems)
    losses = [d for r in results for d in r.loss]
    grads = [d for r in results for d in r.gradients]
    margin = max(d.margin for d in [*losses, *grads])
    sizes = sorted({s for r in results for batch in r.cp_sizes["dcp"] for s in batch})
    speed = results[0].speed or {}
    return (
        f"{PREFIX} PASS: DCP equals static CP on {', '.join(str(r.layout) for r in results)} "
        f"(DCP's CP sizes {sizes}): loss max rel. diff {max(d.relative for d in losses):.1e}, "
        f"gradients {max(d.relative for d in grads):.1e} (at most {margin:.2f} of the "
        f"tolerance); smoke speed, not a benchmark: DCP {speed.get('dcp_tokens_per_s', 0):.0f} "
        f"tokens/s, speedup over static CP {speed.get('dcp_speedup', 0):.2f}x"
    )


def describe(result: LayoutResult) -> List[str]:
    """The lines of one layout's findings."""
    if result.error is not None:
        return [f"{result.layout}: training failed: {result.error}"]
    sizes = ", ".join(f"{arm} {result.cp_sizes.get(arm)}" for arm in CHECK_ARMS)
    lines = [f"{result.layout}: CP sizes per batch: {sizes}"]
    for label, differences in (("loss", result.loss), ("gradients", result.gradients)):
        top = worst(differences)
        if top is not None:
            lines.append(
                f"{result.layout}: {label}: max rel. diff "
                f"{max(d.relative for d in differences):.2e} over {len(differences)} comparisons; "
                f"worst against its tolerance: {top.name} {top.difference:.3g} (allowed "
                f"{top.allowed:.3g}, {top.margin:.3f} of it)"
            )
    if result.speed:
        s = result.speed
        shared = " (ranks share cores)" if s["oversubscribed"] else ""
        lines.append(
            f"{result.layout}: smoke speed{shared}, {s['batches']:.0f} batches, not a benchmark: "
            f"step ms static {s['static_step_ms']:.1f}, DCP {s['dcp_step_ms']:.1f} "
            f"({s['dcp_speedup']:.2f}x); DCP {s['dcp_tokens_per_s']:.0f} tokens/s"
        )
    return lines


def layout_json(result: LayoutResult) -> Dict[str, Any]:
    ranked = sorted(result.gradients, key=lambda d: d.margin, reverse=True)
    return {
        "layout": str(result.layout),
        "error": result.error,
        "cp_sizes": result.cp_sizes,
        "tokens": result.tokens,
        "loss": [difference_json(d) for d in result.loss],
        "gradients": {
            "compared": len(ranked),
            "max_relative": max((d.relative for d in ranked), default=None),
            "worst": [difference_json(d) for d in ranked[:WORST_KEPT]],
        },
        "speed": result.speed,
        "training_flags": result.training_flags,
        "failures": failures(result),
    }


def difference_json(d: Difference) -> Dict[str, Any]:
    extra = {"allowed": d.allowed, "relative": d.relative, "margin": d.margin, "passed": d.passed}
    return {**asdict(d), **extra}


TOLERANCE_RULE = (
    f"DCP within 2 x {ERROR_FACTOR:g} x max(measured rounding, {FLOOR_ULPS:g} float32 ulps of "
    "the largest magnitude) of static CP, per quantity; measured rounding: static CP against "
    "static CP with the same plan in reverse order (tools/check/tolerance.py)"
)


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
