"""Online refinement of the cost model in a real DCP training loop (megatron-core on CPU, gloo):
``DCPSchedule`` runs several steps of the tiny GPT, gathers the measured forward-backward times,
refines the cost model after each and plans the next batch with it. Every rank must then hold
bitwise-identical coefficients and identical plans (a rank planning differently would deadlock or
mix up samples), for DP×CP, TP (ranks of other DP×CP domains), PP (other stages) and VPP layouts;
every second of a step must be claimed by a micro-batch (the refinement's points are per position
and micro-batch) in megatron's schedules without pipelining, 1F1B and interleaved; and
``cost_adapt=False`` must leave the model's cost model alone and time no step."""

import random
from dataclasses import replace
from functools import partial
from typing import Optional, Sequence

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.training.dcp_schedule import DCPSchedule  # noqa: E402
from megatron_dcp.integration.training.forward_step import forward_step  # noqa: E402
from megatron_dcp.scheduling.cost_fit import WARM_UP_STEPS, coefficients  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    Sample,
    TinyGPTOptions,
    build_tiny_gpt,
    init_megatron,
    make_samples,
)
from megatron_dcp.tools.launching.training_runs import parse_log  # noqa: E402

OPTIONS = TinyGPTOptions(num_layers=2)
STEPS, BATCH, BUDGET = 4, 8, 64


def batches() -> list:
    """``STEPS`` global batches of varied lengths (those over 64 tokens need a CP group of 2 at budget 64)."""
    rng = random.Random(3)
    return [
        make_samples([rng.randint(4, 120) for _ in range(BATCH)], OPTIONS.vocab_size, seed=step)
        for step in range(STEPS)
    ]


def refining_run(
    rank: int,
    world_size: int,
    steps: Sequence[Sequence[Sample]],
    tp: int = 1,
    pp: int = 1,
    cp: int = 2,
    adapt: bool = True,
    vpp: Optional[int] = None,
) -> dict:
    """Train ``steps`` through ``DCPSchedule``; per step, the plan and the coefficients the
    batch after next is planned with; the log lines."""
    from megatron.core import parallel_state

    options = replace(OPTIONS, num_layers=2 * pp * vpp) if vpp else OPTIONS
    init_megatron(tp, pp, cp, vpp=vpp, seed=OPTIONS.seed)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, vpp, options=options)
    config = DCPConfig.for_model(
        chunks[0].config, BUDGET, vocab_size=OPTIONS.vocab_size, cost_adapt=adapt
    )
    lines: list = []
    schedule = DCPSchedule(config, lines.append)
    dp_rank = parallel_state.get_data_parallel_rank()
    share = BATCH // parallel_state.get_data_parallel_world_size()
    plans, thetas = [], []
    for samples in steps:
        local = samples[dp_rank * share : (dp_rank + 1) * share]
        schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(local) for _ in chunks] if vpp else iter(local),
            model=chunks if vpp else chunks[0],
            num_microbatches=share,
            forward_only=False,
        )
        plans.append(schedule.wrapper.plan)
        # The cost model given for the plans after the next one (the next may be made already).
        given = schedule.wrapper.pending_cost or schedule.wrapper.scheduler.cost_model
        thetas.append([x.hex() for x in coefficients(given)])
    refined = schedule.refinement
    schedule.wrapper.groups.destroy()
    times = schedule.times
    return dict(
        plans=plans,
        thetas=thetas,
        microbatch_times=times.microbatches if times and times.per_microbatch else None,
        timed=times is not None,
        points=None if refined is None else len(refined.points[-1]),
        prior=[x.hex() for x in coefficients(config.cost_model)],
        refined=None if refined is None else [x.hex() for x in coefficients(refined.cost)],
        updates=None if refined is None else refined.updates,
        lines=[line for line in lines if "[DCP]" in line],
    )


LAYOUTS = {
    "dp2cp2": dict(cp=2),
    "tp2cp2": dict(tp=2, cp=2),
    "pp2cp2": dict(pp=2, cp=2),
    "pp2vpp2cp2": dict(pp=2, cp=2, vpp=2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_refines_to_the_same_floats_and_plans_alike(layout):
    results = run_distributed(partial(refining_run, **LAYOUTS[layout]), 4, batches(), timeout_s=300)
    first = results[0]
    for rank, result in enumerate(results[1:], start=1):
        assert result["thetas"] == first["thetas"], f"rank {rank} refined to other floats"
        assert result["plans"] == first["plans"], f"rank {rank} planned differently"
    assert first["updates"] == STEPS and first["refined"] == first["thetas"][-1]
    warm_up = first["thetas"][:WARM_UP_STEPS]
    assert all(theta == first["prior"] for theta in warm_up), "a warm-up step refined the model"
    refined = first["thetas"][WARM_UP_STEPS:]
    assert refined[0] != first["prior"], "the first step after the warm-up did not refine"
    assert len({tuple(theta) for theta in refined}) == len(refined)  # refined after every step
    # Every second of the last step was claimed by a micro-batch, on every rank (schedules
    # without pipelining, 1F1B, interleaved): the refinement took one point per position and
    # micro-batch.
    microbatches = first["plans"][-1].num_microbatches
    per_position = first["microbatch_times"]
    assert per_position is not None and len(per_position) == first["plans"][-1].domain.size
    assert all(len(row) == microbatches and min(row) > 0 for row in per_position)
    assert first["points"] == len(per_position) * microbatches
    for result in results:
        assert result["microbatch_times"] == per_position  # gathered: the same floats
        figures = parse_log("\n".join(result["lines"])).dcp
        assert sorted(figures) == list(range(1, STEPS + 1))
        assert all(f.measured_step_ms > 0 and f.predicted_step_ms > 0 for f in figures.values())
        assert all("| cost x prior: a " in line for line in result["lines"])


def test_refinement_off_plans_with_the_models_cost_model_throughout():
    results = run_distributed(partial(refining_run, adapt=False), 4, batches(), timeout_s=300)
    for result in results:
        assert result["updates"] is None
        assert all(theta == result["prior"] for theta in result["thetas"])
        assert not any("cost x prior" in line for line in result["lines"])
        figures = parse_log("\n".join(result["lines"])).dcp
        assert len(figures) == STEPS
        # Nothing asked for the times: no step was timed, and the log line says so.
        assert not result["timed"]
        assert all(f.measured_step_ms is None and f.tokens_per_s is None for f in figures.values())
        assert all(line.endswith("| step not timed (--dcp-cost-adapt off)") for line in result["lines"])
