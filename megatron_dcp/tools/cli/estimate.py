"""``megatron-dcp estimate``: "should I use DCP on my data?", answered before any GPU time.

    megatron-dcp estimate --data-path PREFIX | --sft-data FILE --tokenizer-model DIR |
        --hf-dataset NAME --text-field F | --lengths FILE |
        --vlm-data FILE.jsonl --tokenizer-model DIR | --vlm-images-per-sample SPEC ...
        [--batches 8] [--json FILE] \\
        megatron's model flags (--num-layers --hidden-size --num-attention-heads --seq-length
        --vocab-size ...) | --model-preset bench-train \\
        [parallel flags: --nproc 8 --tensor-model-parallel-size 1 --context-parallel-size 4
         --global-batch-size 64 --max-seqlen-per-dp-cp-rank 8192] [--hardware-profile NAME |
         --dcp-cost-profile FILE | --cost-model cpu]

The first ``--batches`` global batches of the data (``tools.estimate.sources``) are planned by
static CP, DCP and Megatron dev's planner under the model's cost model, built by the functions
training builds it with (``integration.model_cost``); each arm's step time is its plan's
critical path plus the step rest (``tools.estimate.step_rest``). The model is never guessed
(``tools.estimate.command_line``): its shape flags are required, or ``--model-preset`` names
one; training flags that change no estimate are accepted and noted, any other flag is refused.
On vision-language data (``tools.estimate.vlm``) each batch's combined lengths are planned with
each sample's encoder patches, priced by the cost model's ``vision`` term (from the vision
flags).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, Tuple

from megatron_dcp.integration.model_cost import cost_model_of, hardware_of, model_shape_from_args
from megatron_dcp.scheduling import CostModel
from megatron_dcp.scheduling.cost_fit import load_profile
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.hardware import (
    DEFAULT_CPU_PROFILE,
    DEFAULT_GPU_PROFILE,
    HARDWARE_PROFILES,
    HardwareProfile,
)
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.tools.argument_types import positive_int, power_of_two, training_budget
from megatron_dcp.tools.bench_train.run_flags import DEFAULTS
from megatron_dcp.tools.cli.args import add_pass_through
from megatron_dcp.tools.compare import DomainSpec
from megatron_dcp.tools.estimate.answer import MIN_GAIN, Estimate, as_dict, batches_of
from megatron_dcp.tools.estimate.answer import format_estimate
from megatron_dcp.tools.estimate.arm_plans import plan_batches
from megatron_dcp.tools.estimate.command_line import (
    IGNORED_NOTE,
    MODEL_PRESETS,
    PRESET_FLAG,
    add_ignored_flags,
    ignored_given,
    refuse_unknown,
    resolve_model,
)
from megatron_dcp.tools.estimate.sources import (
    add_vlm_flags,
    batch_patches,
    image_summary,
    prepare_vlm_args,
    read_samples,
    vlm_mode,
    vlm_samples,
)
from megatron_dcp.tools.estimate.step_rest import StepRest, measured_step_rest
from megatron_dcp.tools.estimate.step_rest import predicted_step_rest
from megatron_dcp.tools.progress import Progress

PROG = "megatron-dcp estimate"
# The flags estimate's scheduling errors name.
FLAGS = {
    "budget": "--max-seqlen-per-dp-cp-rank",
    "min_cp_size": "--min-dynamic-context-parallel-size",
    "dp_size": "--nproc",
    "cp_size": "--context-parallel-size",
    "max_seqlen": "a smaller --seq-length",
}
PROGRESS_AFTER_S = 2.0  # planning that takes longer shows a progress line (on stderr)
MAKE_VOCAB_DIVISIBLE_BY = 128  # megatron's --make-vocab-size-divisible-by default


def add_data_flags(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data (exactly one source)")
    data.add_argument("--lengths", metavar="FILE", help="one sequence length a line")
    data.add_argument("--data-path", nargs="+", metavar="PREFIX", help="megatron indexed dataset")
    data.add_argument("--split", help="train,valid,test weights of --data-path / --sft-data")
    data.add_argument("--sft-data", metavar="FILE", help="conversations (JSONL or JSON)")
    data.add_argument("--varlen-distribution", metavar="SPEC", help="training's mock lengths")
    data.add_argument("--varlen-lengths-file", metavar="FILE", help="training's mock lengths")
    data.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset (or json)")
    data.add_argument("--text-field", metavar="F", help="with --hf-dataset: the text column")
    data.add_argument("--data-files", nargs="+", metavar="FILE", help="with --hf-dataset json")
    data.add_argument("--hf-split", default="train", help="with --hf-dataset (default train)")
    data.add_argument("--tokenizer-type", help="HuggingFaceTokenizer (for --sft-data)")
    data.add_argument("--tokenizer-model", metavar="DIR", help="a saved HuggingFace tokenizer")
    data.add_argument("--seed", type=int, default=DEFAULTS["--seed"], help="training's seed")


# Megatron's model flags estimate reads (type, help): the shape flags are required
# (command_line.REQUIRED_FLAGS) unless --model-preset gives them; the others default as megatron's.
MODEL_FLAGS = {
    "--num-layers": (positive_int, "transformer layers"),
    "--hidden-size": (positive_int, "hidden size"),
    "--num-attention-heads": (positive_int, "attention heads"),
    "--ffn-hidden-size": (positive_int, "MLP hidden size (megatron's: 4 × hidden)"),
    "--seq-length": (positive_int, "longest sample: longer ones are cut to it"),
    "--vocab-size": (positive_int, "vocabulary before padding (or --tokenizer-model's)"),
    "--make-vocab-size-divisible-by": (positive_int, "megatron's vocabulary padding (128)"),
    "--num-query-groups": (positive_int, "K/V groups, with --group-query-attention (1)"),
    "--kv-channels": (positive_int, "head size (default hidden / heads)"),
    "--num-experts": (positive_int, "MoE experts"),
    "--moe-router-topk": (positive_int, "experts per token (2)"),
    "--moe-ffn-hidden-size": (positive_int, "an expert's MLP hidden size"),
    "--mtp-num-layers": (positive_int, "multi-token-prediction depth"),
}
# megatron's defaults (--num-query-groups: with --group-query-attention).
MODEL_DEFAULTS = {
    "--make-vocab-size-divisible-by": MAKE_VOCAB_DIVISIBLE_BY,
    "--moe-router-topk": 2,
    "--num-query-groups": 1,
}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group(
        f"model (megatron's flags; the shape flags are required, or {PRESET_FLAG})"
    )
    model.add_argument(PRESET_FLAG, choices=sorted(MODEL_PRESETS),
                       help="a named model for the model flags not given: bench-train, the "
                       "4-layer GPT bench-train runs (its first output line says so)")  # fmt: skip
    for flag, (kind, text) in MODEL_FLAGS.items():
        model.add_argument(flag, type=kind, default=MODEL_DEFAULTS.get(flag), help=text)
    model.add_argument("--group-query-attention", action="store_true", help="grouped K/V heads")
    model.add_argument("--swiglu", action="store_true", help="gated MLP (three GEMMs)")


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    layout = p.add_argument_group("parallel layout")
    layout.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    layout.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="TP")
    layout.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, help="PP")
    layout.add_argument(
        "--context-parallel-size", type=power_of_two, help="static CP (default: DP 1)"
    )
    layout.add_argument("--global-batch-size", type=positive_int,
                        default=DEFAULTS["--global-batch-size"], help="sequences per batch (32)")
    layout.add_argument("--max-seqlen-per-dp-cp-rank", type=training_budget,
                        default=DEFAULTS["--max-seqlen-per-dp-cp-rank"],
                        help="tokens per rank and micro-batch (2048)")
    layout.add_argument("--min-dynamic-context-parallel-size", type=power_of_two, default=1,
                        help="DCP's smallest CP group (1)")  # fmt: skip


def add_cost_flags(p: argparse.ArgumentParser) -> None:
    cost = p.add_argument_group("cost model and output")
    cost.add_argument(
        "--hardware-profile", "--dcp-hardware-profile", choices=sorted(HARDWARE_PROFILES),
        help=f"default {DEFAULT_GPU_PROFILE} ({DEFAULT_CPU_PROFILE} with --cost-model cpu)",
    )  # fmt: skip
    cost.add_argument("--dcp-cost-profile", metavar="FILE", help="a calibrated cost profile")
    cost.add_argument("--cost-model", choices=("model", "cpu"), default="model",
                      help="cpu: the model on the CPU backend's profile, as simulate")  # fmt: skip
    rest = cost.add_mutually_exclusive_group()
    rest.add_argument("--step-rest-ms", type=float, help="the step rest, measured elsewhere")
    rest.add_argument("--step-rest-from", metavar="BENCH_JSON", help="a bench-train result")
    cost.add_argument("--batches", type=positive_int, default=8, help="global batches (8)")
    cost.add_argument("--min-gain", type=float, default=MIN_GAIN, help="verdict's bar (1.05)")
    cost.add_argument("--json", metavar="FILE", help="write everything as JSON")


def estimate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Predict static CP, DCP and Megatron dev's planner on your data.",
        epilog="Training flags that change no estimate (optimizer, logging, precision, ...) are "
        "accepted and listed in a note; any other flag is refused (docs/estimate.md).",
        allow_abbrev=False,
    )
    for add in (add_data_flags, add_vlm_flags, add_model_flags, add_layout_flags, add_cost_flags,
                add_ignored_flags):  # fmt: skip
        add(p)
    return p


def add_estimate(sub: argparse._SubParsersAction) -> None:
    """The ``estimate`` subcommand: the rest of the command line goes to :func:`estimate`."""
    add_pass_through(sub, "estimate", "should I use DCP on my data? (docs/estimate.md)", estimate)


def domain_of(args: argparse.Namespace) -> DomainSpec:
    """The DP×CP domain of ``--nproc`` ranks over TP × PP, static CP as given (default DP 1)."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.nproc % model_parallel:
        raise ValueError(
            f"--nproc={args.nproc}: not a multiple of TP × PP = {model_parallel}; give a "
            "multiple (the DP×CP ranks are nproc / (TP × PP))."
        )
    size = args.nproc // model_parallel
    cp = args.context_parallel_size or size
    if size % cp:
        raise ValueError(
            f"--context-parallel-size={cp}: must divide the {size} DP×CP ranks (--nproc "
            f"{args.nproc} / TP × PP); use a power of two that divides {size}."
        )
    spec = DomainSpec(size // cp, cp, args.max_seqlen_per_dp_cp_rank,
                      args.min_dynamic_context_parallel_size)  # fmt: skip
    spec.domain()
    return spec


