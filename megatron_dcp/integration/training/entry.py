"""What the DCP training entry points share (``pretrain_gpt``, ``pretrain_mamba``): megatron's
arguments with the DCP flags, the checks before the first step (run by :func:`start`, whose
refusals are one line, ``integration.training.startup_errors``), the variable-length datasets, and the run itself
on ``megatron.training.pretrain``.

An entry point enables the CPU backend (``patches.enable_cpu_training``) before it imports this
module: megatron.training must see the stand-ins when it is first imported.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from megatron.core.enums import ModelType
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import print_rank_0, print_rank_last

from megatron_dcp.integration.config import DCP_FLAG, DCPConfig, add_dcp_args
from megatron_dcp.integration.cpu.parallel import cpu_notice
from megatron_dcp.integration.cpu.spec_refusals import check_cpu_args
from megatron_dcp.integration.data.chat import chat_tokenizer, check_tokenizer_type
from megatron_dcp.integration.data.datasets import build_varlen_datasets, check_prompt_fraction
from megatron_dcp.integration.model_checks import check_layer_kinds, check_model_config
from megatron_dcp.integration.model_cost import describe_cost
from megatron_dcp.integration.patches import apply_patches
from megatron_dcp.integration.training.dcp_schedule import DCPSchedule, install_dcp_schedule
from megatron_dcp.integration.training.forward_step import forward_step
from megatron_dcp.integration.training.startup_errors import (
    EntryParser,
    held_stdout,
    short_usage,
    startup_checks,
)
from megatron_dcp.integration.vision_batches import VisionSpec


def on_cpu() -> bool:
    """The CPU backend runs (no CUDA device)."""
    return not torch.cuda.is_available()


# On CPU: gloo, the local implementation, and no fusions that need CUDA kernels (TE RoPE,
# APEX gradient accumulation, persistent layer norm). Explicit flags still win.
CPU_DEFAULTS = {
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "no_persist_layer_norm": True,
    "attention_dropout": 0.0,  # the reference attention has no dropout
}


AddFlags = Callable[[argparse.ArgumentParser], Any]


def extra_args(argv: Optional[List[str]] = None, add_flags: Optional[AddFlags] = None) -> AddFlags:
    """megatron's ``extra_args_provider``: the DCP flags (and an entry point's own,
    ``add_flags``), per-token loss on (DCP needs it), the CPU defaults when CUDA is absent, and a
    parser that reads ``argv`` (default: the command line) and answers a typo with the DCP flags'
    usage, not megatron's whole usage (a usage the caller set on the parser wins); on CPU, the
    flags megatron's own validation cannot reach there are refused first
    (``parse_time_checks``)."""
    add_all = add_dcp_args if add_flags is None else both(add_dcp_args, add_flags)

    def provide(parser: argparse.ArgumentParser) -> EntryParser:
        add_all(parser)
        parser.set_defaults(calculate_per_token_loss=True, **(CPU_DEFAULTS if on_cpu() else {}))
        check = parse_time_checks(on_cpu())
        if parser.usage:
            return EntryParser(parser, argv, check=check)
        return EntryParser(
            parser, argv, usage=lambda: short_usage(parser.prog, add_all), check=check
        )

    return provide


def parse_time_checks(cpu: bool) -> Callable[[argparse.Namespace], None]:
    """The refusals that need only the flags, before megatron validates them: the layer kinds
    DCP cannot switch (every backend, first: on CPU the spec's own refusal would send the user
    to a GPU where DCP refuses them too), then on CPU ``cpu.spec_refusals.check_cpu_args``."""

    def check(args: argparse.Namespace) -> None:
        if getattr(args, "dynamic_context_parallel", False):
            check_layer_kinds(args)
        if cpu:
            check_cpu_args(args)

    return check


def both(first: AddFlags, second: AddFlags) -> AddFlags:
    """A flag adder that runs ``first``, then ``second``."""

    def add(parser: argparse.ArgumentParser) -> None:
        first(parser)
        second(parser)

    return add


def parse_args(
    argv: Optional[List[str]] = None, add_flags: Optional[AddFlags] = None
) -> argparse.Namespace:
    """megatron's arguments plus the DCP flags (and ``add_flags``'); ``argv`` defaults to the
    command line."""
    return parse_and_validate_args(extra_args_provider=extra_args(argv, add_flags))


def start(
    argv: Optional[List[str]],
    check: Callable[[argparse.Namespace], DCPConfig],
    model_config_of: Callable[[argparse.Namespace], Any],
    add_flags: Optional[AddFlags] = None,
) -> Tuple[argparse.Namespace, DCPConfig, Any]:
    """Parse the arguments (megatron's, the DCP flags and the entry point's ``add_flags``) and
    run every start-up check: ``check`` (the DCP flags) and ``compat.check_model_config`` on the
    model config ``model_config_of`` builds (its ``transformer``: the language model's). A
    refusal is one line on rank 0, before megatron's argument dump (held back until the checks
    pass), and exit status 2 without a traceback (``integration.training.startup_errors``)."""
    with startup_checks(), held_stdout():
        args = parse_args(argv, add_flags)
        config = check(args)
        model_config = model_config_of(args)
        check_model_config(model_config.transformer)
    return args, config, model_config


def plan_cp_sizes(args: argparse.Namespace, config: DCPConfig) -> tuple:
    """The CP sizes a plan may give a sequence: the static size under ``dp_balanced``, else every
    group size of the DP×CP domain."""
    if config.scheduler == "dp_balanced":
        return (args.context_parallel_size,)
    domain_size = args.data_parallel_size * args.context_parallel_size
    return config.build_scheduler(domain_size).domain.group_sizes


def check_args(args: argparse.Namespace, entry: str = "pretrain_gpt") -> DCPConfig:
    """Every DCP setting checked before the first step (ValueErrors naming the flag)."""
    if not args.dynamic_context_parallel:
        raise ValueError(
            f"megatron_dcp.{entry} trains with {DCP_FLAG}: add it (with "
            "--sequence-packing-scheduler dp_balanced for the static-CP baseline)."
        )
    if not args.calculate_per_token_loss:
        raise ValueError(
            f"{DCP_FLAG} needs --calculate-per-token-loss (it is on by default here; something "
            "turned it off): sums of per-token losses divided by the global token count are the "
            "only loss that stays right when ranks run different CP groups."
        )
    check_prompt_fraction(
        getattr(args, "varlen_prompt_fraction", 0.0),
        getattr(args, "data_path", None),
        getattr(args, "sft_data", None),
    )
    if getattr(args, "sft_data", None):
        check_tokenizer_type(args.tokenizer_type)
    config = DCPConfig.from_args(args)
    check_domain(args, config)
    return config


def check_domain(args: argparse.Namespace, config: DCPConfig) -> None:
    """The DP×CP domain admits the configuration, and the longest possible sample fits it."""
    domain = config.build_scheduler(args.data_parallel_size * args.context_parallel_size).domain
    static = config.scheduler == "dp_balanced"
    capacity = (domain.cp_size if static else domain.size) * domain.budget
    if args.seq_length > capacity:
        raise ValueError(
            f"--seq-length={args.seq_length}: samples may be that long, but the DP×CP domain "
            f"holds at most {capacity} tokens per sequence with {config.scheduler} "
            f"(--max-seqlen-per-dp-cp-rank={config.max_seqlen_per_dp_cp_rank}, dp "
            f"{args.data_parallel_size} × cp {args.context_parallel_size}). Lower --seq-length "
            "or raise --max-seqlen-per-dp-cp-rank."
        )


def datasets_provider(train_val_test_num_samples: List[int], vp_stage: Optional[int] = None) -> Any:
    """megatron's dataset provider: variable-length samples, one sequence each. With VPP megatron
    asks once per model chunk; the DCP wrapper reads the samples from the first chunk's."""
    args = get_args()
    chat = chat_tokenizer(get_tokenizer(), args.tokenizer_type) if args.sft_data else None
    return build_varlen_datasets(
        seq_length=args.seq_length,
        vocab_size=args.padded_vocab_size or args.vocab_size,
        seed=args.seed,
        num_samples=train_val_test_num_samples,
        distribution=args.varlen_distribution,
        lengths_file=args.varlen_lengths_file,
        data_path=args.data_path,
        split=args.split,
        sft_data=args.sft_data,
        chat=chat,
        loss_on_prompt=args.sft_loss_on_prompt,
        skip_invalid=args.sft_skip_invalid,
        prompt_fraction=args.varlen_prompt_fraction,
    )


