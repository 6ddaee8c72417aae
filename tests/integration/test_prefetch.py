"""Planning off the critical path (``--dcp-prefetch``): through ``DCPSchedule`` (what
``megatron.training`` runs), prefetch on gives exactly the plans, samples and losses of prefetch
off, with the cost model refined after every step; evaluation calls in between, the last
iteration and a step that raises leave no background thread or collective behind."""

import contextlib
import random
import threading
from typing import Sequence

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.training.dcp_schedule import DCPSchedule  # noqa: E402
from megatron_dcp.integration.training.forward_step import forward_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    build_tiny_gpt,
    init_megatron,
    make_samples,
)

OPTIONS = TinyGPTOptions()
BUDGET, STEPS, BATCH = 64, 5, 8
TIMEOUT_S = 300


def global_batches(seed: int = 3) -> list:
    rng = random.Random(seed)
    lengths = [rng.randint(4, 120) for _ in range(STEPS * BATCH)]
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=seed)
    return [samples[i * BATCH : (i + 1) * BATCH] for i in range(STEPS)]


def local_stream(batches: Sequence[list], rank: int, size: int) -> list:
    """This DP rank's share of every global batch, in order (what megatron's loader yields)."""
    share = BATCH // size
    return [s for batch in batches for s in batch[rank * share : (rank + 1) * share]]


def prefetch_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "dcp-prefetch" and t.is_alive()]


class Run:
    """A tiny GPT (dp 2 × cp 2) trained through ``DCPSchedule``, as ``pretrain`` drives it."""

    def __init__(self, prefetch: bool, last_iteration=None) -> None:
        from megatron.core import parallel_state

        init_megatron(cp=2, seed=OPTIONS.seed)
        apply_patches()
        (self.model,) = build_tiny_gpt(cp=2, options=OPTIONS)
        config = DCPConfig.for_model(
            self.model.config, BUDGET, vocab_size=OPTIONS.vocab_size, prefetch=prefetch
        )
        self.schedule = DCPSchedule(config, lambda line: None, last_iteration=last_iteration)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def stream(self, batches: Sequence[list]):
        return iter(local_stream(batches, self.dp_rank, self.dp_size))

    def call(self, iterator, forward_only: bool = False, step=forward_step) -> list:
        """One call (a training step, or an evaluation with ``forward_only``); its losses."""
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            out = self.schedule(
                forward_step_func=step,
                data_iterator=iterator,
                model=self.model,
                num_microbatches=BATCH // self.dp_size,
                forward_only=forward_only,
            )
        return [o["lm loss"].tolist() for o in out]

    def pending(self) -> bool:
        """A background preparation running or waiting to be taken."""
        prefetcher = self.schedule.wrapper.prefetcher
        return bool(prefetch_threads()) or (prefetcher is not None and prefetcher.job is not None)

    def finish(self) -> None:
        self.schedule.wrapper.close()
        self.schedule.wrapper.groups.destroy()


def training_run(
    rank: int, world_size: int, batches: Sequence[list], prefetch: bool, evaluate: bool = False
) -> dict:
    """``STEPS`` training calls on one data iterator (as in ``pretrain``), optionally an
    evaluation call on another iterator after each; losses, plans, and the thread state."""
    step = {"n": 0}
    run = Run(prefetch, last_iteration=lambda: step["n"] == STEPS)
    planned_with = record_cost_models()
    measure_deterministically()
    train = run.stream(batches)
    losses, plans, eval_losses = [], [], []
    for n in range(1, STEPS + 1):
        step["n"] = n
        losses.append(run.call(train))
        plans.append(run.schedule.wrapper.plan)
        if evaluate:
            eval_losses.append(run.call(run.stream(batches[:1]), forward_only=True))
    alive_at_end = run.pending()
    run.finish()
    return dict(
        losses=losses,
        plans=plans,
        eval=eval_losses,
        alive_at_end=alive_at_end,
        planned_with=planned_with,
    )


