"""Quick-start: train a tiny GPT on 8 CPU ranks (TP2 × CP4) twice on the same variable-length
data — static CP (``dp_balanced``) and DCP (``default_dynamic_cp``) — and compare them.

    python -m megatron_dcp.tools.quickstart [--iters 5] [--out quickstart_out] [--sft]

The data are mock sequences (a learnable Markov chain), or with ``--sft`` generated
conversations (``megatron-dcp sft-corpus``) rendered with a tokenizer trained on them, with only
the assistant's tokens in the loss.

Prints the per-iteration loss of both runs (they must agree: DCP changes speed, never math, with
dropout off as here; with dropout each token's mask depends on where it lands in its rank's
pack), the micro-batch counts, CP-size histograms, the busiest position's forward-backward time
(measured, and predicted by the cost model that planned the step), each plan's critical path over
the lower bound under the prior cost model and throughput, and writes the plans of the first
iteration as a picture. The plans are re-made from the same batches with the cost model the runs
planned iteration 1 with (the model flags' shape on their hardware profile); the online
refinement may change the plans of later iterations, and a row whose re-made plan differs from
the one a run executed is marked. A failed run is reported by the last error line of its log
(``<out>/<scheduler>.log``), which the message names.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from megatron_dcp.scheduling import CostModel, Plan, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.tools.argument_types import positive_int
from megatron_dcp.tools.launching.training_runs import (
    DCPFigures,
    RunLog,
    TrainingRunError,
    available_cores,
    flag_list,
    run_pretrain,
)
from megatron_dcp.tools.plot import require_matplotlib
from megatron_dcp.tools.progress import Progress, iteration_reader

NPROC, TP, CP = 8, 2, 4
MODEL: Dict[str, object] = {
    "--dynamic-context-parallel": True,
    "--tensor-model-parallel-size": TP,
    "--context-parallel-size": CP,
    "--max-seqlen-per-dp-cp-rank": 256,
    "--num-layers": 2,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--ffn-hidden-size": 128,
    "--seq-length": 1024,
    "--max-position-embeddings": 1024,
    "--position-embedding-type": "rope",
    "--micro-batch-size": 1,
    "--global-batch-size": 16,
    "--hidden-dropout": 0.0,
    "--lr": 3e-3,  # the mock data is learnable: the loss falls visibly within five steps
    "--min-lr": 3e-3,
    "--lr-decay-style": "constant",
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 128,
    "--varlen-distribution": "lognormal:mean=200,sigma=1.2,min=16,max=1024",
    "--seed": 1234,
    "--eval-iters": 0,
    "--eval-interval": 1000,
    "--log-interval": 1,
    "--dcp-hardware-profile": "cpu-gloo",
    "--dcp-time-steps": "on",  # the table's measured times, whatever the refinement does
}
MOCK_DATA = ("--tokenizer-type", "--vocab-size", "--varlen-distribution")
SFT_CONVERSATIONS = 2000
SCHEDULERS = ("dp_balanced", "default_dynamic_cp")
LOSS_RTOL = 1e-5
DROPOUT_NOTE = (
    "dropout is 0 in both runs (--hidden-dropout 0; attention dropout is off on CPU): with "
    "dropout, DCP and static CP draw different masks (each token's mask depends on where it "
    "lands in its rank's pack), so their losses would differ by about 1e-4 relative"
)
DATA_NOTE = {
    False: "the mock tokens follow a learnable Markov chain",
    True: "the loss is the mean over the assistant's tokens",
}


def sft_model(out: Path) -> Dict[str, object]:
    """:data:`MODEL` on generated conversations and the tokenizer trained on them."""
    from megatron_dcp.tools.conversation_corpus import write_sft_corpus

    paths = write_sft_corpus(out / "sft_data", SFT_CONVERSATIONS)
    return {
        **{flag: value for flag, value in MODEL.items() if flag not in MOCK_DATA},
        "--tokenizer-type": "HuggingFaceTokenizer",
        "--tokenizer-model": str(paths["tokenizer"]),
        "--sft-data": str(paths["corpus"]),
    }


def train(model: Dict[str, object], scheduler: str, iters: int, out: Path) -> RunLog:
    options = {**model, "--train-iters": iters, "--sequence-packing-scheduler": scheduler}
    print(f"quickstart: training with {scheduler} on {NPROC} CPU ranks (tp {TP}, cp {CP}) ...")
    progress = Progress(f"quickstart: {scheduler}", iters, "iterations")
    log = out / f"{scheduler}.log"
    return run_pretrain(flag_list(options), NPROC, log, on_line=iteration_reader(progress))


def histogram(sizes: Dict[int, int]) -> str:
    return " ".join(f"{size}:{count}" for size, count in sorted(sizes.items()))


# The plans of each iteration (index 0 = iteration 1), by scheduler, re-made under the prior.
Replanned = List[Dict[str, Plan]]
REPLANNED_MARK = "*"


def ran_as_replanned(figures: DCPFigures, plan: Plan) -> bool:
    """Whether the run's ``[DCP]`` line describes ``plan`` (micro-batches and CP sizes)."""
    return (figures.microbatches, figures.cp_sizes) == (
        plan.num_microbatches,
        plan.cp_size_histogram(),
    )