# Every rank builds its datasets: each rank feeds the DCP wrapper (tensor-parallel ranks too).
datasets_provider.is_distributed = True


def train(
    args: argparse.Namespace,
    config: DCPConfig,
    model_config: Any,
    datasets: Callable = datasets_provider,
    schedule_class: type = DCPSchedule,
    entry: Optional[EntryModel] = None,
) -> None:
    """megatron's ``pretrain`` of ``model_config`` under DCP, after :func:`start`. ``datasets``
    and ``schedule_class`` replace the dataset provider and the DCP schedule (the training
    benchmark runs every global batch once per planner); ``entry``: a model megatron builds
    through a model provider (``pretrain_vlm``), not from ``model_config``."""
    if on_cpu():
        print_rank_0(cpu_notice())
    print_rank_0(describe_cost(config.cost_model))
    apply_patches()
    vision = entry.vision if entry is not None else None
    install_dcp_schedule(
        config, log=print_rank_last, schedule_class=schedule_class, vision=vision
    )
    if entry is None:
        container = pretrain_cfg_container_from_args(args, model_config)
        pretrain(container, datasets, ModelType.encoder_or_decoder, forward_step)
        return
    with warnings.catch_warnings():  # megatron recommends a ModelConfig over a provider
        warnings.simplefilter("ignore", UserWarning)
        container = pretrain_cfg_container_from_args(args, None)
    pretrain(
        container,
        datasets,
        ModelType.encoder_or_decoder,
        entry.forward_step,
        model_provider=entry.model_provider,
    )


@dataclass(frozen=True)
class EntryModel:
    """A model megatron.training builds through ``model_provider`` (its signature:
    ``(pre_process, post_process, config=None, pg_collection=None, vp_stage=None)``), run by
    ``forward_step``; ``vision``: its image tiles (a vision-language model)."""

    model_provider: Callable[..., Any]
    forward_step: Callable[..., Any]
    vision: Optional[VisionSpec] = None
