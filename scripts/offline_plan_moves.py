"""The state and moves of the offline reference search (``offline_plan_search.py``): a plan as
mutable micro-batches of CP groups whose peaks are kept current, and the moves of the annealer
over valid plans, each returning its change of Σ peaks (with the fixed micro-batch costs) and
how to undo it, or None when it does not apply. Research code beside the package, not part of
it (no torch)."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import is_power_of_two
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch, Plan

# After a failed try to remove micro-batches, this many draws of that move are skipped.
REMOVE_COOLDOWN = 20

# ----------------------------------------------------------------------------- search state


class Group:
    """A mutable CP group: aligned block (start, size), its samples, tokens and per-rank cost."""

    __slots__ = ("start", "size", "ids", "tokens", "cost", "mb")

    def __init__(self, start: int, size: int, ids: List[int], mb: "MB", state: "State") -> None:
        self.start, self.size, self.ids, self.mb = start, size, ids, mb
        self.tokens = self.cost = 0.0
        state.refresh(self)


class MB:
    """A mutable micro-batch: its groups by start position and its peak (max group cost)."""

    __slots__ = ("groups", "peak")

    def __init__(self) -> None:
        self.groups: Dict[int, Group] = {}
        self.peak = 0.0

    def update_peak(self) -> float:
        """Recompute the peak; return the change."""
        old, self.peak = self.peak, max(g.cost for g in self.groups.values())
        return self.peak - old


class State:
    """A plan under search: micro-batches of mutable groups plus per-sample lookup tables."""

    def __init__(self, plan: Plan, cost: CostModel) -> None:
        dom = plan.domain
        if not is_power_of_two(dom.size):
            raise SystemExit("this search handles power-of-two domains only")
        self.plan, self.cost, self.dom = plan, cost, dom
        self.lengths = plan.seqlens
        self.budget, self.n_ranks, self.min_cp = dom.budget, dom.size, dom.min_cp_size
        self.vpp = plan.microbatch_group_size_per_vp_stage or 1
        self.cap = plan.max_samples_per_group or math.inf
        self.cdeg = [dom.cp_degree(L) for L in self.lengths]
        self.per_rank = [{s: cost.per_rank(L, s) for s in dom.group_sizes} for L in self.lengths]
        self.ring = {s: cost.ring_cost(s) for s in dom.group_sizes}
        self.remove_cooldown = 0
        self.loc: List[Optional[Group]] = [None] * len(self.lengths)
        self.mbs: List[MB] = []
        for microbatch in plan.microbatches:
            mb = MB()
            for g in microbatch.groups:
                self.add_group(mb, g.ranks[0], g.size, list(g.sample_ids))
            mb.update_peak()
            self.mbs.append(mb)

    def add_group(self, mb: MB, start: int, size: int, ids: List[int]) -> Group:
        """Create a group in ``mb`` and point its samples at it."""
        group = Group(start, size, ids, mb, self)
        mb.groups[start] = group
        for i in ids:
            self.loc[i] = group
        return group

    def refresh(self, g: Group) -> None:
        """Recompute a group's tokens and cost from its samples (exact, no drift)."""
        s = g.size
        g.tokens = sum(self.lengths[i] for i in g.ids)
        g.cost = sum(self.per_rank[i][s] for i in g.ids) + self.ring[s] if g.ids else 0.0

    def objective(self) -> float:
        """Critical path: Σ peaks + K × micro-batch cost."""
        return sum(mb.peak for mb in self.mbs) + self.cost.microbatch * len(self.mbs)

    def fits(self, i: int, g: Group, extra_tokens: int = 0) -> bool:
        """True when sample ``i`` may join ``g`` (min CP size, budget, cap), with ``extra_tokens``
        more (negative: fewer) tokens in ``g``."""
        return (
            self.cdeg[i] <= g.size
            and g.tokens + extra_tokens + self.lengths[i] <= g.size * self.budget
            and len(g.ids) < self.cap
        )

    def snapshot(self) -> List[List[Tuple[int, int, Tuple[int, ...]]]]:
        """A copy of the plan: per micro-batch, (start, size, sample ids) of each group."""
        return [[(g.start, g.size, tuple(g.ids)) for g in mb.groups.values()] for mb in self.mbs]

    def to_plan(self, snap) -> Plan:
        """The :class:`Plan` of a snapshot (groups in position order)."""
        microbatches = []
        for groups in snap:
            cp_groups = tuple(
                CPGroup(tuple(range(start, start + size)), ids)
                for start, size, ids in sorted(groups)
            )
            microbatches.append(MicroBatch(cp_groups))
        p = self.plan
        return Plan(
            p.seqlens,
            p.domain,
            tuple(microbatches),
            p.microbatch_group_size_per_vp_stage,
            p.max_samples_per_group,
        )


