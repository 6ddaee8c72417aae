"""Workload specs, sampling, lengths files and the reference workloads (pure Python, fast)."""

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.integration.data.lengths import (
    Constant,
    LogNormal,
    Mixture,
    Uniform,
    sample_lengths,
)
from megatron_dcp.tools.workloads import (
    REFERENCE_WORKLOADS,
    parse_distribution,
    read_lengths,
    reference_workload,
)


def draw(spec: str, count: int = 20000, seed: int = 0):
    return sample_lengths(parse_distribution(spec), seed, num_sequences=count)


def test_parse_kinds():
    assert isinstance(parse_distribution("lognormal:median=1024,sigma=1"), LogNormal)
    assert isinstance(parse_distribution("uniform:min=1,max=8"), Uniform)
    assert isinstance(parse_distribution("constant:value=7"), Constant)
    mixture = parse_distribution("mixture:3*constant:value=1|1*uniform:min=2,max=3")
    assert isinstance(mixture, Mixture) and mixture.weights == (3.0, 1.0)


def test_lognormal_median_and_mean():
    assert statistics.median(draw("lognormal:median=4096,sigma=0.8")) == pytest.approx(
        4096, rel=0.05
    )
    assert statistics.mean(draw("lognormal:mean=1024,sigma=0.5")) == pytest.approx(1024, rel=0.05)


def test_clipping_and_minimum_one():
    lengths = draw("lognormal:mean=1024,sigma=1.5,min=128,max=8192")
    assert min(lengths) == 128 and max(lengths) == 8192
    assert min(draw("lognormal:median=1,sigma=3")) >= 1
    assert min(draw("uniform:min=0,max=2", count=500)) >= 1
    assert draw("constant:value=0", count=3) == [1, 1, 1]


def test_uniform_is_inclusive_integers():
    lengths = draw("uniform:min=1,max=4", count=2000)
    assert set(lengths) == {1, 2, 3, 4}


def test_suffixes():
    dist = parse_distribution("uniform:min=32K,max=256k")
    assert (dist.low, dist.high) == (32768, 262144)
    assert parse_distribution("constant:value=1M").value == 1024 * 1024


def test_mixture_weights():
    lengths = draw("mixture:0.3*constant:value=10|0.7*uniform:min=100,max=200")
    share = sum(1 for x in lengths if x == 10) / len(lengths)
    assert share == pytest.approx(0.3, abs=0.02)


def test_sampling_is_deterministic_in_the_seed():
    spec = "lognormal:median=1024,sigma=1.0"
    assert draw(spec, 50, seed=3) == draw(spec, 50, seed=3)
    assert draw(spec, 50, seed=3) != draw(spec, 50, seed=4)


def test_total_tokens_stops_at_the_first_sequence_reaching_it():
    lengths = sample_lengths(parse_distribution("uniform:min=1,max=100"), 0, total_tokens=5000)
    assert sum(lengths) >= 5000 > sum(lengths[:-1])


def test_exactly_one_stopping_rule():
    dist = parse_distribution("constant:value=4")
    with pytest.raises(ValueError):
        sample_lengths(dist, 0)
    with pytest.raises(ValueError):
        sample_lengths(dist, 0, num_sequences=3, total_tokens=10)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "gauss:mean=3",
        "lognormal:sigma=1",
        "lognormal:mean=1,median=2",
        "lognormal:median=0",
        "lognormal:median=abc",
        "lognormal:median=100,max=5,min=10",
        "uniform:min=5",
        "uniform:min=9,max=3",
        "uniform:min=1,max=2,mean=3",
        "uniform:min=1,min=2,max=3",
        "uniform:min=-1,max=3",
        "constant:",
        "mixture:0.5constant:value=1",
        "mixture:0*constant:value=1",
        "mixture:x*constant:value=1",
    ],
)
def test_bad_specs_name_the_flag_the_value_and_the_fix(spec):
    with pytest.raises(ValueError) as error:
        parse_distribution(spec)
    message = str(error.value)
    assert "--distribution" in message and repr(spec) in message and "e.g." in message


def test_read_lengths(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# header\n12\n\n  7  # trailing comment\n0\n")
    assert read_lengths(str(path)) == [12, 7, 0]


@pytest.mark.parametrize("text,fragment", [("5\nabc\n", "line 2"), ("# only\n\n", "no lengths")])
def test_read_lengths_errors(tmp_path, text, fragment):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match="--lengths") as error:
        read_lengths(str(path))
    assert fragment in str(error.value)


def test_read_lengths_missing_file(tmp_path):
    with pytest.raises(ValueError, match="--lengths.*cannot read"):
        read_lengths(str(tmp_path / "missing.txt"))


def test_reference_workloads():
    layouts = [(w.dp_size, w.cp_size, w.budget) for w in REFERENCE_WORKLOADS]
    assert layouts == [(2, 4, 2048), (16, 4, 8192), (4, 16, 16384), (4, 4, 4096)]
    for workload in REFERENCE_WORKLOADS:
        parse_distribution(workload.distribution)
        assert workload.total_tokens == 8 * workload.dp_size * workload.cp_size * workload.budget
    lengths = reference_workload("lognormal").lengths(seed=0)
    assert sum(lengths) >= 8 * 8 * 2048 > sum(lengths[:-1])
    assert min(lengths) >= 128 and max(lengths) <= 8192


def test_long_sft_tail():
    lengths = draw(REFERENCE_WORKLOADS[2].distribution)
    tail = [x for x in lengths if x >= 32768]
    assert len(tail) / len(lengths) == pytest.approx(0.01, abs=0.003)
    assert max(tail) <= 262144


def test_reference_workload_lookup():
    assert reference_workload("2").name == "rl-rollouts"
    with pytest.raises(ValueError, match="--workload"):
        reference_workload("nope")


@settings(max_examples=50, deadline=None)
@given(
    median=st.integers(1, 10**6),
    sigma=st.floats(0, 3),
    low=st.integers(0, 1000),
    span=st.integers(0, 10**5),
)
def test_lognormal_lengths_respect_the_bounds(median, sigma, low, span):
    spec = f"lognormal:median={median},sigma={sigma!r},min={low},max={max(low, 1) + span}"
    lengths = draw(spec, count=50)
    assert all(max(low, 1) <= x <= max(low, 1) + span for x in lengths)
