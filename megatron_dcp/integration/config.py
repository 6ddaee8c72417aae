"""The one DCP configuration: its command-line flags, its validation, and the translation of
scheduling errors into the flags the user typed.

:class:`DCPConfig` is built from megatron's parsed arguments (:meth:`DCPConfig.from_args`, the
training entry point) or from keywords (:meth:`DCPConfig.for_model` and the constructor, the RL
adapter and tests). Either way the same ``__post_init__`` validates it, before the first step,
with ``ValueError``s that name the flag, the value and the fix.

The cost model the scheduler plans with is the trained model's (its shape on the backend's
hardware profile, ``integration.model_cost``) unless ``--dcp-cost-profile`` gives a measured one;
``--dcp-cost-adapt`` refines it from measured step times while training runs; only then, or with
``--dcp-time-steps on`` (what the measuring tools set), are training steps timed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from megatron_dcp.integration.data.datasets import add_data_args
from megatron_dcp.integration.model_cost import (
    cost_model_of,
    hardware_of,
    model_shape_from_args,
    model_shape_of,
)
from megatron_dcp.integration.node_layout import RANKS_PER_NODE_FLAG, ranks_per_node
from megatron_dcp.integration.packing_flags import (
    add_packing_args,
    check_pack_padding,
    pack_padding_from_args,
    padded_cost,
    planning_budget,
)
from megatron_dcp.runtime.pack_padding import NO_PADDING, PackPadding
from megatron_dcp.runtime.packing import padding_multiple
from megatron_dcp.runtime.routing import ROUTING_METHODS
from megatron_dcp.scheduling import SCHEDULERS, CostModel, Plan, Scheduler, build_scheduler
from megatron_dcp.scheduling.cost_fit import load_profile
from megatron_dcp.scheduling.domain import budget_multiple, is_power_of_two
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.hardware import HARDWARE_PROFILES, HardwareProfile
from megatron_dcp.scheduling.topology import node_layout

DCP_FLAG = "--dynamic-context-parallel"
MIN_CP_FLAG = "--min-dynamic-context-parallel-size"
SCHEDULER_FLAG = "--sequence-packing-scheduler"
BUDGET_FLAG = "--max-seqlen-per-dp-cp-rank"
VPP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
COST_PROFILE_FLAG = "--dcp-cost-profile"
HARDWARE_FLAG = "--dcp-hardware-profile"
LINK_BANDWIDTH_FLAG = "--dcp-link-bandwidth"
INTER_NODE_BANDWIDTH_FLAG = "--dcp-inter-node-link-bandwidth"
COST_ADAPT_FLAG = "--dcp-cost-adapt"
TIME_STEPS_FLAG = "--dcp-time-steps"
PREFETCH_FLAG = "--dcp-prefetch"
ROUTING_FLAG = "--dcp-routing"
DEFAULT_SCHEDULER = "default_dynamic_cp"
# Chosen by measurement (docs/scaling.md, "Routing"): on GPUs the all-to-all's point-to-point
# buffers (per connected peer and channel) outweigh the lane's extra bytes up to thousands of ranks.
# By backend: the all-to-all on gloo (measured faster, fewer bytes), the lane all-gather on NCCL
# (no point-to-point buffers per peer); docs/scaling.md 'Routing'.
AUTO_ROUTING = "auto"
DEFAULT_ROUTING = AUTO_ROUTING

# The training flags of the scheduling parameters that SchedulingErrors name.
FLAGS = {
    "budget": BUDGET_FLAG,
    "min_cp_size": MIN_CP_FLAG,
    "dp_size": "the data-parallel size",
    "cp_size": "--context-parallel-size",
    "vpp": VPP_FLAG,
    "scheduler": SCHEDULER_FLAG,
    "cost_model": f"the cost model ({COST_PROFILE_FLAG} or {HARDWARE_FLAG})",
    "hardware": HARDWARE_FLAG,
    "batch": "a larger --global-batch-size",
    "max_seqlen": "a smaller --seq-length",
}


def flag_error(error: SchedulingError) -> ValueError:
    """A scheduling error worded for the training user (flags in place of parameters)."""
    return ValueError(error.worded(FLAGS))


def plan_with(
    scheduler: Scheduler, seqlens: Sequence[int], patches: Optional[Sequence[int]] = None
) -> Plan:
    """``scheduler.schedule(seqlens, patches)`` with its errors worded for the training user."""
    try:
        return scheduler.schedule(seqlens, patches)
    except SchedulingError as error:
        raise flag_error(error) from None


def add_dcp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron ``extra_args_provider``: the DCP flags (upstream's names) and the data flags.
    Scheduler choices are the registry's at the time the parser is built."""
    group = parser.add_argument_group("dynamic context parallelism (megatron_dcp)")
    group.add_argument(
        DCP_FLAG,
        action="store_true",
        help="Plan every global batch: one CP group per sequence, balanced THD micro-batches.",
    )
    group.add_argument(
        MIN_CP_FLAG,
        type=int,
        default=1,
        metavar="S",
        help="Smallest CP group size DCP may use (power of 2).",
    )
    group.add_argument(
        SCHEDULER_FLAG,
        default=None,
        choices=sorted(SCHEDULERS),
        help=f"Scheduler of DCP (default {DEFAULT_SCHEDULER}); dp_balanced is the static-CP "
        "baseline.",
    )
    add_data_args(group)
    add_packing_args(group)
    group.add_argument(
        PREFETCH_FLAG,
        default="on",
        choices=("on", "off"),
        help="Read, plan and route the next global batch in a background thread while the "
        "current one trains (default on; the same plans and losses as off).",
    )
    group.add_argument(
        ROUTING_FLAG,
        default=DEFAULT_ROUTING,
        choices=(AUTO_ROUTING, *ROUTING_METHODS),
        help="How samples reach the ranks of their CP groups: one all-to-all over the DP×CP "
        "domain (fewest bytes, point-to-point connections to any rank) or one all-gather inside "
        "each CP lane, the DP group (the whole batch to every rank, no new connections); "
        "default auto: the all-to-all on gloo (the CPU backend), the lane all-gather on NCCL; "
        "docs/scaling.md 'Routing'.",
    )
    add_cost_args(group)
    return parser


