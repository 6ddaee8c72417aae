"""``megatron-dcp simulate``: every chosen scheduler (and the megatron-core peer) on one
workload, as a table, JSON or a plot of the plans. The ``vlm`` workload's samples also have
vision-encoder patches: the schedulers plan with them and every figure prices them."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, List, Optional, Tuple

from megatron_dcp.integration.data.lengths import sample_lengths
from megatron_dcp.scheduling import SCHEDULERS
from megatron_dcp.scheduling.cost import COST_MODELS, CostModel
from megatron_dcp.scheduling.domain import least_budget
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.hardware import REFERENCE_GPU_PROFILE, hardware_profile
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.tools.argument_types import positive_int, power_of_two, training_budget
from megatron_dcp.tools.cli.args import add_cost_profile_arg, add_ranks_per_node_arg
from megatron_dcp.tools.compare import (
    DEV_PEER_ALIAS,
    PEER_ALIAS,
    Comparison,
    DomainSpec,
    chosen_costs,
    evaluate,
    format_comparison,
)
from megatron_dcp.tools.plot import require_matplotlib
from megatron_dcp.tools.workloads import (
    PATCHES_PER_TILE,
    WORKLOADS,
    Workload,
    parse_distribution,
    read_lengths,
    reference_workload,
    summarize,
)

# The budget hint of a batch that grows with the budget: at most this many re-draws.
MAX_BUDGET_ROUNDS = 32
# The vision encoder priced where the cost model has none (``vlm``): LLaVA's CLIP ViT-L/14 at
# 336 pixels (24 layers, width 1024, MLP 4096, 577 patches per tile).
VIT_L_336 = ModelShape(
    vision_layers=24,
    vision_hidden=1024,
    vision_ffn_hidden=4096,
    vision_patches_per_tile=PATCHES_PER_TILE,
)


def scheduler_names(requested: Optional[List[str]], no_peer: bool) -> List[str]:
    """--scheduler values, default every registered scheduler plus the peers."""
    names = requested or [*sorted(SCHEDULERS), DEV_PEER_ALIAS, PEER_ALIAS]
    return [name for name in names if not (no_peer and name == PEER_ALIAS)]


def domain_spec(args: argparse.Namespace, workload: Workload) -> DomainSpec:
    """The domain flags, each defaulting to the --workload's value."""
    return DomainSpec(
        args.dp_size or workload.dp_size,
        args.cp_size or workload.cp_size,
        args.max_seqlen_per_dp_cp_rank or workload.budget,
        args.min_cp_size,
        args.microbatch_group_size_per_vp_stage,
        args.ranks_per_node,
    )


def simulate_samples(
    args: argparse.Namespace, spec: DomainSpec, workload: Workload
) -> Tuple[List[int], Optional[List[int]]]:
    """(lengths, patches): a vision workload's own samples (combined lengths and encoder
    patches, from --seed) unless --lengths or --distribution replaces them; patches None for a
    text batch."""
    if workload.vision is None or args.lengths or args.distribution:
        return simulate_lengths(args, spec, workload), None
    if args.num_sequences:
        return workload.samples(args.seed, count=args.num_sequences)
    total = args.tokens_per_global_batch or 8 * spec.dp_size * spec.cp_size * spec.budget
    return workload.samples(args.seed, total_tokens=total)


def vision_priced(label: str, cost: CostModel) -> Tuple[str, CostModel]:
    """A cost model for a batch with patches: its own ``vision`` coefficient, or else the
    ViT-L/14-336 encoder's (:data:`VIT_L_336`) on its hardware profile (``cpu``: cpu-gloo; the
    other seconds-based models: the reference GPU's). ``attention`` (unitless L²/c) stays blind."""
    if cost.vision or label == "attention" or label.startswith("profile "):
        return label, cost
    profile = "cpu-gloo" if label == "cpu" else REFERENCE_GPU_PROFILE
    vision = CostModel.from_model_shape(VIT_L_336, hardware_profile(profile)).vision
    return f"{label}+ViT-L/14", replace(cost, vision=vision)


def simulate_lengths(args: argparse.Namespace, spec: DomainSpec, workload: Workload) -> List[int]:
    """From --lengths, or sampled from --distribution (default: the chosen workload's)."""
    if args.lengths:
        for flag, value in (("--num-sequences", args.num_sequences),
                            ("--tokens-per-global-batch", args.tokens_per_global_batch)):  # fmt: skip
            if value:
                raise ValueError(
                    f"{flag}={value}: the lengths file {args.lengths} is the whole global batch; "
                    f"leave {flag} out, or cut the file to the sequences you want."
                )
        return read_lengths(args.lengths)
    dist = parse_distribution(args.distribution or workload.distribution)
    if args.num_sequences:
        return sample_lengths(dist, args.seed, num_sequences=args.num_sequences)
    total = args.tokens_per_global_batch or 8 * spec.dp_size * spec.cp_size * spec.budget
    return sample_lengths(dist, args.seed, total_tokens=total)


def batch_grows_with_budget(args: argparse.Namespace) -> bool:
    """True when the lengths are drawn until 8 × N × budget tokens: a larger budget draws more."""
    return not (args.lengths or args.num_sequences or args.tokens_per_global_batch)


