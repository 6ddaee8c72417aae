"""The driver of the moves across the plan (``dynamic_cp.plan_search.improve_plan``) on a scripted
move: its acceptance rule, its bounds (steps per micro-batch, passes) and the restart after a
move."""

from functools import partial

from scheduling_strategies import rank_drafts

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.dynamic_cp.knobs import Knobs
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import PlanCandidate
from megatron_dcp.scheduling.dynamic_cp.plan_search import improve_plan
from megatron_dcp.scheduling.dynamic_cp.search_state import Context

LINEAR = CostModel(1.0, 0.0)


class Shave:
    """Lowers the one group of the micro-batch it visits by ``cut`` per move, claiming ``cut`` as
    its gain; visits the micro-batches in index order and records each visit."""

    def __init__(self, ctx, drafts, cut=10.0, passes=3, steps=2, restart=False):
        self.drafts, self.cut, self.visits = drafts, cut, []
        self.passes, self.steps, self.restart = passes, steps, restart

    def order(self):
        return list(range(len(self.drafts)))

    def find(self, index):
        self.visits.append(index)
        (group,) = self.drafts[index]
        if group.load < self.cut:
            return None
        return PlanCandidate(self.cut, (group.load,), partial(self.shave, group))

    def shave(self, group):
        group.load -= self.cut


def driven(make_move, layout, knobs=Knobs()):
    ctx = Context(Domain(1, 1, 1000), LINEAR, knobs)
    drafts = rank_drafts(ctx, layout)
    made = []

    def make(ctx, drafts):
        made.append(make_move(ctx, drafts))
        return made[-1]

    improve_plan(ctx, drafts, make)
    return [draft[0].load for draft in drafts], made[0].visits


def test_at_most_steps_moves_per_micro_batch_and_pass_within_the_passes():
    loads, visits = driven(Shave, [[[100]], [[100]]])
    assert loads == [40, 40]  # 3 passes × 2 steps × 10
    assert visits == [0, 0, 1, 1] * 3


def test_a_gain_within_min_gain_of_the_peak_is_refused():
    loads, visits = driven(partial(Shave, cut=10.0), [[[100]]], Knobs(min_gain=0.1))
    assert loads == [100]
    assert visits == [0]  # a pass without a move ends the search


def test_a_pass_of_a_restarting_move_ends_at_its_first_move():
    loads, visits = driven(partial(Shave, restart=True, steps=1), [[[100]], [[100]]])
    assert loads == [70, 100]
    assert visits == [0, 0, 0]
