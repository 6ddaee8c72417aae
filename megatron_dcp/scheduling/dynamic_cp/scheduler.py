"""``default_dynamic_cp``: the DCP scheduler.

The objective is the critical path Σ_micro-batch (max_rank cost + the fixed micro-batch cost).
Micro-batches may differ in load; what costs time is imbalance *inside* a micro-batch, CP
overhead (each group's ring steps, carried from its first sample, included) and micro-batches
beyond the fewest. A plan is made in four phases::

    samples ──► construction ──► alignment ──► search ──► selection ──► search ──► Plan
                (construction,   (vpp_         (plan_     (plan_rank)   (chosen plan:
                 microbatch_      alignment)    search:                  polish, re-form,
                 forming)                       relocate/swap)           relocate, ties)

- **construction** forms candidate plans of micro-batch drafts (levels and buckets, every
  micro-batch at its own level, packing; ``construction``), each micro-batch formed by
  ``microbatch_forming`` with no idle rank (``rank_repair``) and polished lightly;
- **alignment** makes each candidate's micro-batch count a multiple of the VPP group size;
- **search** improves the plans with moves (``moves/``) driven inside one micro-batch
  (``microbatch_search``) and across the plan (``plan_search``);
- **selection** keeps the best candidate (:func:`plan_rank`), searches it further, then lets
  the static-CP plan of the same lengths (``dp_balanced`` at the configured CP size, where it
  can run them) compete under the same cost model: turning DCP on never plans a longer step
  than static CP would. Over nodes, the plan made blind to them competes too.

Every constant is a field of :class:`~.knobs.Knobs`; the search is bounded by counted work,
never by time, so every rank computes the same plan.
"""

from __future__ import annotations

from typing import ClassVar, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import cost_keys, key_patches
from megatron_dcp.scheduling.dp_balanced import DPBalancedScheduler
from megatron_dcp.scheduling.draft import Item, freeze_microbatch, group_of_items
from megatron_dcp.scheduling.dynamic_cp.construction import formed_plan, packed_plan
from megatron_dcp.scheduling.dynamic_cp.knobs import DEFAULT_KNOBS, Knobs
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import heaviest_first
from megatron_dcp.scheduling.dynamic_cp.plan_search import search_candidates, search_chosen
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    draft_critical_path,
)
from megatron_dcp.scheduling.dynamic_cp.vpp_alignment import align_to_vpp
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.lower_bound import batch_lower_bound, static_cp_lower_bound
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.scheduling.plan import MicroBatch, Plan
from megatron_dcp.scheduling.registry import Scheduler


class DefaultDynamicCPScheduler(Scheduler, name="default_dynamic_cp"):
    """Per-sequence CP sizes, balanced THD micro-batches; see the module docstring. ``knobs``
    holds the planner's constants (a subclass may plan with others)."""

    knobs: ClassVar[Knobs] = DEFAULT_KNOBS
    prices_patches = True

    def _schedule(self, seqlens: tuple, patches: Tuple[int, ...] = ()) -> List[MicroBatch]:
        keys = cost_keys(seqlens, patches, self.cost_model)
        vision = keys is not seqlens  # some sample's cost key holds patches
        ctx = Context(self.domain, self.cost_model, self.knobs, vision)
        degree = self.domain.cp_degrees(seqlens)
        degrees = map(degree.__getitem__, seqlens)
        items = list(map(Item, range(len(seqlens)), seqlens, degrees, keys))
        vpp = self.microbatch_group_size_per_vp_stage
        best = searched_plan(ctx, items, vpp)
        nodes = self.cost_model.nodes
        if len(items) <= ctx.knobs.search_samples and nodes and nodes.node_size < self.domain.size:
            # Over nodes, the plan made blind to them competes too, priced as it is: knowing the
            # nodes never plans a longer critical path than not knowing them.
            blind = Context(self.domain, self.cost_model.with_nodes(None), ctx.knobs, vision)
            other = repriced(ctx, searched_plan(blind, items, vpp))
            best = min((best, other), key=lambda drafts: draft_critical_path(ctx, drafts))
        planned = [freeze_microbatch(draft) for draft in best]
        return self.against_static(seqlens, planned, patches if vision else ())

    def against_static(
        self, seqlens: tuple, planned: List[MicroBatch], patches: Tuple[int, ...] = ()
    ) -> List[MicroBatch]:
        """``planned``, or the static-CP plan of the same lengths where that has a shorter
        critical path under this cost model. The static plan is built only where it can be
        shorter: where its lower bound (``static_cp_lower_bound``) is above ``planned``'s path
        (by ``knobs.static_bound_slack``, the rounding of the two sums), it cannot be, and the
        same plan is returned without the cost of ``dp_balanced`` (a quarter of the plan time
        at N = 4,096; the bound is one pass over the lengths). Both are priced with the
        samples' ``patches`` (their vision work)."""
        path = self.path(seqlens, planned, patches)
        vpp = self.microbatch_group_size_per_vp_stage
        bound = static_cp_lower_bound(seqlens, self.domain, self.cost_model, vpp, patches)
        if bound > path * (1 + self.knobs.static_bound_slack):
            return planned
        static = self.static_plan(seqlens, patches)
        if static is not None and critical_path(static, self.cost_model) < path:
            return list(static.microbatches)
        return planned

    def static_plan(self, seqlens: tuple, patches: Tuple[int, ...] = ()) -> Optional[Plan]:
        """The static-CP plan (``dp_balanced``) of these lengths, or None where static CP cannot
        run them: DCP competes with it under the same cost model and never plans longer.
        Batches with empty samples keep DCP's plan (static bins may hold only empty samples,
        idle ranks that DCP's plans never have)."""
        if 0 in seqlens:
            return None
        try:
            return self.static_scheduler(self.domain.cp_size).schedule(seqlens, patches or None)
        except SchedulingError:
            return None

    def static_scheduler(self, cp_size: int) -> DPBalancedScheduler:
        """``dp_balanced`` on this scheduler's DP×CP domain with static CP groups of
        ``cp_size`` ranks, under the same budget, VPP grouping and cost model."""
        domain = self.domain
        return DPBalancedScheduler(
            domain.size // cp_size,
            cp_size,
            domain.budget,
            domain.min_cp_size,
            self.microbatch_group_size_per_vp_stage,
            self.cost_model,
        )

    def path(
        self, seqlens: tuple, microbatches: Sequence[MicroBatch], patches: Tuple[int, ...] = ()
    ) -> float:
        """The critical path of DCP's own ``microbatches`` under this scheduler's cost model."""
        vpp = self.microbatch_group_size_per_vp_stage
        plan = Plan(seqlens, self.domain, tuple(microbatches), vpp, patches=patches)
        return critical_path(plan, self.cost_model)


