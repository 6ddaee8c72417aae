"""What an oracle test covers, asserted on what its run planned and ran on.

Two runs that agree prove nothing about DCP if both ran one CP size: a DCP step on a static plan
equals the single-process run as surely as static CP does. So every test that compares DCP with
the single-process oracle or with static CP states what it covers: the parallel layout, the CP
sizes of its plan (a mix of at least two where the test is about DCP, or an exact set) and,
where it matters, the micro-batch count; :func:`assert_covers` checks that claim against the
run's result and names the missing coverage when it fails. ``testing.force_static_plan`` is the
switch that shows every such test holds a claim (docs: tests/README.md, "Coverage").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, Collection, FrozenSet, List, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor, pipeline (``vpp`` virtual stages per stage, None without
    interleaving), data and static context parallel sizes."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: Optional[int] = None

    def __str__(self) -> str:
        vpp = f"·vpp{self.vpp}" if self.vpp else ""
        return f"tp{self.tp}·pp{self.pp}{vpp}·dp{self.dp}·cp{self.cp}"


def parallel_layout() -> Layout:
    """This rank's layout, read from megatron's parallel state (call it in a worker after the
    model-parallel state is initialised)."""
    from megatron.core import parallel_state as ps

    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )


@dataclass(frozen=True)
class RanPlan:
    """What a run planned and ran on, for results that carry nothing else of it: the CP sizes
    of its plan (a rank's own groups, or all groups) and its micro-batch count, or for several
    global batches a tuple of each per plan; and the layout."""

    cp_sizes: Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]
    num_microbatches: Union[int, Tuple[int, ...], None]
    layout: Layout


def plan_of(plan: Any, layout: Layout) -> RanPlan:
    """The :class:`RanPlan` of a ``scheduling.Plan`` run on ``layout``."""
    return RanPlan(tuple(plan.cp_size_histogram()), len(plan.microbatches), layout)


# megatron.training prints every argument as "  name ..... value" (rank 0, torchrun's prefix).
ARGUMENT = re.compile(r"^(?:\[\w+\]:)?\s+(\w+) \.+ (\S+)$", re.MULTILINE)
LAYOUT_ARGUMENTS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "dp": "data_parallel_size",
    "cp": "context_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
}


def training_run_plan(log: Any) -> RanPlan:
    """What a ``megatron_dcp.pretrain_gpt`` job ran, from its log
    (``tools.launching.training_runs.RunLog``): the CP sizes and micro-batch count of each
    iteration's plan (its ``[DCP]`` lines) and the layout megatron.training printed among its
    arguments."""
    arguments = dict(ARGUMENT.findall(log.output))
    missing = [name for name in LAYOUT_ARGUMENTS.values() if name not in arguments]
    assert not missing, f"the training log prints no {', '.join(missing)}"
    values = {
        key: None if arguments[name] == "None" else int(arguments[name])
        for key, name in LAYOUT_ARGUMENTS.items()
    }
    iterations = [log.dcp[i] for i in sorted(log.dcp)]
    sizes = tuple(tuple(figures.cp_sizes) for figures in iterations)
    counts = tuple(figures.microbatches for figures in iterations)
    return RanPlan(sizes, counts, Layout(**values))


def assert_covers(
    ran: Any,
    layout: Layout,
    *,
    mix_of: Collection[int] = (),
    cp_sizes: Optional[Collection[int]] = None,
    num_microbatches: Union[int, Tuple[int, ...], None] = None,
    min_microbatches: Optional[int] = None,
) -> None:
    """``ran`` ran on ``layout`` and covers the claimed CP sizes: exactly ``cp_sizes`` when
    given (a static-CP arm: ``{layout.cp}``), otherwise a plan mixing at least two CP sizes,
    and ``mix_of`` among the sizes run; and, when given, exactly ``num_microbatches``
    micro-batches or at least ``min_microbatches`` (one plan). The message names what is
    missing.

    ``ran``: a result with ``cp_sizes``, ``layout`` and, when ``num_microbatches`` is claimed,
    ``num_microbatches`` (:class:`RanPlan`, ``DCPStepResult``, ``TrainingRunResult``), or every
    rank's results: a plan's CP sizes are joined over the ranks (each may see only its own
    groups). ``cp_sizes`` holds the sizes of one plan, or a tuple of them per global batch."""
    ranks = list(ran) if isinstance(ran, (list, tuple)) else [ran]
    layouts = {rank.layout for rank in ranks}
    assert layouts == {layout}, (
        f"test ran layout {', '.join(sorted(map(str, layouts)))}; it covers {layout}"
    )
    plans = joined_plans([rank.cp_sizes for rank in ranks])
    if cp_sizes is not None:
        assert_exact_sizes(plans, frozenset(cp_sizes), layout)
    else:
        assert_mix(plans, frozenset(mix_of), layout)
    if num_microbatches is not None or min_microbatches is not None:
        assert_microbatches(ranks, num_microbatches, min_microbatches)


def assert_microbatches(
    ranks: Sequence[Any], exact: Union[int, Tuple[int, ...], None], minimum: Optional[int]
) -> None:
    counts = sorted({rank.num_microbatches for rank in ranks})
    ran = f"test ran {' and '.join(map(str, counts))} micro-batches"
    if exact is not None:
        assert counts == [exact], f"{ran}; it covers {exact}"
    if minimum is not None:
        assert min(counts) >= minimum, f"{ran}; it covers {minimum} or more"


def joined_plans(per_rank: Sequence[Sequence[Any]]) -> List[FrozenSet[int]]:
    """The CP sizes of each plan, joined over the ranks' views of it."""
    plans: List[FrozenSet[int]] = []
    for sizes in per_rank:
        nested = bool(sizes) and not isinstance(sizes[0], int)
        views = [frozenset(view) for view in sizes] if nested else [frozenset(sizes)]
        plans = [a | b for a, b in zip_longest(plans, views, fillvalue=frozenset())]
    return plans


def braces(sizes: Collection[int]) -> str:
    return "{" + ", ".join(map(str, sorted(sizes))) + "}"


def described(plans: Sequence[FrozenSet[int]]) -> str:
    if len(plans) == 1:
        return f"CP sizes {braces(plans[0])}"
    return f"CP sizes {', '.join(map(braces, plans))} in its {len(plans)} plans"


def assert_mix(plans: Sequence[FrozenSet[int]], including: FrozenSet[int], layout: Layout) -> None:
    claim = f"a mix of CP sizes {braces(including)}" if including else "a mix of CP sizes"
    if all(len(sizes) < 2 for sizes in plans):
        raise AssertionError(single_size_message(plans, claim, layout))
    missing = including.difference(*plans)
    assert not missing, f"test ran {described(plans)}; it covers {claim}: {braces(missing)} missing"


def single_size_message(plans: Sequence[FrozenSet[int]], claim: str, layout: Layout) -> str:
    """Why a run whose every plan has one CP size does not cover ``claim``."""
    if len(plans) == 1:
        ran, plural = f"CP sizes {braces(plans[0])} only", "a single-size plan"
    else:
        ran, plural = f"one CP size per plan ({', '.join(map(braces, plans))})", "single-size plans"
    static = all(sizes == {layout.cp} for sizes in plans)
    return f"test ran {ran}; it covers {claim}: the planner returned " + (
        "a static plan" if static else plural
    )


def assert_exact_sizes(
    plans: Sequence[FrozenSet[int]], expected: FrozenSet[int], layout: Layout
) -> None:
    sizes = frozenset().union(*plans)
    if sizes == expected:
        return
    if expected == {layout.cp}:
        claim = f"static CP {braces(expected)} only"
    elif len(expected) == 1:
        claim = f"CP size {braces(expected)} only"
    else:
        claim = f"exactly the CP sizes {braces(expected)}"
    missing, extra = expected - sizes, sizes - expected
    details = [f"{braces(missing)} missing"] if missing else []
    details += [f"{braces(extra)} not claimed"] if extra else []
    raise AssertionError(f"test ran {described(plans)}; it covers {claim}: {', '.join(details)}")
