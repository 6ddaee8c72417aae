"""``megatron-dcp check`` in bf16 and fp16, pure Python: the tolerance rule at every precision's
eps (its floor never makes a quantity undecidable), the two stages a low-precision check runs
(its flags, and on a GPU the float32 stage's reference attention), and the verdict of a
low-precision stage (a quantity under its resolution is left to float32, not passed and not
failed; one it decides must pass; DCP against static CP is shown there, decided in float32)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dcp.tools.check.layout_runs import Layout, LayoutResult
from megatron_dcp.tools.check.stages import fp32_flags, precision_of, stages_for
from megatron_dcp.tools.check.tolerance import (
    CEILING,
    ERROR_FACTOR,
    FLOAT32_EPS,
    FLOOR_ULPS,
    Difference,
    floor,
    tolerance,
)
from megatron_dcp.tools.check.verdict import failures, verdict_line

# torch.finfo(dtype).eps of each (the unit layer imports no torch).
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
SPEED = {"static_step_ms": 2.0, "dcp_step_ms": 1.0, "dcp_speedup": 2.0, "dcp_tokens_per_s": 9.0,
         "static_tokens_per_s": 4.5, "batches": 2.0, "oversubscribed": 0.0}  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(EPS))
@given(magnitude=st.floats(1e-30, 1e30), runs=st.sampled_from([1, 2]))
def test_the_floor_is_never_above_the_ceiling(dtype, magnitude, runs):
    """A quantity whose measured rounding vanished is always decidable, in every precision."""
    floored = Difference("w", magnitude, 0.0, 0.0, runs=runs, eps=EPS[dtype])
    assert floored.allowed <= CEILING / 2 * magnitude * (1 + 1e-12)
    assert floored.decidable


def test_the_float32_rule_is_unchanged_by_the_cap():
    assert floor(2.0) == FLOOR_ULPS * FLOAT32_EPS * 2.0
    assert tolerance(0.0, 2.0) == ERROR_FACTOR * FLOOR_ULPS * FLOAT32_EPS * 2.0


def test_low_precision_floors_are_capped_and_measured_rounding_still_counts():
    bf16 = EPS["bfloat16"]
    assert floor(1.0, bf16) < FLOOR_ULPS * bf16  # 4 bf16 ulps would be 3 % of the value
    assert tolerance(1e-2, 1.0, bf16) == ERROR_FACTOR * 1e-2  # measured rounding wins
    assert not Difference("w", 1.0, 2 * CEILING / ERROR_FACTOR, 0.0, runs=1, eps=bf16).decidable


def test_a_low_precision_check_has_a_float32_stage():
    flags = ["--num-layers", "2", "--bf16"]
    first, second = stages_for(flags, on_gpu=False)
    assert (first.precision, first.label, first.low_precision) == ("bf16", "bf16", True)
    assert (second.precision, second.label, second.flags) == ("fp32", "fp32", ("--num-layers", "2"))
    (only,) = stages_for(["--num-layers", "2"], on_gpu=False)
    assert only.precision == "fp32" and only.label == "" and not only.low_precision
    assert precision_of(["--fp16"]) == "fp16" and precision_of([]) == "fp32"


@pytest.mark.parametrize("impl", [[], ["--transformer-impl", "transformer_engine"],
                                  ["--transformer-impl=transformer_engine"]])  # fmt: skip
def test_on_a_gpu_the_float32_stage_runs_the_reference_attention(impl):
    flags = fp32_flags(["--bf16", *impl, "--hidden-size", "64"], on_gpu=True)
    assert flags == ("--hidden-size", "64", "--transformer-impl", "local")


def bf16_result(*reference):
    sizes = {"static": [[2]], "static_reordered": [[2]], "dcp": [[1, 2]]}
    result = LayoutResult(Layout(1, 2), cp_sizes=sizes, speed=SPEED, stage="bf16")
    result.low_precision = True
    result.tokens = {arm: [100] for arm in sizes}
    result.loss = [Difference("batch 0 loss", 500.0, 0.0, 1.0)]  # shown, never decided here
    result.gradients = [Difference("batch 0 rank0 w", 1.0, 1e-9, 1e-2)]  # 10^6 x: shown only
    result.reference = list(reference)
    return result


def reference(arm, noise, difference, name="w"):
    return Difference(f"batch 0 {arm} rank0 {name}", 1.0, noise, difference, runs=1,
                      eps=EPS["bfloat16"])  # fmt: skip


def test_a_bf16_stage_defers_what_it_cannot_resolve_and_decides_the_rest():
    deferred = reference("dcp", 0.5, 0.9, name="norm.bias")  # over the ceiling: left to fp32
    result = bf16_result(reference("static", 1e-3, 2e-3), reference("dcp", 1e-3, 4e-3), deferred)
    assert failures(result) == []
    assert result.undecided() == [deferred]
    line = verdict_line([result], [])
    assert line.startswith("megatron-dcp check: PASS: bf16: static CP and DCP equal the reference")
    assert "in the 2 of 3 quantities bf16 resolves, the other 1 decided in fp32" in line


def test_a_bf16_stage_fails_a_quantity_it_decides():
    result = bf16_result(reference("static", 1e-3, 2e-3), reference("dcp", 1e-3, 2e-2))
    (found,) = failures(result)
    assert found.startswith("bf16 cp2: batch 0 dcp rank0 w differs from the reference by 0.02")


def test_a_float32_stage_still_fails_what_it_cannot_decide():
    result = bf16_result(reference("dcp", 0.5, 0.0))
    result.stage, result.low_precision = "fp32", False
    found = failures(result)
    undecided = "fp32 cp2: cannot decide: batch 0 dcp rank0 w's tolerance"
    assert any(f.startswith(undecided) for f in found)
    assert any("differs from static CP" in f for f in found)  # decided in float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_gradient_that_is_not_a_number_fails_in_every_stage(bad):
    """An overflowed gradient (fp16 without a fitting loss scale) must fail, not be ranked below
    the finite ones or left undecided."""
    for stage in ("bf16", "fp32"):
        result = bf16_result(reference("static", 1e-3, 2e-3), reference("dcp", 1e-3, bad))
        result.stage, result.low_precision = stage, stage == "bf16"
        found = [f for f in failures(result) if "not a number" in f]
        assert found == [f"{stage} cp2: batch 0 dcp rank0 w is not a number: {bad} from the "
                         "reference (largest value 1.0)"]  # fmt: skip