def vocabulary(args: argparse.Namespace) -> int:
    """The vocabulary before megatron pads it: ``--vocab-size``, else the tokenizer's (one of
    the two is given or the preset's: ``command_line.resolve_model``)."""
    if args.vocab_size:
        return args.vocab_size
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(args.tokenizer_model))


def padded_vocabulary(vocab: int, divisible_by: int, tp_size: int) -> int:
    """megatron's ``vocab_size_with_padding``: up to a multiple of divisible_by × TP."""
    multiple = divisible_by * tp_size
    return -(-vocab // multiple) * multiple


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model's shape as training reads it from its arguments (``model_shape_from_args``),
    with the vocabulary ``--vocab-size`` padded as megatron pads it."""
    view = argparse.Namespace(**vars(args))
    view.padded_vocab_size = padded_vocabulary(
        args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    return model_shape_from_args(view)


def hardware_and_cost(
    args: argparse.Namespace, shape: ModelShape
) -> Tuple[HardwareProfile, CostModel, str]:
    """The hardware profile (for the step rest), the cost model to plan with and its label."""
    if args.cost_model == "cpu" and args.hardware_profile not in (None, DEFAULT_CPU_PROFILE):
        raise ValueError(
            f"--cost-model cpu with --hardware-profile={args.hardware_profile}: cpu is the "
            f"{DEFAULT_CPU_PROFILE} profile; give one of the two."
        )
    cpu = args.cost_model == "cpu"
    hardware = hardware_of(DEFAULT_CPU_PROFILE if cpu else args.hardware_profile or
                           DEFAULT_GPU_PROFILE)  # fmt: skip
    if args.dcp_cost_profile:
        cost = load_profile(args.dcp_cost_profile, flag="--dcp-cost-profile").cost
        return hardware, cost, f"profile {args.dcp_cost_profile} ({cost.name})"
    cost = cost_model_of(shape, hardware)
    return hardware, cost, cost.name


def step_rest(
    args: argparse.Namespace, shape: ModelShape, hardware: HardwareProfile, spec: DomainSpec
) -> StepRest:
    if args.step_rest_ms is not None:
        if args.step_rest_ms < 0:
            raise ValueError(f"--step-rest-ms={args.step_rest_ms}: must be ≥ 0 (milliseconds).")
        return StepRest(args.step_rest_ms / 1e3, "given, --step-rest-ms")
    if args.step_rest_from:
        return measured_step_rest(args.step_rest_from)
    ranks = spec.dp_size * spec.cp_size
    return predicted_step_rest(
        shape, hardware, ranks, args.pipeline_model_parallel_size, args.global_batch_size
    )


def progress_reporter(total: int) -> Callable[[int], None]:
    """Reports planned batches on stderr once planning has taken :data:`PROGRESS_AFTER_S`."""
    started, progress = time.monotonic(), Progress("estimate", total, "global batches",
                                                   stream=sys.stderr)  # fmt: skip

    def update(done: int) -> None:
        if time.monotonic() - started >= PROGRESS_AFTER_S:
            progress.update(done, "planning")

    return update


def build_estimate(args: argparse.Namespace) -> Estimate:
    """Read, plan and price the data's first batches (ValueErrors name the flags)."""
    spec = domain_of(args)
    vision = vlm_mode(args)
    if vision:
        prepare_vlm_args(args)
    args.vocab_size = vocabulary(args)
    shape = model_shape(args)
    hardware, cost, label = hardware_and_cost(args, shape)
    rest = step_rest(args, shape, hardware, spec)
    count = args.batches * args.global_batch_size
    samples = vlm_samples(args, count) if vision else read_samples(args, count)
    batches = batches_of(samples.lengths, args.global_batch_size)
    domain = spec.domain()
    if max(samples.lengths) > domain.max_tokens_per_sequence:
        raise domain.longest_too_long_error(samples.lengths)
    patches = batch_patches(samples.patches, args.global_batch_size)
    arms = plan_batches(batches, spec, cost, progress_reporter(len(batches)), patches)
    result = Estimate(samples.source, batches, spec, label, rest, arms, args.min_gain,
                      samples.notes, patches, cost.vision)  # fmt: skip
    if vision:
        used = samples.tiles[: len(batches) * args.global_batch_size]
        result.notes.insert(0, image_summary(used, sum(patches, []), cost.vision))
        if not cost.vision:
            result.notes.append("the cost model has no vision term: the patches are not priced")
    return result


def estimate(argv: Sequence[str]) -> int:
    """The whole command; returns the exit code (bad input: ValueError, exit 2 from main).
    Unknown flags and a model not given are refused before anything is read."""
    parser = estimate_parser()
    args, leftover = parser.parse_known_args(list(argv))
    refuse_unknown(leftover, parser)
    if args.min_gain < 1:
        raise ValueError(f"--min-gain={args.min_gain}: a speedup bar, ≥ 1 (e.g. 1.05).")
    preset = resolve_model(args, vlm_mode(args))
    if preset:
        print(preset, flush=True)
    try:
        result = build_estimate(args)
    except SchedulingError as error:
        raise ValueError(error.worded(FLAGS)) from None
    ignored = ignored_given(args)
    if ignored:
        result.notes.append(f"{IGNORED_NOTE}: {', '.join(ignored)}")
    print(format_estimate(result))
    if args.json:
        record = {"model_preset": preset, **as_dict(result)} if preset else as_dict(result)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"written to {args.json}")
    return 0
