"""The mutants of ``scripts/mutation_check.py`` in the cost model, its planner bounds and the
tools (``megatron-dcp check``, bench-train, the profiler's attribution): one realistic one-line
mistake each, in the form of ``mutation_list.py``, which gathers them into ``MUTANTS``."""

from __future__ import annotations

from mutation_types import PATCHES, Mutant


CHECK = "megatron_dcp/tools/check/"
CHECK_VERDICT = ("tests/unit/tools/test_check_verdict.py",)
CHECK_COMMAND = "tests/integration/test_check_command.py"
CHECK_PASSES = f"{CHECK_COMMAND}::test_check_passes_here_with_one_verdict_line"
CHECK_DEFECT = f"{CHECK_COMMAND}::test_a_planted_defect_fails_the_bf16_check_through_its_numbers"
CHECK_STAGES = ("tests/unit/tools/test_check_stages.py",)
CHECK_BF16_PASSES = (
    f"{CHECK_COMMAND}::"
    "test_check_passes_in_bf16_deciding_what_bf16_resolves_and_the_rest_in_fp32"
)
CHECK_LABELS = f"{CHECK_DEFECT}[labels_shifted]"
CHECK_MUTANTS = (
    Mutant(
        "check-floor-uncapped",
        CHECK + "tolerance.py",
        "return min(FLOOR_ULPS * eps, FLOOR_CAP) * magnitude",
        "return FLOOR_ULPS * eps * magnitude",
        CHECK_STAGES,
        "the floor is 4 ulps at any precision: 8 times 4 bf16 ulps is a quarter of the value, over "
        "the ceiling, so no bf16 quantity can be decided",
    ),
    Mutant(
        "check-bf16-stage-fails-what-it-defers",
        CHECK + "verdict.py",
        "    if undecided and not result.low_precision:",
        "    if undecided:",
        CHECK_STAGES,
        "a quantity under bf16's resolution fails the bf16 stage instead of going to float32",
    ),
    Mutant(
        "check-bf16-stage-decides-nothing",
        CHECK + "layout_runs.py",
        "return difference.decidable or not self.low_precision",
        "return not self.low_precision",
        CHECK_STAGES,
        "the bf16 stage passes every quantity, even those it can resolve",
    ),
    Mutant(
        "check-fp32-stage-keeps-bf16",
        CHECK + "stages.py",
        "elif flag not in LOW_PRECISIONS and not",
        "elif not",
        CHECK_STAGES,
        "the float32 stage runs in bf16 again: what bf16 cannot resolve is never decided",
    ),
    Mutant(
        "check-reference-sums-in-bf16",
        CHECK + "reference_arm.py",
        "        add_gradients(model, sums, summing)",
        "        add_gradients(model, sums, dtype)",
        (CHECK_BF16_PASSES,),
        "the bf16 reference sums its samples' gradients in bf16, not in float32 as megatron's "
        "main_grad does: its measured rounding is no longer the run's",
    ),
    Mutant(
        "check-reference-dropped-from-verdict",
        CHECK + "verdict.py",
        "    found += reference_failures(result)",
        "    found += []",
        CHECK_VERDICT,
        "the reference arm's findings never reach the verdict: only DCP against static CP decides",
    ),
    Mutant(
        "check-reference-tolerance-two-sided",
        CHECK + "tolerance.py",
        "return self.runs * tolerance(self.noise, self.magnitude, self.eps)",
        "return 2 * tolerance(self.noise, self.magnitude, self.eps)",
        CHECK_VERDICT,
        "a run against the exact values allowed twice the tolerance, as if two runs were compared",
    ),
    Mutant(
        "check-ceiling-on-the-rounding",
        CHECK + "tolerance.py",
        "return self.allowed <= CEILING * self.magnitude or not self.magnitude",
        "return self.noise <= CEILING * self.magnitude or not self.magnitude",
        CHECK_VERDICT,
        "the ceiling compares the measured rounding, not the tolerance 8 times it",
    ),
    Mutant(
        "check-gradient-compared-with-itself",
        CHECK + "reference_arm.py",
        "largest_difference(grad, exact), eps))",
        "largest_difference(grad, grad), eps))",
        (CHECK_LABELS,),
        "each gradient compared with itself: the reference arm can never find a difference",
    ),
    Mutant(
        "check-reference-not-per-token",
        CHECK + "reference_arm.py",
        "exact = reference.tensors[name] / tokens",
        "exact = reference.tensors[name]",
        (CHECK_PASSES,),
        "the reference's gradients left as of the loss sum: megatron's are of the per-token mean",
    ),
    Mutant(
        "check-reference-rounding-not-per-token",
        CHECK + "reference_arm.py",
        "reference.errors[name] / tokens,",
        "reference.errors[name],",
        (f"{CHECK_DEFECT}[attention_entry_scaled]",),
        "the measured rounding left as of the loss sum while the values are per token: every "
        "tolerance a token count too wide",
    ),
    Mutant(
        "check-stage-layers-not-renumbered",
        CHECK + "global_names.py",
        'return f"decoder.layers.{layer.layer_number - 1}.{local[match.end():]}"',
        'return f"decoder.layers.{match.group(1)}.{local[match.end():]}"',
        ("tests/integration/test_check_reference.py",),
        "a pipeline stage's layers keep their local numbers: stage 2's layer 0 is named layer 0",
    ),
    Mutant(
        "patch-mla-rope-static-cp-size",
        PATCHES + "mla_attention.py",
        "    config.context_parallel_size = group.size()",
        "    config.context_parallel_size = module.config.context_parallel_size",
        ("tests/integration/test_dcp_mla.py::test_mla_equals_single_process_with_mixed_cp_sizes"
         "[dp4cp1-direct-query]",),
        "mla_rope's config copy keeps the static CP size: RoPE's table is not cut at CP size 1",
    ),
)

