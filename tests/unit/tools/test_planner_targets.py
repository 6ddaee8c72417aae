"""The link sweep's planner targets (``tools.link_sweep.planner_targets``) on synthetic runs:
met by a good sweep, and each one not met on its own flaw (a run slower than dev, SFT not 3 %
ahead over the fast links in the median of its repeats, a model error over 10 %, DCP far from
the lower bound)."""

from dataclasses import replace

import pytest

from megatron_dcp.tools.bench_train.stats import Interval
from megatron_dcp.tools.link_sweep.planner_targets import check_planner_targets
from megatron_dcp.tools.link_sweep.runs import Link, SweepRun


def run(workload: str, rate: str, tag: str = "1", over_dev=(1.05, 1.01, 1.09), error=0.05,
        distance=1.02) -> SweepRun:  # fmt: skip
    return SweepRun(
        name=f"{workload}_{rate}_{tag}", workload=workload, tag=tag, nproc=2,
        oversubscribed=False, link=Link(rate, None, None, 1), speedup={},
        dcp_over_dev=Interval(*over_dev), predicted={}, model_error=error, clear_agree=1,
        clear_total=1, distance={"dcp": distance},
    )  # fmt: skip


def good_sweep():
    runs = [run(w, r) for w in ("documents", "rl") for r in ("unshaped", "1gbit", "300mbit")]
    runs += [run("sft", r, tag) for r in ("unshaped", "1gbit") for tag in ("1", "r2", "r3")]
    return runs


def met(runs):
    return {t.name.split(":")[0].split(" (")[0]: t.met for t in check_planner_targets(runs)}


def test_a_good_sweep_meets_every_target():
    assert all(met(good_sweep()).values()), met(good_sweep())


@pytest.mark.parametrize(
    "index, change, target",
    [
        (0, {"dcp_over_dev": Interval(0.99, 0.95, 1.03)}, "never slower than dev"),
        (1, {"dcp_over_dev": Interval(1.02, 0.98, 1.00)}, "never slower than dev"),
        (0, {"model_error": 0.11}, "model error ≤ 10% in every run"),
        (2, {"distance": {"dcp": 1.11}}, "DCP's measured time over the lower bound ≤ 1.10 in "
         "every run"),
    ],
)
def test_each_target_fails_on_its_own_flaw(index, change, target):
    runs = good_sweep()
    runs[index] = replace(runs[index], **change)
    assert not met(runs)[target]


def test_sft_is_judged_by_the_median_of_its_repeats_at_each_fast_rate():
    runs = good_sweep()
    name = "SFT, unshaped and 1 Gbit/s"
    sft_1gbit = [i for i, r in enumerate(runs) if r.workload == "sft" and r.link.rate == "1gbit"]
    runs[sft_1gbit[0]] = replace(runs[sft_1gbit[0]], dcp_over_dev=Interval(1.01, 1.0, 1.02))
    assert met(runs)[name]  # one repeat below 1.03: the median of three still above
    runs[sft_1gbit[1]] = replace(runs[sft_1gbit[1]], dcp_over_dev=Interval(1.02, 1.0, 1.04))
    assert not met(runs)[name]
    assert not met([r for r in good_sweep() if r.link.rate != "1gbit"])[name]  # a rate missing