def searched_plan(ctx: Context, items: Sequence[Item], vpp: Optional[int]) -> List[MicroBatchDraft]:
    """The four phases: candidate plans constructed and aligned (:func:`candidate_plans`),
    searched across micro-batches, the best by :func:`plan_rank` selected and searched again."""
    plans = candidate_plans(ctx, items, vpp)
    search_candidates(ctx, plans, len(items))
    seqlens = [item.seqlen for item in items]
    patches = [key_patches(item.key) for item in items] if ctx.vision else ()
    bound = batch_lower_bound(seqlens, ctx.domain, ctx.cost, vpp, patches)
    best = min(plans, key=lambda drafts: plan_rank(ctx, drafts, bound))
    search_chosen(ctx, best, len(items), bound)
    return best


def candidate_plans(
    ctx: Context, items: Sequence[Item], vpp: Optional[int]
) -> List[List[MicroBatchDraft]]:
    """The levels-and-buckets plans, aligned to ``vpp``. Batches of at most
    ``knobs.search_samples`` samples, and plans that VPP alignment would split, also try the
    all-levels and the packing variants (their own micro-batch counts) unless the plan has more
    than ``knobs.search_microbatches`` micro-batches (each variant costs a scan of the pool per
    micro-batch)."""
    knobs = ctx.knobs
    pool = heaviest_first(ctx, items)
    plans = aligned_plans(ctx, pool, items, vpp, False)
    small = len(items) <= knobs.search_samples or len(plans) > 1
    if small and len(plans[0]) <= knobs.search_microbatches:
        plans += aligned_plans(ctx, pool, items, vpp, True)
        plans.append(align_to_vpp(ctx, packed_plan(ctx, pool, vpp), items, vpp))
    return plans


def aligned_plans(
    ctx: Context, pool: List[Item], items: Sequence[Item], vpp: Optional[int], all_heavy: bool
) -> List[List[MicroBatchDraft]]:
    """Constructed plans whose micro-batch count is a multiple of ``vpp``: the plan made aligned
    by :func:`align_to_vpp`, and (when it needed aligning, without ``all_heavy``) the plan whose
    buckets are as many more as the alignment needs, aligned in turn."""
    drafts = formed_plan(ctx, pool, all_heavy, vpp=vpp)
    missing = (vpp - len(drafts) % vpp) % vpp if vpp else 0
    plans = [align_to_vpp(ctx, drafts, items, vpp)]
    if missing and not all_heavy:
        more = formed_plan(ctx, pool, all_heavy, extra_buckets=missing, vpp=vpp)
        plans.append(align_to_vpp(ctx, more, items, vpp))
    return plans


def repriced(ctx: Context, drafts: Sequence[MicroBatchDraft]) -> List[MicroBatchDraft]:
    """The same micro-batches with their loads under ``ctx``'s cost model."""
    return [[group_of_items(g.block, g.items, ctx.cost) for g in draft] for draft in drafts]


def plan_rank(
    ctx: Context, drafts: Sequence[MicroBatchDraft], bound: float
) -> Tuple[int, float, float]:
    """Sort key of candidate plans: those within ``knobs.good_plan`` × the lower bound first,
    fewest micro-batches first; then the shortest critical path."""
    path = draft_critical_path(ctx, drafts)
    if path <= ctx.knobs.good_plan * bound:
        return (0, len(drafts), path)
    return (1, path, len(drafts))