# ----------------------------------------------------------------------------- moves
# Each move mutates the state and returns (delta of the objective, undo callable), or None when
# the drawn move is invalid (nothing changed).


def pick_sample(st: State, rng: random.Random) -> int:
    """A sample, biased towards the peak group of a random micro-batch."""
    if rng.random() < 0.6:
        mb = rng.choice(st.mbs)
        peak_group = max(mb.groups.values(), key=lambda g: g.cost)
        return rng.choice(peak_group.ids)
    return rng.randrange(len(st.lengths))


def pick_group(st: State, rng: random.Random, near: Optional[MB] = None) -> Group:
    """A random group: of ``near`` half of the time when given, else of a random micro-batch."""
    mb = near if near is not None and rng.random() < 0.5 else rng.choice(st.mbs)
    return rng.choice(list(mb.groups.values()))


def _peaks_delta(mbs: Sequence[MB]) -> float:
    """Recompute the peaks of distinct micro-batches; return the total change."""
    return sum(mb.update_peak() for mb in {id(mb): mb for mb in mbs}.values())


def _set_ids(st: State, g: Group, ids: List[int]) -> None:
    """Give ``g`` these samples (and refresh it)."""
    g.ids = ids
    for i in ids:
        st.loc[i] = g
    st.refresh(g)


def _reassign(st: State, changes: List[Tuple[Group, List[int]]]):
    """Give each group its new samples; return the change of Σ peaks and how to undo it."""
    old = [(g, g.ids) for g, _ in changes]
    for g, ids in changes:
        _set_ids(st, g, ids)
    return _peaks_delta([g.mb for g, _ in changes]), lambda: _undo_changes(st, old)


def move_relocate(st: State, rng: random.Random):
    """Move one sample to another group that holds it (its source group stays non-empty)."""
    i = pick_sample(st, rng)
    src = st.loc[i]
    dst = pick_group(st, rng, src.mb)
    if dst is src or len(src.ids) < 2 or not st.fits(i, dst):
        return None
    return _reassign(st, [(src, [j for j in src.ids if j != i]), (dst, dst.ids + [i])])


def move_swap(st: State, rng: random.Random):
    """Exchange two samples of different groups (each fitting the other's group)."""
    i = pick_sample(st, rng)
    gi = st.loc[i]
    gj = pick_group(st, rng, gi.mb)
    if gj is gi:
        return None
    j = rng.choice(gj.ids)
    Li, Lj = st.lengths[i], st.lengths[j]
    if not (st.fits(j, gi, -Li) and st.fits(i, gj, -Lj)) or Li == Lj:
        return None
    into_i = [k for k in gi.ids if k != i] + [j]
    return _reassign(st, [(gi, into_i), (gj, [k for k in gj.ids if k != j] + [i])])


def move_swap_groups(st: State, rng: random.Random):
    """Exchange the contents of two same-size groups of different micro-batches."""
    g1 = st.loc[pick_sample(st, rng)]
    mb2 = rng.choice(st.mbs)
    if mb2 is g1.mb:
        return None
    same = [g for g in mb2.groups.values() if g.size == g1.size]
    if not same:
        return None
    g2 = rng.choice(same)
    return _reassign(st, [(g1, g2.ids), (g2, g1.ids)])


def _block_groups(mb: MB, start: int, size: int) -> Optional[List[Group]]:
    """The groups of ``mb`` that tile the block [start, start + size), or None when a group
    crosses its edge."""
    inside = [g for g in mb.groups.values() if start <= g.start < start + size]
    if sum(g.size for g in inside) != size or any(g.start + g.size > start + size for g in inside):
        return None
    return inside


def _exchange(in_a: List[Group], a: MB, in_b: List[Group], b: MB, shift: int) -> None:
    """Move ``in_a`` from ``a`` to ``b`` shifted by ``shift`` positions and ``in_b`` from ``b``
    to ``a`` shifted by ``-shift`` (all removed before any is added: their keys may clash)."""
    for mb, groups in ((a, in_a), (b, in_b)):
        for g in groups:
            del mb.groups[g.start]
    for mb, groups, by in ((b, in_a, shift), (a, in_b, -shift)):
        for g in groups:
            g.start += by
            g.mb = mb
            mb.groups[g.start] = g