def ratio_to_bound(plan: Plan, cost: CostModel) -> float:
    """Critical path over the lower bound of ``plan`` under ``cost`` (1: no plan is shorter)."""
    return critical_path(plan, cost) / lower_bound(plan, cost)


def pair(static: float, dcp: float, digits: int, width: int) -> str:
    return f"{static:>{width}.{digits}f}/{dcp:<{width}.{digits}f}"


def comparison(static: RunLog, dcp: RunLog, plans: Replanned, cost: CostModel) -> List[str]:
    """The table: per iteration both runs' losses, micro-batches, CP sizes, the busiest
    position's fwd-bwd time (measured, predicted), CP/LB of the re-made plans and tokens/s."""
    header = (
        f"{'iter':>4}  {'loss static':>11}  {'loss DCP':>11}  {'rel diff':>8}  {'mb s/d':>6}  "
        f"{'CP sizes (size:seqs) static -> DCP':<36}  {'fwd-bwd ms s/d':>15}  "
        f"{'pred. ms s/d':>15}  {'CP/LB prior s/d':>16}  {'tok/s s/d':>11}"
    )
    rows = [header]
    for it in sorted(dcp.losses):
        s, d = static.dcp[it], dcp.dcp[it]
        made = plans[it - 1]
        ratios = [ratio_to_bound(made[name], cost) for name in SCHEDULERS]
        same = ran_as_replanned(s, made[SCHEDULERS[0]]) and ran_as_replanned(d, made[SCHEDULERS[1]])
        diff = abs(static.losses[it] - dcp.losses[it]) / abs(static.losses[it])
        sizes = f"{histogram(s.cp_sizes)} -> {histogram(d.cp_sizes)}"
        rows.append(
            f"{it:>4}  {static.losses[it]:>11.6f}  {dcp.losses[it]:>11.6f}  {diff:>8.1e}  "
            f"{s.microbatches:>2}/{d.microbatches:<3}  {sizes:<36}  "
            f"{pair(s.measured_step_ms, d.measured_step_ms, 1, 7)}  "
            f"{pair(s.predicted_step_ms, d.predicted_step_ms, 1, 7)}  "
            f"{ratios[0]:>7.3f}/{f'{ratios[1]:.3f}' + ('' if same else REPLANNED_MARK):<8}  "
            f"{s.tokens_per_s:>5}/{d.tokens_per_s:<5}"
        )
    return rows


def table_notes(cores: int) -> List[str]:
    """What the table's time and CP/LB columns are, and why its times are not a benchmark."""
    share = (
        f"{NPROC} ranks share {cores} cores here"
        if cores < NPROC
        else f"each run is timed once, unpaired, on {NPROC} ranks"
    )
    return [
        "fwd-bwd ms: the busiest DP×CP position's forward-backward time, measured and as "
        "predicted by the cost model that planned the step (refined online after each step)",
        "CP/LB prior: critical path / lower bound of the iteration's plans re-made under the "
        "prior cost model (the one iteration 1 is planned with; 1 = no plan is shorter); the "
        "runs refine their model online, so from iteration 2 on a run's plan may differ from the "
        f"re-made one: marked {REPLANNED_MARK}",
        f"{share}, so the times and tokens/s time the operating system's scheduler as much as "
        "the plans; for a fair measurement (one rank per core, the same batches under each "
        "scheduler, paired intervals) run `megatron-dcp bench-train` (docs/performance.md)",
    ]


def batch_lengths(model: Dict[str, object], iters: int) -> List[List[int]]:
    """Lengths of each iteration's global batch in the order the runs planned it: the dataset of
    ``iters`` × G samples (G the global batch size) that training builds, of which megatron's
    sampler hands the one DP rank samples (i − 1)·G .. i·G − 1 at iteration i, in order."""
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir
    from megatron_dcp.integration.data.datasets import build_varlen_datasets

    sft, size = "--sft-data" in model, int(model["--global-batch-size"])
    train_ds, _, _ = build_varlen_datasets(
        seq_length=int(model["--seq-length"]),
        vocab_size=int(model.get("--vocab-size", 0)),
        seed=int(model["--seed"]),
        num_samples=[size * iters, 0, 0],
        distribution=model.get("--varlen-distribution"),
        sft_data=model.get("--sft-data"),
        chat=chat_tokenizer_from_dir(str(model["--tokenizer-model"])) if sft else None,
    )
    lengths = [train_ds.sequence_length(i) for i in range(size * iters)]
    return [lengths[i * size : (i + 1) * size] for i in range(iters)]