def add_cost_args(group: Any) -> None:
    """The flags of the cost model the scheduler plans with."""
    group.add_argument(
        COST_PROFILE_FLAG,
        default=None,
        metavar="PATH",
        help="Plan with the cost profile written by `megatron-dcp calibrate --output PATH` "
        "(default: the trained model's shape on the hardware profile).",
    )
    group.add_argument(
        HARDWARE_FLAG,
        default=None,
        choices=sorted(HARDWARE_PROFILES),
        help="Hardware profile of the default cost model (default: cpu-gloo on the CPU "
        "backend, h100-eager otherwise: an H100 with the fixed costs measured in eager "
        "execution).",
    )
    group.add_argument(
        LINK_BANDWIDTH_FLAG,
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="Bytes/s one rank sends its ring neighbour inside a node, measured: overrides the "
        "hardware profile's link bandwidth (the cost model's K/V exchange term; a profile "
        "without a second tier uses it across nodes too).",
    )
    group.add_argument(
        INTER_NODE_BANDWIDTH_FLAG,
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="The same across nodes: overrides the hardware profile's inter-node link "
        "bandwidth (what CP groups that span nodes pay, with --dcp-ranks-per-node).",
    )
    group.add_argument(
        RANKS_PER_NODE_FLAG,
        type=int,
        default=None,
        metavar="R",
        help="Ranks (GPUs) per node: CP groups that span nodes are priced at the hardware "
        "profile's inter-node tier (default: torchrun's LOCAL_WORLD_SIZE or SLURM's "
        "SLURM_NTASKS_PER_NODE; none: one node).",
    )
    group.add_argument(
        COST_ADAPT_FLAG,
        default="on",
        choices=("on", "off"),
        help="Refine the cost model after every training step from the measured "
        "forward-backward times of the DP×CP ranks (default on).",
    )
    group.add_argument(
        TIME_STEPS_FLAG,
        default="off",
        choices=("on", "off"),
        help="Time every training step's forward and backward steps (the measured figures of "
        "the [DCP] log line) also with --dcp-cost-adapt off: one device synchronisation and "
        "one small all-gather per step (default off; the refinement times them anyway).",
    )