def move_swap_blocks(st: State, rng: random.Random):
    """Exchange the groups tiling an aligned block of one micro-batch with those tiling an
    aligned block of the same size of another (a whole sub-partition moves; alignment holds)."""
    g = st.loc[pick_sample(st, rng)]
    a = g.mb
    b = rng.choice(st.mbs)
    size = g.size << rng.randrange(3)
    if b is a or size >= st.n_ranks:
        return None
    start_a = g.start - g.start % size
    start_b = rng.randrange(st.n_ranks // size) * size
    in_a, in_b = _block_groups(a, start_a, size), _block_groups(b, start_b, size)
    if in_a is None or in_b is None:
        return None
    _exchange(in_a, a, in_b, b, start_b - start_a)

    def undo():
        _exchange(in_b, a, in_a, b, start_b - start_a)
        _peaks_delta([a, b])

    return _peaks_delta([a, b]), undo


def deal_halves(st: State, ids: List[int], half: int, rng: random.Random):
    """Deal ``ids`` between two halves of ``half`` ranks: longest first, each to the cheaper
    half that holds it (a random tie-break order); None when a sample fits neither half or a
    half stays empty."""
    order = sorted(ids, key=lambda i: (-st.lengths[i], rng.random()))
    parts: Tuple[List[int], List[int]] = ([], [])
    tokens, costs = [0, 0], [0.0, 0.0]
    for i in order:
        L = st.lengths[i]
        options = [
            k for k in (0, 1) if tokens[k] + L <= half * st.budget and len(parts[k]) < st.cap
        ]
        if st.cdeg[i] > half or not options:
            return None
        k = min(options, key=lambda k: (costs[k], rng.random()))
        parts[k].append(i)
        tokens[k] += L
        costs[k] += st.per_rank[i][half]
    if not parts[0] or not parts[1]:
        return None
    return parts


def move_split(st: State, rng: random.Random):
    """Split a group into its two buddy halves, its samples dealt between them."""
    g = st.loc[pick_sample(st, rng)]
    half = g.size // 2
    if half < st.min_cp or len(g.ids) < 2:
        return None
    parts = deal_halves(st, g.ids, half, rng)
    if parts is None:
        return None
    mb, start, ids = g.mb, g.start, g.ids
    del mb.groups[start]
    a = st.add_group(mb, start, half, parts[0])
    b = st.add_group(mb, start + half, half, parts[1])

    def undo():
        del mb.groups[a.start], mb.groups[b.start]
        st.add_group(mb, start, 2 * half, ids)
        mb.update_peak()

    return mb.update_peak(), undo


def move_merge(st: State, rng: random.Random):
    """Merge a group with its buddy sibling (same size, same micro-batch) into their parent."""
    g = st.loc[pick_sample(st, rng)]
    mb, size = g.mb, g.size
    if size >= st.n_ranks:
        return None
    buddy = mb.groups.get(g.start ^ size)
    if buddy is None or buddy.size != size or len(g.ids) + len(buddy.ids) > st.cap:
        return None
    lo, hi = (g, buddy) if g.start < buddy.start else (buddy, g)
    del mb.groups[lo.start], mb.groups[hi.start]
    st.add_group(mb, lo.start, 2 * size, lo.ids + hi.ids)

    def undo():
        del mb.groups[lo.start]
        st.add_group(mb, lo.start, size, lo.ids)
        st.add_group(mb, hi.start, size, hi.ids)
        mb.update_peak()

    return mb.update_peak(), undo


def _insert_greedily(st: State, ids: List[int], mbs: Sequence[MB]):
    """Insert samples (longest first) each into the group of ``mbs`` that raises its
    micro-batch's peak least (then the cheapest); return the (group, old ids) changes, or None
    (after undoing them) when a sample fits nowhere."""
    if not _may_fit(st, ids, mbs):
        return None
    changes: List[Tuple[Group, List[int]]] = []
    for i in sorted(ids, key=lambda i: -st.lengths[i]):
        best, best_key = None, None
        for mb in mbs:
            for g in mb.groups.values():
                if st.fits(i, g):
                    new = g.cost + st.per_rank[i][g.size]
                    key = (max(0.0, new - mb.peak), new)
                    if best_key is None or key < best_key:
                        best, best_key = g, key
        if best is None:
            _undo_changes(st, changes)
            return None
        changes.append((best, best.ids))
        _set_ids(st, best, best.ids + [i])
        best.mb.update_peak()
    return changes


def _may_fit(st: State, ids: List[int], mbs: Sequence[MB]) -> bool:
    """A quick necessary test for :func:`_insert_greedily`: for every size c, the samples whose
    minimum CP size is ≥ c fit the free tokens of the groups of ``mbs`` of size ≥ c, and each
    sample alone fits the free tokens of one such group."""
    room: Dict[int, float] = {}
    free: Counter = Counter()
    for mb in mbs:
        for g in mb.groups.values():
            left = g.size * st.budget - g.tokens
            room[g.size] = max(room.get(g.size, 0), left)
            free[g.size] += left
    need: Counter = Counter()
    for i in ids:
        need[st.cdeg[i]] += st.lengths[i]
        if not any(left >= st.lengths[i] for size, left in room.items() if size >= st.cdeg[i]):
            return False
    have = wanted = 0
    for size in reversed(st.dom.group_sizes):
        have, wanted = have + free[size], wanted + need[size]
        if wanted > have:
            return False
    return True


def _undo_changes(st: State, changes: List[Tuple[Group, List[int]]]) -> None:
    """Restore the groups a move changed, (group, old samples), latest first."""
    for g, old in reversed(changes):
        _set_ids(st, g, old)
        g.mb.update_peak()


def move_remove_mbs(st: State, rng: random.Random):
    """Remove VPP micro-batches; their samples go greedily into the others' groups (after a
    failed try, the next ``REMOVE_COOLDOWN`` draws of this move are skipped: tries are dear)."""
    if st.remove_cooldown > 0:
        st.remove_cooldown -= 1
        return None
    k = st.vpp
    if len(st.mbs) <= k:
        return None
    tokens = sum(st.lengths)
    if tokens > (len(st.mbs) - k) * st.n_ranks * st.budget:
        return None
    before = st.objective()
    picked = sorted(rng.sample(range(len(st.mbs)), k))
    removed = [st.mbs[j] for j in picked]
    ids = [i for mb in removed for g in mb.groups.values() for i in g.ids]
    for j in reversed(picked):
        del st.mbs[j]
    changes = _insert_greedily(st, ids, st.mbs)
    if changes is None:
        _restore_mbs(st, picked, removed)
        st.remove_cooldown = REMOVE_COOLDOWN
        return None

    def undo():
        _undo_changes(st, changes)
        _restore_mbs(st, picked, removed)

    return st.objective() - before, undo


def _restore_mbs(st: State, picked: List[int], removed: List[MB]) -> None:
    """Put removed micro-batches back at their indices, their samples pointing at them."""
    for j, mb in zip(picked, removed):
        st.mbs.insert(j, mb)
        for g in mb.groups.values():
            for i in g.ids:
                st.loc[i] = g


def move_add_mbs(st: State, rng: random.Random):
    """Add VPP micro-batches, each one whole-domain group of one sample taken from a group of
    several samples."""
    before, taken = st.objective(), []
    for _ in range(st.vpp):
        g = st.loc[rng.randrange(len(st.lengths))]
        if len(g.ids) < 2:
            break
        i = rng.choice(g.ids)
        taken.append((g, g.ids))
        _set_ids(st, g, [j for j in g.ids if j != i])
        g.mb.update_peak()
        mb = MB()
        st.add_group(mb, 0, st.n_ranks, [i])
        mb.update_peak()
        st.mbs.append(mb)
    if len(taken) < st.vpp:
        _undo_add(st, taken)
        return None
    return st.objective() - before, lambda: _undo_add(st, taken)


def _undo_add(st: State, taken: List[Tuple[Group, List[int]]]) -> None:
    """Drop the micro-batches :func:`move_add_mbs` appended; give the samples back."""
    del st.mbs[len(st.mbs) - len(taken) :]
    _undo_changes(st, taken)


MOVES = {
    "relocate": move_relocate,
    "swap": move_swap,
    "swap_groups": move_swap_groups,
    "swap_blocks": move_swap_blocks,
    "split": move_split,
    "merge": move_merge,
    "remove_mbs": move_remove_mbs,
    "add_mbs": move_add_mbs,
}