def check_lengths_fit(
    args: argparse.Namespace, spec: DomainSpec, workload: Workload, lengths: List[int]
) -> None:
    """Every length fits the whole domain; otherwise one error (instead of an n/a row per
    scheduler) asking for the budget that holds the longest. When the batch grows with the
    budget, the budget asked for is one whose own, larger batch fits too."""
    domain = spec.domain()
    if max(lengths, default=0) <= domain.max_tokens_per_sequence:
        return
    error = domain.longest_too_long_error(lengths)
    if not batch_grows_with_budget(args):
        raise error
    least, drawn = error.values["least"], max(lengths)
    for _ in range(MAX_BUDGET_ROUNDS):
        drawn = max(simulate_samples(args, replace(spec, budget=least), workload)[0])
        if least_budget(drawn, domain.size) <= least:
            break
        least = least_budget(drawn, domain.size)
    raise SchedulingError(
        error.template + " A larger budget draws a larger batch (8 × N × budget tokens, unless "
        "--tokens-per-global-batch or --num-sequences fixes it); at {least} its longest, "
        "{drawn} tokens, fits.",
        **{**error.values, "least": least, "drawn": drawn},
    )


def simulate_title(args: argparse.Namespace, workload: Workload) -> str:
    """Where the lengths came from."""
    if args.lengths:
        return f"lengths from {args.lengths}"
    if workload.vision is not None and not args.distribution:
        return f"workload {workload.name}: {workload.description} (seed {args.seed})"
    return f"distribution {args.distribution or workload.distribution} (seed {args.seed})"


def write_plot(comparison: Comparison, path: str) -> None:
    """One panel per scheduler that produced a plan."""
    from megatron_dcp.tools.plot import plot_panels

    panels = [result.panel for result in comparison.results if result.panel is not None]
    plot_panels(panels, path, f"{comparison.spec.describe()} · {summarize(comparison.lengths)}")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Every chosen scheduler on one workload; exit 2 when none could plan it."""
    if args.plot:
        require_matplotlib()  # before planning: say what to install, draw nothing
    workload = reference_workload(args.workload, WORKLOADS)
    spec = domain_spec(args, workload)
    spec.domain()  # validate the domain before sampling
    lengths, patches = simulate_samples(args, spec, workload)
    check_lengths_fit(args, spec, workload, lengths)
    names = scheduler_names(args.scheduler, args.no_peer)
    title = simulate_title(args, workload)
    cost = chosen_costs([args.cost_model], args.cost_profile)[0]
    if patches is not None:
        cost = vision_priced(*cost)
    panels = bool(args.plot)
    comparison = evaluate(title, lengths, spec, cost, names, panels, patches)
    print(
        json.dumps(comparison.as_dict(), indent=2) if args.json else format_comparison(comparison)
    )
    if args.plot:
        write_plot(comparison, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0 if any(result.report for result in comparison.results) else 2


# ----------------------------------------------------------------------------------------------
# Arguments


def add_domain_args(parser: argparse.ArgumentParser) -> None:
    """Domain flags (names as in Megatron where it has them)."""
    parser.add_argument("--dp-size", type=positive_int, metavar="N", help="data-parallel size")
    parser.add_argument("--cp-size", type=positive_int, metavar="N", help="context-parallel size")
    parser.add_argument(
        "--max-seqlen-per-dp-cp-rank",
        type=training_budget,
        metavar="TOKENS",
        help="per-rank token budget of a micro-batch (a multiple of 2, as training needs; "
        "default: the --workload's)",
    )
    parser.add_argument(
        "--min-cp-size", type=power_of_two, default=1, metavar="N", help="smallest CP group size"
    )
    parser.add_argument(
        "--microbatch-group-size-per-vp-stage",
        type=positive_int,
        metavar="K",
        help="with VPP: the micro-batch count must be a multiple of K",
    )
    add_ranks_per_node_arg(parser)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Where the lengths come from and how many."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--lengths", metavar="FILE", help="one sequence length per line")
    source.add_argument(
        "--distribution",
        metavar="SPEC",
        help="e.g. 'lognormal:median=1024,sigma=1.0,max=8192', 'uniform:min=1,max=32K', "
        "'mixture:0.99*lognormal:median=1024,sigma=1|0.01*uniform:min=32K,max=256K'",
    )
    count = parser.add_mutually_exclusive_group()
    count.add_argument(
        "--num-sequences", type=positive_int, metavar="N", help="sample this many sequences"
    )
    count.add_argument(
        "--tokens-per-global-batch",
        type=positive_int,
        metavar="TOKENS",
        help="sample until this many tokens (default 8 × N × budget)",
    )
    parser.add_argument(
        "--workload",
        default="lognormal",
        metavar="NAME",
        help="reference workload giving the defaults for layout and distribution "
        f"({', '.join(w.name for w in WORKLOADS)}; vlm: samples with images, whose "
        "encoder patches every figure prices)",
    )


def add_simulate(sub: Any) -> None:
    """The ``simulate`` subcommand."""
    choices = [*sorted(SCHEDULERS), DEV_PEER_ALIAS, PEER_ALIAS]
    p = sub.add_parser("simulate", help="compare schedulers on one workload")
    p.add_argument(
        "--scheduler",
        action="append",
        choices=choices,
        help=f"repeatable; default: all ({PEER_ALIAS} = megatron-core 0.19.2 BalancedCPScheduler, "
        f"{DEV_PEER_ALIAS} = Megatron dev's greedy scheduler)",
    )
    add_domain_args(p)
    add_workload_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the length sampler")
    p.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        default="model",
        help="model: a Llama-3-8B-like model on H100 (seconds); latency: the same with an "
        "expensive ring; cpu: the same on the CPU backend (a fixed cost per sequence, score "
        "spill); attention: L²/c",
    )
    add_cost_profile_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="draw every plan into one PNG")
    p.add_argument("--no-peer", action="store_true", help=f"skip the {PEER_ALIAS} peer")
    p.set_defaults(func=cmd_simulate)