@dataclass(frozen=True)
class DCPConfig:
    """Everything DCP needs besides the model and the process groups, validated once.

    ``cp_size`` is the static CP size (megatron's ``--context-parallel-size``): the domain of N
    positions is ``N // cp_size`` DP replicas × ``cp_size``; ``tp_size`` and
    ``sequence_parallel`` set the padding; ``microbatch_group_size_per_vp_stage`` is set under
    interleaved VPP only (the plan's micro-batch count is its multiple).
    """

    max_seqlen_per_dp_cp_rank: int
    scheduler: str = DEFAULT_SCHEDULER
    min_cp_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None
    cost_model: Optional[CostModel] = None
    cost_adapt: bool = True
    # Time the training steps also with cost_adapt off (the measured [DCP] figures; the
    # measuring tools set it): one synchronisation and one small all-gather per step.
    time_steps: bool = False
    # Ranks per node (None: one node) and the hardware profile whose two link tiers price the
    # CP groups that cross a node boundary (None: by backend).
    ranks_per_node: Optional[int] = None
    hardware: Optional[str] = None
    # Measured bytes/s of the two link tiers (``--dcp-link-bandwidth``,
    # ``--dcp-inter-node-link-bandwidth``), overriding the hardware profile's (None: keep them).
    link_bandwidth: Optional[float] = None
    inter_node_link_bandwidth: Optional[float] = None
    # Prepare the next global batch in the background (``integration.prefetch``).
    prefetch: bool = False
    # How samples reach their CP groups' ranks (``runtime.routing``: ROUTING_METHODS).
    routing: str = DEFAULT_ROUTING
    # Padding of each rank's whole pack (Megatron dev's packing flags, ``packing_flags``).
    pack_padding: PackPadding = NO_PADDING

    def __post_init__(self) -> None:
        check_budget(self.max_seqlen_per_dp_cp_rank, self.tp_size, self.sequence_parallel)
        check_scheduler(self.scheduler)
        check_cost(self.cost_model, self.cost_adapt)
        if not isinstance(self.time_steps, bool):
            raise ValueError(
                f"{TIME_STEPS_FLAG}={self.time_steps!r}: must be on or off "
                "(DCPConfig.time_steps: bool)."
            )
        check_link_bandwidths(self.link_bandwidth, self.inter_node_link_bandwidth)
        check_pack_padding(
            self.pack_padding, self.max_seqlen_per_dp_cp_rank, self.tp_size, self.sequence_parallel
        )
        if not isinstance(self.prefetch, bool):
            raise ValueError(
                f"{PREFETCH_FLAG}={self.prefetch!r}: must be on or off (DCPConfig.prefetch: bool)."
            )
        if self.routing not in (AUTO_ROUTING, *ROUTING_METHODS):
            raise ValueError(
                f"{ROUTING_FLAG}={self.routing!r}: must be one of "
                f"{', '.join((AUTO_ROUTING, *ROUTING_METHODS))} "
                "(DCPConfig.routing)."
            )
        ranks_per_node(self.ranks_per_node)
        if not is_power_of_two(self.min_cp_size):
            raise ValueError(
                f"{MIN_CP_FLAG}={self.min_cp_size!r}: must be a power of two (1, 2, 4, ...) no "
                "larger than data-parallel size × context-parallel size."
            )
        if self.cp_size < 1:
            raise ValueError(f"--context-parallel-size={self.cp_size}: must be >= 1.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DCPConfig":
        """The configuration of a megatron.training run (its parsed, validated arguments)."""
        if args.micro_batch_size != 1:
            raise ValueError(
                f"--micro-batch-size={args.micro_batch_size}: {DCP_FLAG} forms the micro-batches "
                "itself; use --micro-batch-size 1 (--global-batch-size counts sequences)."
            )
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        return cls(
            max_seqlen_per_dp_cp_rank=args.max_seqlen_per_dp_cp_rank,
            scheduler=args.sequence_packing_scheduler or DEFAULT_SCHEDULER,
            min_cp_size=args.min_dynamic_context_parallel_size,
            cp_size=args.context_parallel_size,
            tp_size=args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel,
            microbatch_group_size_per_vp_stage=(
                getattr(args, "microbatch_group_size_per_vp_stage", None) if vpp else None
            ),
            cost_model=cost_model_from_args(args),
            cost_adapt=getattr(args, "dcp_cost_adapt", "on") == "on",
            time_steps=getattr(args, "dcp_time_steps", "off") == "on",
            ranks_per_node=ranks_per_node(getattr(args, "dcp_ranks_per_node", None)),
            hardware=getattr(args, "dcp_hardware_profile", None),
            link_bandwidth=getattr(args, "dcp_link_bandwidth", None),
            inter_node_link_bandwidth=getattr(args, "dcp_inter_node_link_bandwidth", None),
            prefetch=getattr(args, "dcp_prefetch", "on") == "on",
            routing=getattr(args, "dcp_routing", DEFAULT_ROUTING),
            pack_padding=pack_padding_from_args(args),
        )

    @classmethod
    def for_model(
        cls,
        config: Any,
        max_seqlen_per_dp_cp_rank: int,
        vocab_size: Optional[int] = None,
        hardware: Optional[str] = None,
        **overrides: Any,
    ) -> "DCPConfig":
        """The configuration for a megatron model with TransformerConfig ``config`` (static CP,
        TP, sequence parallelism and the VPP micro-batch group size are read from it). Unless
        ``cost_model`` is given, the cost model is the model's shape (with a ``vocab_size``
        output head) on the ``hardware`` profile (default: by backend) with the link bandwidths
        of the overrides ``link_bandwidth`` and ``inter_node_link_bandwidth``."""
        values = dict(
            max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
            cp_size=config.context_parallel_size,
            tp_size=config.tensor_model_parallel_size,
            sequence_parallel=config.sequence_parallel,
            microbatch_group_size_per_vp_stage=vpp_group_size(config),
        )
        if overrides.get("cost_model") is None:
            profile = link_profile(
                hardware,
                overrides.get("link_bandwidth"),
                overrides.get("inter_node_link_bandwidth"),
            )
            overrides["cost_model"] = cost_model_of(model_shape_of(config, vocab_size), profile)
        return cls(**{**values, **overrides})

    def with_model(self, config: Any) -> "DCPConfig":
        """This configuration checked against the model it runs: the parallel sizes must agree
        (the model's VPP micro-batch group size is taken when only the model knows it)."""
        model = DCPConfig.for_model(
            config, self.max_seqlen_per_dp_cp_rank, cost_model=self.cost_model
        )
        for name in ("cp_size", "tp_size", "sequence_parallel"):
            if getattr(self, name) != getattr(model, name):
                raise ValueError(
                    f"DCPConfig.{name}={getattr(self, name)!r} but the model has "
                    f"{getattr(model, name)!r}: build the DCPConfig with DCPConfig.for_model."
                )
        return replace(
            self, microbatch_group_size_per_vp_stage=model.vpp_group, cost_model=model.cost_model
        )

    @property
    def vpp_group(self) -> Optional[int]:
        return self.microbatch_group_size_per_vp_stage

    def hardware_profile(self) -> HardwareProfile:
        """The hardware profile this run prices its links with: ``hardware`` (default: by
        backend) with the measured link bandwidths."""
        return link_profile(self.hardware, self.link_bandwidth, self.inter_node_link_bandwidth)

    def pad_multiple(self, group_size: int) -> int:
        """Every sequence of a CP group of ``group_size`` is padded to a multiple of this."""
        return padding_multiple(group_size, self.tp_size, self.sequence_parallel)

    def build_scheduler(
        self, domain_size: int, domain_ranks: Optional[Sequence[int]] = None
    ) -> Scheduler:
        """The scheduler over a DP×CP domain of ``domain_size`` positions (global ranks
        ``domain_ranks``: then its cost model knows the node layout); errors name flags."""
        if domain_size < 1 or domain_size % self.cp_size:
            raise ValueError(
                f"domain_size={domain_size}: must be a positive multiple of the static "
                f"--context-parallel-size={self.cp_size} (the DP×CP ranks)."
            )
        try:
            scheduler = build_scheduler(
                self.scheduler,
                dp_size=domain_size // self.cp_size,
                cp_size=self.cp_size,
                max_seqlen_per_dp_cp_rank=planning_budget(
                    self.pack_padding,
                    self.max_seqlen_per_dp_cp_rank,
                    self.tp_size,
                    self.sequence_parallel,
                ),
                min_cp_size=self.min_cp_size,
                microbatch_group_size_per_vp_stage=self.vpp_group,
                cost_model=self.cost_model,
                max_samples_per_group=self.pack_padding.sample_cap,
            )
            scheduler.cost_model = padded_cost(scheduler.cost_model, self.pack_padding)
            if domain_ranks is not None:
                layout = node_layout(
                    scheduler.domain, domain_ranks, self.ranks_per_node, self.hardware_profile()
                )
                scheduler.cost_model = scheduler.cost_model.with_nodes(layout)
            return scheduler
        except SchedulingError as error:
            raise flag_error(error) from None


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model of a training run: the ``--dcp-cost-profile`` file when given, else the
    trained model's shape on the ``--dcp-hardware-profile`` (default: by backend) with the
    link-bandwidth flags' measured rates."""
    path = getattr(args, "dcp_cost_profile", None)
    links = {
        LINK_BANDWIDTH_FLAG: getattr(args, "dcp_link_bandwidth", None),
        INTER_NODE_BANDWIDTH_FLAG: getattr(args, "dcp_inter_node_link_bandwidth", None),
    }
    given = [f"{flag}={value!r}" for flag, value in links.items() if value is not None]
    if path and given:
        raise ValueError(
            f"{COST_PROFILE_FLAG}={path} with {' and '.join(given)}: a cost profile holds "
            "measured coefficients (its comm term included), the bandwidth flags change the "
            "hardware profile's; give one or the other (calibrate under the link you train on)."
        )
    if path:
        return load_profile(path, flag=COST_PROFILE_FLAG).cost
    profile = link_profile(getattr(args, "dcp_hardware_profile", None), *links.values())
    return cost_model_of(model_shape_from_args(args), profile)


def link_profile(
    hardware: Optional[str], link_bandwidth: Optional[float], inter_node: Optional[float]
) -> HardwareProfile:
    """The hardware profile called ``hardware`` (default: by backend) with the measured link
    bandwidths (None: the profile's); errors name the flags."""
    check_link_bandwidths(link_bandwidth, inter_node)
    try:
        profile = hardware_of(hardware).with_links(link_bandwidth, inter_node)
    except SchedulingError as error:
        raise flag_error(error) from None
    if profile.inter_node_factors()[0] < 1:
        raise ValueError(
            f"{INTER_NODE_BANDWIDTH_FLAG}={profile.inter_node_link_bandwidth!r} is faster than "
            f"the intra-node link ({LINK_BANDWIDTH_FLAG} or the {profile.name} profile: "
            f"{profile.link_bandwidth!r} bytes/s): a ring across nodes is never faster than "
            "inside one; give an inter-node bandwidth no larger than the intra-node one."
        )
    return profile


def check_link_bandwidths(link_bandwidth: Any, inter_node: Any) -> None:
    """Each given bandwidth is a finite number of bytes/s above 0."""
    given = ((LINK_BANDWIDTH_FLAG, link_bandwidth), (INTER_NODE_BANDWIDTH_FLAG, inter_node))
    for flag, value in given:
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"{flag}={value!r}: must be a positive number of bytes/s that one rank sends its "
                f"ring neighbour (e.g. {flag} 2.5e7 for a 200 Mbit/s link)."
            )