def measure_deterministically() -> None:
    """Measured step times that depend only on the call count and the position, so that the
    refined cost models of two runs are the same floats (a forked worker)."""
    from megatron_dcp.integration.training import dcp_schedule as training

    calls = iter(range(1, 10**6))

    def synthetic(values, domain_group):  # per position: [unclaimed, per micro-batch]
        k, count = next(calls), len(values) - 1
        return [
            [0.0] + [1e-3 * (1 + 0.3 * position + 0.2 * (k % 3) + 0.1 * j) for j in range(count)]
            for position in range(4)
        ]

    training.busy_times = synthetic


def record_cost_models() -> list:
    """The coefficients of the cost model each plan is made with, in order (a forked worker:
    the parent's module is untouched)."""
    from megatron_dcp.integration import forward_backward as schedule
    from megatron_dcp.scheduling.cost_fit import coefficients

    recorded, original = [], schedule.plan_with

    def recording(scheduler, seqlens, patches=None):
        recorded.append([x.hex() for x in coefficients(scheduler.cost_model)])
        return original(scheduler, seqlens, patches)

    schedule.plan_with = recording
    return recorded


@pytest.mark.parametrize("evaluate", [False, True], ids=["train", "train+eval"])
def test_prefetch_gives_the_plans_and_losses_of_no_prefetch(evaluate):
    batches = global_batches()
    on = run_distributed(training_run, 4, batches, True, evaluate, timeout_s=TIMEOUT_S)
    off = run_distributed(training_run, 4, batches, False, evaluate, timeout_s=TIMEOUT_S)
    for rank, (with_prefetch, without) in enumerate(zip(on, off)):
        assert with_prefetch["plans"] == without["plans"], f"rank {rank}"
        assert with_prefetch["losses"] == without["losses"], f"rank {rank}"
        assert with_prefetch["eval"] == without["eval"], f"rank {rank}"
        # The refined cost model reaches the same plans (it starts changing at step 2).
        assert with_prefetch["planned_with"] == without["planned_with"], f"rank {rank}"
        assert len({tuple(c) for c in without["planned_with"]}) > 2
        assert not with_prefetch["alive_at_end"], "the last iteration started a prefetch"
    # The cost model refines after every step, so plans may change: they must change alike.
    assert len(on[0]["plans"]) == STEPS


def failing_step(rank: int, world_size: int, batches: Sequence[list]) -> dict:
    """The second training call raises inside the model step on every rank."""
    run = Run(prefetch=True)
    train = run.stream(batches)
    run.call(train)
    started = run.pending()

    def broken(iterator, model):
        raise RuntimeError("broken forward step")

    with pytest.raises(RuntimeError, match="broken forward step"):
        run.call(train, step=broken)
    left = dict(started=started, pending=run.pending())
    run.finish()
    return left


def test_a_step_that_raises_leaves_no_thread_behind():
    for result in run_distributed(failing_step, 4, global_batches(), timeout_s=TIMEOUT_S):
        assert result["started"], "the first step should have started a prefetch"
        assert not result["pending"]


def run_out_of_data(rank: int, world_size: int, batches: Sequence[list]) -> dict:
    """Without the last-iteration signal the wrapper prefetches past the data: the error stays
    in the background and ``close`` drops it."""
    run = Run(prefetch=True)
    train = run.stream(batches[:2])
    for _ in range(2):
        run.call(train)
    run.schedule.wrapper.close()
    left = dict(threads=len(prefetch_threads()))
    run.finish()
    return left


def test_prefetching_past_the_data_fails_nothing():
    for result in run_distributed(run_out_of_data, 4, global_batches(), timeout_s=TIMEOUT_S):
        assert result["threads"] == 0


def test_prefetch_flag_is_validated():
    with pytest.raises(ValueError, match="--dcp-prefetch"):
        DCPConfig(max_seqlen_per_dp_cp_rank=64, prefetch="on")
