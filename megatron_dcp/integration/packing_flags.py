"""Megatron dev's THD packing flags, with its names and meaning, on megatron_dcp's packs:

- ``--pad-packed-seq-alignment {max,N}``: pad each rank's pack to a multiple of N tokens, or to
  ``--max-seqlen-per-dp-cp-rank`` (``max``: one fixed shape);
- ``--thd-max-packed-sequences K``: at most K sequences per pack (a dummy tail sequence
  included), ``cu_seqlens`` padded to K + 1 entries;
- ``--thd-tail-padding-policy {append_dummy_seq,extend_last}``: the padding tail as one more
  sequence (default) or as padding of the last one.

:func:`pack_padding_from_args` turns them into the runtime's
:class:`~megatron_dcp.runtime.pack_padding.PackPadding`; :func:`check_pack_padding` refuses what
cannot run, naming the flag; :func:`padded_cost` is the cost model the planner plans a padded
pack with (the tail's tokens cost GEMM work like real ones).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Union

from megatron_dcp.runtime.pack_padding import ALIGN_TO_BUDGET, TAIL_POLICIES, PackPadding
from megatron_dcp.scheduling import CostModel
from megatron_dcp.scheduling.domain import budget_multiple

ALIGNMENT_FLAG = "--pad-packed-seq-alignment"
MAX_SEQUENCES_FLAG = "--thd-max-packed-sequences"
TAIL_POLICY_FLAG = "--thd-tail-padding-policy"


def alignment_value(text: str) -> Union[int, str]:
    """argparse type of ``--pad-packed-seq-alignment``: ``max`` or a positive integer."""
    if text == ALIGN_TO_BUDGET:
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use max or a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: use max or a positive integer")
    return value


def add_packing_args(group: Any) -> None:
    """The three flags (Megatron dev's names) on megatron's parser."""
    group.add_argument(
        ALIGNMENT_FLAG,
        type=alignment_value,
        default=None,
        metavar="{max,N}",
        help="Pad each rank's THD pack to a multiple of N tokens (even, dividing "
        "--max-seqlen-per-dp-cp-rank) or, with max, to --max-seqlen-per-dp-cp-rank "
        "(default: no pack padding).",
    )
    group.add_argument(
        MAX_SEQUENCES_FLAG,
        type=int,
        default=None,
        metavar="K",
        help="At most K sequences per THD pack, a dummy tail sequence included; cu_seqlens "
        "are padded to K + 1 entries (default: no cap).",
    )
    group.add_argument(
        TAIL_POLICY_FLAG,
        default=None,
        choices=TAIL_POLICIES,
        help="The pack's padding tail as one more sequence without real tokens "
        "(append_dummy_seq, the default) or as padding of the last sequence (extend_last).",
    )


def pack_padding_from_args(args: argparse.Namespace) -> PackPadding:
    """The pack padding of a megatron.training run (its parsed arguments), checked."""
    budget = args.max_seqlen_per_dp_cp_rank
    padding_args = dict(
        alignment=getattr(args, "pad_packed_seq_alignment", None),
        max_sequences=getattr(args, "thd_max_packed_sequences", None),
        tail_policy=getattr(args, "thd_tail_padding_policy", None) or TAIL_POLICIES[0],
    )
    check_flags(**padding_args)
    return PackPadding(budget=budget, **padding_args)


def check_flags(alignment: Any, max_sequences: Any, tail_policy: str) -> None:
    """What PackPadding itself would refuse, worded with the flags."""
    if max_sequences is not None:
        least = 2 if alignment is not None and tail_policy == TAIL_POLICIES[0] else 1
        if max_sequences < least:
            raise ValueError(
                f"{MAX_SEQUENCES_FLAG}={max_sequences}: must be >= {least}"
                + (
                    f" (with {ALIGNMENT_FLAG} and the append_dummy_seq tail, one slot holds "
                    "the dummy tail sequence)"
                    if least == 2
                    else ""
                )
                + "."
            )


def check_pack_padding(
    padding: PackPadding, budget: int, tp_size: int, sequence_parallel: bool
) -> None:
    """An alignment the packs can take: even (a tail splits into the zigzag chunks; a multiple
    of 2·TP under sequence parallelism) and dividing the budget (an aligned pack never exceeds
    it). ``max`` pads to the budget the pack was planned within."""
    alignment, unit = padding.alignment, budget_multiple(tp_size, sequence_parallel)
    if alignment == ALIGN_TO_BUDGET and padding.max_sequences is None:
        raise ValueError(
            f"{ALIGNMENT_FLAG}=max pads every pack to exactly --max-seqlen-per-dp-cp-rank="
            f"{budget}: give {MAX_SEQUENCES_FLAG} K too, so that the planner keeps each pack's "
            f"zigzag padding (< {unit} tokens per sequence and rank) within it."
        )
    if (
        alignment is not None
        and planning_budget(padding, budget, tp_size, sequence_parallel) < unit
    ):
        raise ValueError(
            f"{MAX_SEQUENCES_FLAG}={padding.max_sequences}: with {ALIGNMENT_FLAG} the planner "
            f"keeps {unit} tokens per sequence of a pack free for padding, which leaves nothing "
            f"of --max-seqlen-per-dp-cp-rank={budget}; lower the cap or raise the budget."
        )
    if alignment is None or alignment == ALIGN_TO_BUDGET:
        return
    if alignment % unit or budget % alignment:
        raise ValueError(
            f"{ALIGNMENT_FLAG}={alignment}: must be a multiple of {unit} (every sequence is "
            f"padded to 2 × CP size{' × TP size' if unit > 2 else ''}) that divides "
            f"--max-seqlen-per-dp-cp-rank={budget}, so an aligned pack stays within the "
            f"budget; e.g. {_suggestion(budget, unit, alignment)}, or max."
        )


def planning_budget(
    padding: PackPadding, budget: int, tp_size: int, sequence_parallel: bool
) -> int:
    """The budget the planner plans within. Each sequence of a pack is padded to 2 × its CP
    size (× TP under sequence parallelism): fewer than ``budget_multiple`` tokens per rank. With
    an alignment and a cap of K samples per pack, the planner keeps that much per sample free,
    so that a padded pack never exceeds the budget (``max``: exactly the budget)."""
    if padding.alignment is None or padding.sample_cap is None:
        return budget
    return budget - budget_multiple(tp_size, sequence_parallel) * padding.sample_cap


def _suggestion(budget: int, unit: int, alignment: int) -> int:
    """The valid alignment nearest to ``alignment``."""
    valid = [n for n in range(unit, budget + 1, unit) if budget % n == 0]
    return min(valid, key=lambda n: abs(n - alignment))


def padded_cost(cost: CostModel, padding: PackPadding) -> CostModel:
    """The cost model of padded packs: under ``max`` every rank's pack of every micro-batch is
    ``budget`` tokens of GEMM work whatever it holds (the linear term becomes a fixed cost per
    micro-batch); an alignment of N adds N / 2 tokens per rank and micro-batch on average."""
    if padding.alignment is None:
        return cost
    if padding.alignment == ALIGN_TO_BUDGET:
        return replace(cost, linear=0.0, microbatch=cost.microbatch + cost.linear * padding.budget)
    return replace(cost, microbatch=cost.microbatch + cost.linear * padding.alignment / 2)
