#!/usr/bin/env python
"""Offline reference search: how close to the lower bound can plans of a benchmark case get?

A research script, not part of the package (no torch). For each case of the benchmark matrix it
builds ``default_dynamic_cp``'s plan (the ``benchmark --no-timing`` case: workload, budget, VPP,
cost model), then runs simulated annealing over valid plans starting from it, with the exact
critical path as the objective. Moves:

- relocate a sample to another group (any micro-batch) within the budget and its minimum CP size;
- swap two samples of different groups (any micro-batches);
- swap the contents of two same-size groups of different micro-batches, or the groups tiling
  two same-size aligned blocks of different micro-batches;
- split a group into its two buddy halves (samples dealt between them, both non-empty);
- merge two buddy sibling groups of a micro-batch into their parent block;
- remove VPP micro-batches (their samples re-inserted greedily elsewhere) or add VPP micro-batches
  (each one whole-domain group holding one sample taken from a group of several).

Each move touches one or two micro-batches (or the removed/added ones): only their peaks are
recomputed. The search is deterministic given ``--seed`` and ``--iters`` (evaluation budget per
case, not a time budget). The best plan is checked with ``Plan.validate()`` and its critical path
recomputed with ``metrics.critical_path``.

Usage::

    PYTHONPATH=. nice python scripts/offline_plan_search.py --details  # 13 cases, ~8 min
    PYTHONPATH=. python scripts/offline_plan_search.py --case rl-rollouts:2048:4:model --iters 50000
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from offline_plan_moves import MOVES, State

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.lower_bound import coverage_ring, fewest_microbatches, ring_shares
from megatron_dcp.scheduling.metrics import critical_path, lower_bound, rank_loads
from megatron_dcp.scheduling.plan import Plan
from megatron_dcp.scheduling.registry import build_scheduler
from megatron_dcp.tools.benchmark_matrix import matrix_lengths
from megatron_dcp.tools.compare import DomainSpec, scheduler_kwargs
from megatron_dcp.tools.workloads import reference_workload

DEFAULT_CASES = [
    f"{wl}:{b}:{v}:latency"
    for wl in ("rl-rollouts", "long-sft")
    for b in (2048, 4096)
    for v in (1, 2, 4)
] + ["rl-rollouts:2048:4:model"]

# Relative weights of the moves (the structural ones are rarer: they cost more to evaluate).
MOVE_WEIGHTS = (
    ("relocate", 40),
    ("swap", 30),
    ("swap_groups", 4),
    ("swap_blocks", 6),
    ("split", 8),
    ("merge", 8),
    ("remove_mbs", 1),
    ("add_mbs", 1),
)


# ----------------------------------------------------------------------------- case building


@dataclass
class Case:
    """One benchmark case: its name, our planner's plan, the priced cost model and the bound."""

    name: str
    cost_name: str
    plan: Plan
    cost: CostModel
    lb: float


def build_case(text: str) -> Case:
    """``workload:budget:vpp:cost`` -> the case as ``benchmark --no-timing`` builds it (seed 0)."""
    wl, budget, vpp, cost_name = text.split(":")
    budget, vpp = int(budget), int(vpp)
    workload = reference_workload(wl)
    spec = DomainSpec(workload.dp_size, workload.cp_size, budget, vpp=vpp if vpp > 1 else None)
    cost = spec.priced(build_cost_model(cost_name))
    lengths = matrix_lengths(workload, budget, 0)
    scheduler = build_scheduler("default_dynamic_cp", **scheduler_kwargs(spec, cost))
    plan = scheduler.schedule(lengths)
    name = f"{wl} b{budget} vpp{vpp}"
    return Case(name, cost_name, plan, cost, lower_bound(plan, cost))


# ----------------------------------------------------------------------------- annealing


def anneal(st: State, rng: random.Random, iters: int, t0: float, t1: float):
    """Simulated annealing, geometric cooling from ``t0`` to ``t1`` (absolute cost units) over
    ``iters`` drawn moves; return (best objective, its snapshot, accepted counts per move)."""
    names = [n for n, _ in MOVE_WEIGHTS]
    cum, total = [], 0
    for _, w in MOVE_WEIGHTS:
        total += w
        cum.append(total)
    cur = best = st.objective()
    best_snap, accepted = st.snapshot(), Counter()
    ratio = math.log(t1 / t0)
    for t in range(iters):
        name = rng.choices(names, cum_weights=cum)[0]
        result = MOVES[name](st, rng)
        if result is None:
            continue
        delta, undo = result
        if delta <= 0 or rng.random() < math.exp(-delta / (t0 * math.exp(ratio * t / iters))):
            cur += delta
            accepted[name] += 1
            if cur < best * (1 - 1e-12):
                cur = st.objective()  # exact before keeping it as the best
                if cur < best:
                    best, best_snap = cur, st.snapshot()
        else:
            undo()
    return best, best_snap, accepted