ESTIMATE_TESTS = "tests/unit/tools/test_estimate.py::"
SEQUENCE_TESTS = ("tests/unit/scheduling/test_sequence_cost.py",)
PROFILING_TESTS = ("tests/integration/test_profiling.py",)
COST_MUTANTS = (
    Mutant(
        "estimate-rest-left-out",
        "megatron_dcp/tools/estimate/answer.py",
        'pair = predicted_speedups(plans, ["static", "dcp"], 0, self.rest.seconds)',
        'pair = predicted_speedups(plans, ["static", "dcp"], 0, 0.0)',
        (ESTIMATE_TESTS + "test_a_long_step_rest_dilutes_the_gain_below_the_bar",),
        "estimate's speedup over static CP without the step rest: a gain no step shows",
    ),
    Mutant(
        "estimate-all-reduce-factor",
        "megatron_dcp/tools/estimate/step_rest.py",
        "all_reduce = 2 * (ranks - 1) / ranks * gradient_bytes / hardware.link_bandwidth",
        "all_reduce = 2 * ranks / ranks * gradient_bytes / hardware.link_bandwidth",
        (ESTIMATE_TESTS + "test_the_predicted_step_rest_is_the_all_reduce_and_the_optimizer",),
        "the ring all-reduce's (R − 1)/R factor dropped from the predicted step rest",
    ),
    Mutant(
        "estimate-host-per-step-only",
        "megatron_dcp/tools/estimate/step_rest.py",
        "host = per_step + per_sample * global_batch_size",
        "host = per_step",
        (ESTIMATE_TESTS + "test_the_predicted_step_rest_is_the_all_reduce_and_the_optimizer",),
        "the CPU host term without its share per sample of the global batch",
    ),
    Mutant(
        "cost-sequence-not-priced",
        "megatron_dcp/scheduling/cost.py",
        "cost = self.work(seqlen) / cp_size + self.overhead(seqlen, cp_size) + self.sequence",
        "cost = self.work(seqlen) / cp_size + self.overhead(seqlen, cp_size)",
        SEQUENCE_TESTS,
        "the fixed cost per sequence dropped from the model: the planner packs as if a pack of "
        "many short sequences cost what one sequence of their tokens does",
    ),
    Mutant(
        "cost-sequence-not-from-profile",
        "megatron_dcp/scheduling/cost.py",
        "sequence=s.ring_passes() * hw.sequence_pass_overhead,",
        "sequence=hw.sequence_pass_overhead,",
        SEQUENCE_TESTS,
        "the profile's cost per sequence and attention pass taken as the whole model's",
    ),
    Mutant(
        "fit-sequences-not-counted",
        "megatron_dcp/scheduling/cost_fit.py",
        "    count = float(len(lengths))",
        "    count = float(len(lengths) > 0)",
        SEQUENCE_TESTS,
        "the fit's sequence feature counts packs, not sequences: calibrate and the refinement "
        "cannot see the term",
    ),
    Mutant(
        "lower-bound-sequences-capped-by-tokens",
        "megatron_dcp/scheduling/lower_bound.py",
        "        fixed = count * cost.sequence + cost.ring_cost(size)",
        "        fixed = cost.ring_cost(size)",
        SEQUENCE_TESTS,
        "the idle bound caps a half's load by its tokens alone: tiny sequences' fixed costs "
        "exceed it and the bound rises above a real plan's critical path",
    ),
    Mutant(
        "bench-data-path-keeps-mock-lengths",
        "megatron_dcp/tools/bench_train/run_flags.py",
        'DATA_SOURCES = ("--sft-data", "--varlen-lengths-file", "--data-path")',
        'DATA_SOURCES = ("--sft-data", "--varlen-lengths-file")',
        ("tests/unit/tools/test_bench_train.py",),
        "bench-train keeps its mock lengths beside --data-path: training refuses two sources",
    ),
    Mutant(
        "flags-equals-form-unseen",
        "megatron_dcp/tools/argument_types.py",
        '    return {item.split("=", 1)[0] for item in argv if item.startswith("--")}',
        '    return {item for item in argv if item.startswith("--")}',
        ("tests/unit/tools/test_bench_train.py",),
        "--train-iters=5 is not seen as --train-iters: the refusal is bypassed and the user's "
        "value silently wins",
    ),
    Mutant(
        "profile-backward-to-engine",
        "megatron_dcp/tools/bench_train/profiling.py",
        '        return forward_region.get(node.sequence_nr, BACKWARD_ENGINE) + "/backward"',
        '        return BACKWARD_ENGINE + "/backward"',
        PROFILING_TESTS,
        "every backward op counted as the autograd engine's: no region gets its backward time",
    ),
    Mutant(
        "profile-outermost-range",
        "megatron_dcp/tools/bench_train/profiling.py",
        "        if event.name.startswith(PREFIX):\n            return event.name[len(PREFIX):]",
        "        if event.name.startswith(PREFIX) and event.cpu_parent is None:\n"
        "            return event.name[len(PREFIX):]",
        PROFILING_TESTS,
        "time goes to the outermost range: the model's regions vanish into the step's",
    ),
)