def run_cost_model(model: Dict[str, object]) -> CostModel:
    """The cost model the runs planned iteration 1 with, built from the model flags exactly as
    ``DCPConfig.from_args`` builds it, with the vocabulary megatron pads when it builds the
    tokenizer (while parsing the arguments, before the DCP checks)."""
    from megatron_dcp.integration.config import cost_model_from_args
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    names = {flag.lstrip("-").replace("-", "_"): value for flag, value in model.items()}
    args = argparse.Namespace(**names, make_vocab_size_divisible_by=128, rank=0)
    args.padded_vocab_size = vocab_size_with_padding(tokenizer_vocabulary(model), args, False)
    return cost_model_from_args(args)


def tokenizer_vocabulary(model: Dict[str, object]) -> int:
    """The tokenizer's vocabulary before padding: ``--vocab-size`` (NullTokenizer) or the
    trained tokenizer's (``--sft``)."""
    if "--sft-data" not in model:
        return int(model["--vocab-size"])
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir

    return len(chat_tokenizer_from_dir(str(model["--tokenizer-model"])).tokenizer)


def plans_of(model: Dict[str, object], cost: CostModel, lengths: Sequence[int]) -> Dict[str, Plan]:
    """One global batch planned by both schedulers under ``cost`` over the runs' domain."""
    plans = {}
    for name in SCHEDULERS:
        scheduler = build_scheduler(
            name,
            dp_size=NPROC // (TP * CP),
            cp_size=CP,
            max_seqlen_per_dp_cp_rank=int(model["--max-seqlen-per-dp-cp-rank"]),
            cost_model=cost,
        )
        plans[name] = scheduler.schedule(lengths)
    return plans


def first_plans(model: Dict[str, object], lengths: Sequence[int]) -> Dict[str, Plan]:
    """Iteration 1 planned by both schedulers as the runs planned it (with the runs' cost
    model)."""
    return plans_of(model, run_cost_model(model), lengths)


def replan(model: Dict[str, object], iters: int) -> Tuple[CostModel, Replanned]:
    """The prior cost model of the runs, and every iteration's batch planned under it."""
    cost = run_cost_model(model)
    return cost, [plans_of(model, cost, lengths) for lengths in batch_lengths(model, iters)]


def plot_first_plans(plans: Dict[str, Plan], cost: CostModel, path: Path) -> None:
    """Draw iteration 1's plans (as the runs made them) side by side."""
    from megatron_dcp.tools.plan_report import report
    from megatron_dcp.tools.plot import plan_panel, plot_panels

    panels = [plan_panel(plan, cost, report(name, plan, cost)) for name, plan in plans.items()]
    title = (
        f"iteration 1: static CP (left) and DCP (right) over the {NPROC // TP} DP×CP positions "
        f"(the {TP} TP ranks of a position share its column)"
    )
    plot_panels(panels, str(path), suptitle=title)


def build_parser() -> argparse.ArgumentParser:
    """The quick-start's flags."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dcp.tools.quickstart", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=5,
        metavar="N",
        help="training iterations of each run (default 5)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("quickstart_out"),
        metavar="DIR",
        help="where the logs of both runs and the plan picture go (default quickstart_out)",
    )
    parser.add_argument(
        "--sft", action="store_true", help="Train on generated conversations (assistant loss)."
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_matplotlib("the quick-start's plan picture")  # before minutes of training
    warnings.filterwarnings("ignore")  # megatron's import-time notices about absent TE/APEX
    args.out.mkdir(parents=True, exist_ok=True)
    model = sft_model(args.out) if args.sft else MODEL
    try:
        static, dcp = (train(model, name, args.iters, args.out) for name in SCHEDULERS)
    except TrainingRunError as error:
        print(f"quickstart: error: {error}", file=sys.stderr)
        return 1
    cost, plans = replan(model, args.iters)
    table = comparison(static, dcp, plans, cost)
    print("\n".join(["", *table, *table_notes(available_cores()), ""]))
    iteration1 = plans[0]
    assert ran_as_replanned(static.dcp[1], iteration1[SCHEDULERS[0]]) and ran_as_replanned(
        dcp.dcp[1], iteration1[SCHEDULERS[1]]
    ), "the re-made plan of iteration 1 differs from the one the runs executed"
    plot_first_plans(iteration1, cost, args.out / "plan_iteration1.png")
    agree = all(
        abs(static.losses[i] - dcp.losses[i]) <= LOSS_RTOL * abs(static.losses[i])
        for i in dcp.losses
    )
    print(f"losses agree to {LOSS_RTOL:g} relative: {'yes' if agree else 'NO'}")
    print(DROPOUT_NOTE)
    first, last = dcp.losses[min(dcp.losses)], dcp.losses[max(dcp.losses)]
    print(
        f"loss from iteration 1 to {max(dcp.losses)}: {first:.3f} -> {last:.3f} "
        f"({(first - last) / first:.1%} lower; {DATA_NOTE[args.sft]})"
    )
    print(f"plan picture of iteration 1: {args.out / 'plan_iteration1.png'}; logs in {args.out}/")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