def search(case: Case, iters: int, seed: int, t0: float, t1: float, restarts: int):
    """Anneal ``restarts`` times (each from the best plan so far, ``iters / restarts`` moves);
    return (validated best plan, accepted move counts)."""
    st = State(case.plan, case.cost)
    unit = case.lb / fewest_microbatches(case.plan.seqlens, case.plan.domain, st.vpp)
    rng = random.Random(seed)
    best, snap, accepted = st.objective(), st.snapshot(), Counter()
    for _ in range(restarts):
        st = State(st.to_plan(snap), case.cost)
        value, new_snap, acc = anneal(st, rng, iters // restarts, t0 * unit, t1 * unit)
        accepted.update(acc)
        if value < best:
            best, snap = value, new_snap
    plan = st.to_plan(snap).validate()
    return plan, accepted


# ----------------------------------------------------------------------------- report


def bound_ring(plan: Plan, cost: CostModel) -> float:
    """The ring term of the lower bound, summed over ranks (``R`` of ``lower_bound``)."""
    dom, vpp = plan.domain, plan.microbatch_group_size_per_vp_stage
    shares = ring_shares(dom, cost)
    shared = 0.0
    for L in plan.seqlens:
        base, rate = shares[dom.cp_degree(L)]
        shared += base + rate * L
    count = fewest_microbatches(plan.seqlens, dom, vpp)
    return max(shared, coverage_ring(len(plan.seqlens), count, dom.size, cost))


def plan_stats(plan: Plan, cost: CostModel, lb: float) -> Dict[str, object]:
    """What a plan spends beyond the bound, over the bound: peak − mean load summed over
    micro-batches (imbalance), ring steps per rank (and beyond the bound's ring term), work
    beyond each sample's minimum CP size per rank, and the groups per size (CP/LB − 1 is
    imbalance + extra work + ring excess + extra micro-batch costs)."""
    dom, n = plan.domain, plan.domain.size
    imbalance = ring = extra = 0.0
    sizes: Counter = Counter()
    for mb in plan.microbatches:
        loads = rank_loads(plan, mb, cost)
        imbalance += max(loads) - sum(loads) / n
        for g in mb.groups:
            sizes[g.size] += 1
            ring += g.size * cost.ring_cost(g.size)
            for i in g.sample_ids:
                L, c0 = plan.seqlens[i], dom.cp_degree(plan.seqlens[i])
                extra += g.size * cost.per_rank(L, g.size) - c0 * cost.per_rank(L, c0)
    return {
        "imb": imbalance / lb,
        "ring": ring / n / lb,
        "ring_excess": (ring - bound_ring(plan, cost)) / n / lb,
        "extra": extra / n / lb,
        "groups": dict(sorted(sizes.items())),
    }


def run_case(text: str, args) -> Dict[str, object]:
    """Search one case; print its row and the stats of both plans; return the row's numbers."""
    case = build_case(text)
    began = time.process_time()
    best, accepted = search(case, args.iters, args.seed, args.t0, args.t1, args.restarts)
    seconds = time.process_time() - began
    ours = critical_path(case.plan, case.cost) / case.lb
    found = critical_path(best, case.cost) / case.lb
    print(
        f"{case.name:<22} {case.cost_name:<8} {ours:>8.4f} {found:>8.4f} "
        f"{case.plan.num_microbatches:>6} {best.num_microbatches:>6} {seconds:>7.1f}",
        flush=True,
    )
    if args.details:
        for label, plan in (("ours", case.plan), ("best", best)):
            s = plan_stats(plan, case.cost, case.lb)
            print(
                f"    {label}: imbalance {s['imb']:.4f} ring {s['ring']:.4f} "
                f"(excess {s['ring_excess']:.4f}) "
                f"extra-work {s['extra']:.4f} groups/size {s['groups']}"
            )
        print(f"    accepted moves: {dict(accepted)}", flush=True)
    return {"ours": ours, "best": found}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", help="workload:budget:vpp:cost (repeatable)")
    parser.add_argument("--iters", type=int, default=5_000_000, help="moves drawn per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--t0", type=float, default=1e-4, help="start temperature / (LB / K0)")
    parser.add_argument("--t1", type=float, default=1e-6, help="end temperature / (LB / K0)")
    parser.add_argument("--restarts", type=int, default=2, help="anneals from the best so far")
    parser.add_argument("--details", action="store_true", help="stats of both plans per case")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    cases = args.case or DEFAULT_CASES
    print(
        f"iters/case {args.iters}, seed {args.seed}, t0 {args.t0}, t1 {args.t1}, "
        f"restarts {args.restarts}"
    )
    print(
        f"{'case':<22} {'cost':<8} {'ours':>8} {'best':>8} {'K ours':>6} {'K best':>6} "
        f"{'cpu s':>7}"
    )
    rows = [run_case(text, args) for text in cases]
    gap = [r for r in rows if r["ours"] > 1.05]
    if gap:
        ours = sum(r["ours"] - 1 for r in gap) / len(gap)
        found = sum(r["best"] - 1 for r in gap) / len(gap)
        print(
            f"above 1.05 ({len(gap)} cases): mean ours-1 {ours:.4f}, mean best-1 {found:.4f}, "
            f"gap closed {(ours - found) / ours:.1%}"
        )


if __name__ == "__main__":
    main()