def check_cost(cost_model: Optional[CostModel], cost_adapt: bool) -> None:
    """The cost model is a CostModel (or None: the scheduler's default) and adapting is on/off."""
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(
            f"DCPConfig.cost_model={cost_model!r}: pass a megatron_dcp.scheduling.CostModel, or "
            f"a profile file with {COST_PROFILE_FLAG}."
        )
    if not isinstance(cost_adapt, bool):
        raise ValueError(
            f"{COST_ADAPT_FLAG}={cost_adapt!r}: must be on or off (DCPConfig.cost_adapt: bool)."
        )


def vpp_group_size(config: Any) -> Optional[int]:
    """The number the plan's micro-batch count must be a multiple of under interleaved VPP
    (megatron's ``microbatch_group_size_per_vp_stage``); None without VPP."""
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        return config.microbatch_group_size_per_vp_stage
    return None


def check_scheduler(name: str) -> None:
    """``name`` is registered (any subclass of ``Scheduler`` with a name may be chosen)."""
    if name not in SCHEDULERS:
        raise ValueError(
            f"{SCHEDULER_FLAG}={name!r} is not a registered scheduler: choose one of "
            f"{', '.join(sorted(SCHEDULERS))} (or leave it out for {DEFAULT_SCHEDULER})."
        )


def check_budget(budget: Optional[int], tp_size: int, sequence_parallel: bool) -> None:
    """``--max-seqlen-per-dp-cp-rank`` must be set, and a multiple of the per-rank padding unit
    (every sequence is padded to a multiple of 2 × CP size, × TP size under sequence
    parallelism), so that a sequence of exactly CP size × budget tokens needs no padding beyond
    its group's budget."""
    unit = budget_multiple(tp_size, sequence_parallel)
    if not isinstance(budget, int) or budget <= 0 or budget % unit:
        raise ValueError(
            f"{BUDGET_FLAG}={budget!r}: {DCP_FLAG} needs a positive per-rank token budget that "
            f"is a multiple of {unit} (sequences are padded to 2 × CP size"
            f"{' × TP size under --sequence-parallel' if unit > 2 else ''}); e.g. "
            f"{BUDGET_FLAG} 4096."
        )
