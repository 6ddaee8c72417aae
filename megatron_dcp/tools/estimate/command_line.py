"""What ``megatron-dcp estimate`` takes from a command line besides its own flags.

- Training flags it accepts and does not read (:data:`IGNORED_FLAGS`), so that a
  ``pretrain_gpt`` command line can be pasted whole: each group says why the estimate does not
  depend on it; those given are listed in one note (:func:`ignored_given`).
- Any other flag is refused before anything is read (:func:`refuse_unknown`), naming the closest
  flag estimate knows.
- The model is never guessed (:func:`resolve_model`): the shape flags training requires
  (:data:`REQUIRED_FLAGS`, a vocabulary, and on vision-language data the encoder's
  :data:`REQUIRED_VISION_FLAGS`) must be given, or ``--model-preset`` names a model
  (:data:`MODEL_PRESETS`) whose values fill the flags not given. ``--ffn-hidden-size`` not given
  is derived as megatron derives it.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from megatron_dcp.tools.bench_train.run_flags import DEFAULTS, VLM_DEFAULTS
from megatron_dcp.tools.estimate.sources import (
    CLASS_TOKEN_FLAG,
    VISION_FLAGS,
    VLM_DATA_FLAGS,
    attribute,
)


class IgnoredFlags(NamedTuple):
    """Training flags estimate accepts and does not read, by how many values each takes."""

    why: str
    switches: Tuple[str, ...] = ()  # no value
    valued: Tuple[str, ...] = ()  # one value
    lists: Tuple[str, ...] = ()  # one or more values


IGNORED_FLAGS: Tuple[IgnoredFlags, ...] = (
    # A step's plan and time do not depend on the optimizer's settings or the run's length: the
    # step rest prices one pass of Adam over the parameters whatever they are.
    IgnoredFlags(
        "optimizer, learning-rate schedule, initialisation and run length",
        valued=("--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples",
                "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction",
                "--lr-warmup-init", "--weight-decay", "--clip-grad", "--adam-beta1",
                "--adam-beta2", "--adam-eps", "--optimizer", "--init-method-std", "--train-iters",
                "--train-samples"),
    ),  # fmt: skip
    # The predicted step rest counts one unhidden gradient all-reduce and a whole Adam pass on
    # every rank: an upper bound with these (--step-rest-from takes a run's measured one); TP's
    # sequence parallelism moves the same bytes as TP without it.
    IgnoredFlags(
        "gradient communication, the distributed optimizer and sequence parallelism",
        switches=("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                  "--accumulate-allreduce-grads-in-fp32", "--sequence-parallel"),
        valued=("--distributed-backend", "--distributed-timeout-minutes"),
    ),  # fmt: skip
    # The hardware profile's rates stand for bf16 (or fp16) training.
    IgnoredFlags(
        "precision", switches=("--bf16", "--fp16", "--attention-softmax-in-fp32")
    ),
    # Nothing a step plans or runs.
    IgnoredFlags(
        "logging, checkpoints and evaluation",
        switches=("--log-throughput", "--log-timers-to-tensorboard", "--log-params-norm",
                  "--log-num-zeros-in-grad", "--log-memory-to-tensorboard",
                  "--log-validation-ppl-to-tensorboard", "--no-load-optim", "--no-load-rng",
                  "--no-save-optim", "--no-save-rng", "--async-save", "--use-checkpoint-args",
                  "--finetune"),
        valued=("--log-interval", "--save", "--load", "--save-interval", "--eval-interval",
                "--eval-iters", "--tensorboard-dir", "--tensorboard-log-interval",
                "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity",
                "--timing-log-level", "--exit-interval", "--exit-duration-in-mins",
                "--ckpt-format"),
    ),  # fmt: skip
    # A sample's length does not depend on them (loss masks, position resets, loader workers);
    # the vocabulary is --vocab-size or --tokenizer-model's, not the GPT-2 files'.
    IgnoredFlags(
        "data loading, loss masks and tokenizer files",
        switches=("--no-mmap-bin-files", "--reset-position-ids", "--reset-attention-mask",
                  "--eod-mask-loss", "--no-create-attention-mask-in-dataloader",
                  "--calculate-per-token-loss", "--sft-loss-on-prompt"),
        valued=("--num-workers", "--dataloader-type", "--data-cache-path", "--vocab-file",
                "--merge-file", "--varlen-prompt-fraction"),
    ),  # fmt: skip
    # The cost model prices a layer by its matmuls and its attention, which these do not change
    # (an untied output layer's matmul is priced either way).
    IgnoredFlags(
        "positions, norms, dropout, biases, fusions and attention kernels",
        switches=("--untie-embeddings-and-output-weights", "--disable-bias-linear",
                  "--qk-layernorm", "--apply-layernorm-1p", "--use-rope-scaling",
                  "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                  "--no-bias-dropout-fusion", "--no-rope-fusion",
                  "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion",
                  "--use-flash-attn", "--use-mcore-models", "--no-persist-layer-norm"),
        valued=("--max-position-embeddings", "--position-embedding-type", "--rotary-base",
                "--rotary-percent", "--normalization", "--norm-epsilon", "--hidden-dropout",
                "--attention-dropout", "--transformer-impl", "--attention-backend"),
    ),  # fmt: skip
    # Every arm recomputes alike; the cost model prices a step without recomputation.
    IgnoredFlags(
        "activation recomputation",
        switches=("--recompute-activations",),
        valued=("--recompute-granularity", "--recompute-method", "--recompute-num-layers"),
        lists=("--recompute-modules",),
    ),  # fmt: skip
    # estimate plans every arm itself (static CP, DCP, Megatron dev's planner), forms the
    # micro-batches as DCP does and prices them with the prior cost model, before any step
    # refines it; prefetching and routing move the same samples.
    IgnoredFlags(
        "which planner training runs, its micro-batches and DCP's runtime",
        switches=("--dynamic-context-parallel", "--hybrid-context-parallel"),
        valued=("--micro-batch-size", "--sequence-packing-scheduler", "--dcp-prefetch",
                "--dcp-routing", "--dcp-cost-adapt", "--dcp-time-steps"),
    ),  # fmt: skip
    # The cost model prices each token's top-k experts by their shape; balancing losses,
    # dispatchers and MoE kernels do not change it.
    IgnoredFlags(
        "MoE routing losses, dispatch and kernels",
        switches=("--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-pre-softmax",
                  "--moe-router-enable-expert-bias"),
        valued=("--moe-token-dispatcher-type", "--moe-router-score-function",
                "--moe-z-loss-coeff", "--moe-router-dtype"),
        lists=("--moe-aux-loss-coeff", "--moe-router-load-balancing-type"),
    ),  # fmt: skip
    # pretrain_vlm's projector MLP is not in the cost model, and images are read as RGB: neither
    # changes a planned length or a patch count.
    IgnoredFlags(
        "pretrain_vlm's projector and image channels",
        valued=("--vision-projection-ffn-hidden-size", "--num-channels"),
    ),
)
IGNORED_NOTE = "flags estimate does not read"
DEST_PREFIX = "ignored_"


def ignored_flags() -> List[str]:
    return [f for group in IGNORED_FLAGS for f in (*group.switches, *group.valued, *group.lists)]


def add_ignored_flags(p: argparse.ArgumentParser) -> None:
    """The ignored flags on ``p``, hidden from ``--help``, each taking its values."""
    for group in IGNORED_FLAGS:
        for flag in group.switches:
            p.add_argument(flag, dest=DEST_PREFIX + attribute(flag), action="store_true",
                           default=None, help=argparse.SUPPRESS)  # fmt: skip
        for flag in group.valued:
            p.add_argument(flag, dest=DEST_PREFIX + attribute(flag), help=argparse.SUPPRESS)
        for flag in group.lists:
            p.add_argument(flag, dest=DEST_PREFIX + attribute(flag), nargs="+",
                           help=argparse.SUPPRESS)  # fmt: skip


def ignored_given(args: argparse.Namespace) -> List[str]:
    """The ignored flags given, sorted."""
    return sorted(
        flag for flag in ignored_flags() if getattr(args, DEST_PREFIX + attribute(flag)) is not None
    )


# A misspelt flag is at least this close to the one meant (difflib's ratio).
CLOSE_RATIO = 0.85
VISION_PREFIXES = ("--vision", "--vlm", "--img", "--patch", "--max-num-tile")


def refuse_unknown(leftover: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """What ``parse_known_args`` left over is refused: the first flag, with the closest known
    flag (or the vision-language flags, for one that starts like them); else a stray value."""
    flags = [item.split("=", 1)[0] for item in leftover if item.startswith("-")]
    if not flags:
        if leftover:
            raise ValueError(
                f"{leftover[0]}: a value after no flag that takes one (a switch such as --swiglu "
                "takes none); remove it or give the flag it belongs to."
            )
        return
    flag = flags[0]
    known = [name for action in parser._actions for name in action.option_strings]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=CLOSE_RATIO)
    if close:
        hint = f"did you mean {close[0]}? (docs/estimate.md)"
    elif flag.startswith(VISION_PREFIXES):
        vision = [*VLM_DATA_FLAGS, *VISION_FLAGS, CLASS_TOKEN_FLAG]
        hint = f"its flags are {', '.join(vision)} (docs/estimate.md)"
    else:
        hint = (
            "remove it (--help lists the flags estimate reads, docs/estimate.md the training "
            "flags it accepts and ignores)"
        )
    raise ValueError(f"{flag}: not a flag of estimate; {hint}.")


# ----------------------------------------------------------------------------------------------
# The model

PRESET_FLAG = "--model-preset"
# The shape flags training requires (megatron has no default for them).
REQUIRED_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
# On vision-language data, the encoder's shape and its tiles.
REQUIRED_VISION_FLAGS = tuple(VLM_DEFAULTS)
PRESET_FLAGS = (*REQUIRED_FLAGS, "--ffn-hidden-size", "--vocab-size")
# Named models: a value for every model flag not given. bench-train: the model bench-train runs
# when no model flag is given (bench_train.run_flags.DEFAULTS, VLM_DEFAULTS).
MODEL_PRESETS: Dict[str, Dict[str, object]] = {
    "bench-train": {**{flag: DEFAULTS[flag] for flag in PRESET_FLAGS}, **VLM_DEFAULTS},
}


def resolve_model(args: argparse.Namespace, vision: bool) -> Optional[str]:
    """Fill the model flags not given from ``--model-preset``, else refuse the missing ones;
    derive ``--ffn-hidden-size`` as megatron does. Returns the line that names the preset (the
    output's first), or None without one."""
    line = None
    if args.model_preset is None:
        refuse_missing(args, vision)
    else:
        given = apply_preset(args, args.model_preset, vision)
        line = f"model: preset {args.model_preset}"
        line += f", given {' '.join(given)}" if given else ""
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = megatron_ffn_hidden_size(args.hidden_size, args.swiglu)
    return None if line is None else f"{line}: {describe_model(args, vision)}"


def apply_preset(args: argparse.Namespace, name: str, vision: bool) -> List[str]:
    """Set the preset's value of each model flag not given (the vocabulary only without a
    tokenizer, the encoder only on vision-language data); returns the flags given."""
    flags = [*PRESET_FLAGS, *(REQUIRED_VISION_FLAGS if vision else ())]
    given = [flag for flag in flags if getattr(args, attribute(flag)) is not None]
    for flag in flags:
        if flag not in given and not (flag == "--vocab-size" and args.tokenizer_model):
            setattr(args, attribute(flag), MODEL_PRESETS[name][flag])
    return given


def refuse_missing(args: argparse.Namespace, vision: bool) -> None:
    """The shape flags training requires, a vocabulary and, on vision-language data, the
    encoder's shape: a ValueError naming those not given."""
    required = [*REQUIRED_FLAGS, *(REQUIRED_VISION_FLAGS if vision else ())]
    missing = [flag for flag in required if getattr(args, attribute(flag)) is None]
    if args.vocab_size is None and not args.tokenizer_model:
        missing.append("--vocab-size (or --tokenizer-model DIR)")
    if missing:
        values = MODEL_PRESETS["bench-train"].items()
        preset = argparse.Namespace(**{attribute(flag): value for flag, value in values})
        raise ValueError(
            f"{', '.join(missing)}: not given; estimate does not guess the model: give them as "
            f"training gets them, or {PRESET_FLAG} bench-train for bench-train's model "
            f"({describe_model(preset, vision)})."
        )


def megatron_ffn_hidden_size(hidden: int, gated: bool) -> int:
    """megatron's ``--ffn-hidden-size`` when not given: 4 × hidden, or with ``--swiglu`` two
    thirds of it rounded down to a multiple of 64 (``validate_args``)."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if gated else 4 * hidden


def describe_model(args: argparse.Namespace, vision: bool) -> str:
    """``4 layers, hidden 256, 4 heads, FFN 1024, seq-length 4096, vocabulary 1024`` (and the
    encoder on vision-language data)."""
    vocab = getattr(args, "vocab_size", None) or "of --tokenizer-model"
    text = (
        f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
        f"FFN {args.ffn_hidden_size}, seq-length {args.seq_length}, vocabulary {vocab}"
    )
    if vision:
        text += (
            f"; ViT {args.vision_num_layers} layers, hidden {args.vision_hidden_size}, "
            f"{args.vision_num_attention_heads} heads, {args.img_h}×{args.img_w} tiles of "
            f"{args.patch_dim}-pixel patches"
        )
    return text
