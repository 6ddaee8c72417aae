"""Plans pinned: ``default_dynamic_cp``'s plan of every case of the benchmark matrix (both cost
models, every budget and VPP setting; ``megatron-dcp benchmark``) and of a fixed set of fuzz
cases, as digests in ``plan_digests.json`` beside this file, with each plan's critical path.

A refactor of the planner must keep every digest. A change meant to alter plans updates the file:

    .venv/bin/python tests/unit/scheduling/test_plan_digests.py --update

which prints, for every changed plan, its critical path before and after (the file keeps the
new ones); the change is right when no critical path grew.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

from megatron_dcp.scheduling import Plan, build_cost_model, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.tools.benchmark_matrix import DEFAULT_BUDGETS, DEFAULT_VPP, matrix_lengths
from megatron_dcp.tools.fuzz_cases import draw_case
from megatron_dcp.tools.workloads import REFERENCE_WORKLOADS

GOLDEN = Path(__file__).with_name("plan_digests.json")
SCHEDULER = "default_dynamic_cp"
COST_MODELS = ("model", "latency")
FUZZ_SEED, FUZZ_CASES = 0, 60


def plan_digest(plan: Plan) -> str:
    """The plan's groups (ranks, samples) per micro-batch, hashed."""
    layout = [[[g.ranks, g.sample_ids] for g in mb.groups] for mb in plan.microbatches]
    text = json.dumps([layout, plan.microbatch_group_size_per_vp_stage])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def matrix_plans() -> Iterator[Tuple[str, Dict]]:
    for cost_name in COST_MODELS:
        cost = build_cost_model(cost_name)
        for workload in REFERENCE_WORKLOADS:
            for budget in DEFAULT_BUDGETS:
                for vpp in DEFAULT_VPP:
                    scheduler = build_scheduler(
                        SCHEDULER,
                        dp_size=workload.dp_size,
                        cp_size=workload.cp_size,
                        max_seqlen_per_dp_cp_rank=budget,
                        microbatch_group_size_per_vp_stage=vpp if vpp > 1 else None,
                        cost_model=cost,
                    )
                    plan = scheduler.schedule(matrix_lengths(workload, budget, 0))
                    name = f"{cost_name} {workload.name} b{budget} vpp{vpp}"
                    yield name, pinned(plan, cost)


def fuzz_plans() -> Iterator[Tuple[str, Dict]]:
    cost = build_cost_model("model")
    for index in range(FUZZ_CASES):
        case = draw_case(FUZZ_SEED, index)
        name = f"fuzz {FUZZ_SEED}:{index}"
        try:
            scheduler = build_scheduler(SCHEDULER, cost_model=cost, **case.kwargs())
            plan = scheduler.schedule(list(case.seqlens))
        except ValueError as error:
            yield name, {"refused": type(error).__name__}
            continue
        yield name, pinned(plan, cost)


def pinned(plan: Plan, cost) -> Dict:
    return {"digest": plan_digest(plan), "critical_path": critical_path(plan, cost)}


def current() -> Dict[str, Dict]:
    return dict([*matrix_plans(), *fuzz_plans()])


def changes(old: Dict[str, Dict], new: Dict[str, Dict]) -> list:
    """(case, old critical path, new critical path) of every case whose plan changed."""
    return [
        (name, old.get(name, {}).get("critical_path"), new[name].get("critical_path"))
        for name in sorted(set(old) | set(new))
        if old.get(name, {}).get("digest") != new.get(name, {}).get("digest")
        or ("refused" in old.get(name, {})) != ("refused" in new.get(name, {}))
    ]


def table(rows: list) -> str:
    lines = [f"{'case':<40} {'critical path before':>22} {'after':>14} {'after/before':>12}"]
    for name, before, after in rows:
        ratio = f"{after / before:.4f}" if before and after else "-"
        cells = [f"{value:.6g}" if value else "-" for value in (before, after)]
        lines.append(f"{name:<40} {cells[0]:>22} {cells[1]:>14} {ratio:>12}")
    return "\n".join(lines)


def test_plans_match_their_pinned_digests():
    pinned_plans = json.loads(GOLDEN.read_text())
    changed = changes(pinned_plans, current())
    assert not changed, (
        "plans changed (update with `python tests/unit/scheduling/test_plan_digests.py "
        "--update` when meant to; no critical path may grow):\n" + table(changed)
    )


def test_the_digest_sees_a_moved_sample():
    def plan_of(lengths):
        scheduler = build_scheduler(SCHEDULER, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=64)
        return scheduler.schedule(lengths)

    assert plan_digest(plan_of([40, 30, 20, 10, 5])) == plan_digest(plan_of([40, 30, 20, 10, 5]))
    assert plan_digest(plan_of([40, 30, 20, 10, 5])) != plan_digest(plan_of([30, 40, 20, 10, 5]))


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    new = current()
    print(table(changes(old, new)))
    GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
