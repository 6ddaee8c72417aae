"""Quick-start: train a tiny GPT on 8 CPU ranks (TP2 × CP4) twice on the same variable-length
data — static CP (``dp_balanced``) and DCP (``default_dynamic_cp``) — and compare them.

    python -m megatron_dcp.tools.quickstart [--iters 5] [--out quickstart_out] [--sft]

The data are mock sequences (a learnable Markov chain), or with ``--sft`` generated
conversations (``megatron-dcp sft-corpus``) rendered with a tokenizer trained on them, with only
the assistant's tokens in the loss.

Prints the per-iteration loss of both runs (they must agree: DCP changes speed, never math, with
dropout off as here; with dropout each token's mask depends on where it lands in its rank's
pack), the micro-batch counts, CP-size histograms, per-rank load imbalance and throughput, and
writes the plans of the first iteration as a picture, re-planned with the cost model the runs
planned iteration 1 with (the model flags' shape on their hardware profile; the online
refinement only changes the plans of later iterations). A failed run is reported by the last
error line of its log (``<out>/<scheduler>.log``), which the message names.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

from megatron_dcp.scheduling import CostModel, Plan, build_scheduler
from megatron_dcp.tools.cli import positive_int
from megatron_dcp.tools.launcher import RunLog, TrainingRunError, flag_list, run_pretrain
from megatron_dcp.tools.plot import require_matplotlib

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
    from megatron_dcp.tools.sft_corpus import write_sft_corpus

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
    return run_pretrain(flag_list(options), NPROC, out / f"{scheduler}.log")


def histogram(sizes: Dict[int, int]) -> str:
    return " ".join(f"{size}:{count}" for size, count in sorted(sizes.items()))


def comparison(static: RunLog, dcp: RunLog) -> List[str]:
    header = (
        f"{'iter':>4}  {'loss static':>11}  {'loss DCP':>11}  {'rel diff':>8}  {'mb s/d':>6}  "
        f"{'CP sizes (size:seqs) static -> DCP':<36}  {'imbalance s/d':>13}  {'tok/s s/d':>11}"
    )
    rows = [header]
    for it in sorted(dcp.losses):
        s, d = static.dcp[it], dcp.dcp[it]
        diff = abs(static.losses[it] - dcp.losses[it]) / abs(static.losses[it])
        sizes = f"{histogram(s.cp_sizes)} -> {histogram(d.cp_sizes)}"
        rows.append(
            f"{it:>4}  {static.losses[it]:>11.6f}  {dcp.losses[it]:>11.6f}  {diff:>8.1e}  "
            f"{s.microbatches:>2}/{d.microbatches:<3}  {sizes:<36}  "
            f"{s.measured_imbalance:>6.3f}/{d.measured_imbalance:<6.3f}  "
            f"{s.tokens_per_s:>5}/{d.tokens_per_s:<5}"
        )
    return rows


def first_batch_lengths(model: Dict[str, object]) -> List[int]:
    """Lengths of iteration 1's global batch in the order the runs planned it (one DP rank:
    megatron's sampler hands out samples 0 .. global batch size − 1 in order)."""
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir
    from megatron_dcp.integration.data.datasets import build_varlen_datasets

    sft = "--sft-data" in model
    train_ds, _, _ = build_varlen_datasets(
        seq_length=int(model["--seq-length"]),
        vocab_size=int(model.get("--vocab-size", 0)),
        seed=int(model["--seed"]),
        num_samples=[int(model["--global-batch-size"]), 0, 0],
        distribution=model.get("--varlen-distribution"),
        sft_data=model.get("--sft-data"),
        chat=chat_tokenizer_from_dir(str(model["--tokenizer-model"])) if sft else None,
    )
    return [train_ds.sequence_length(i) for i in range(len(train_ds))]


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


def first_plans(model: Dict[str, object], lengths: Sequence[int]) -> Dict[str, Plan]:
    """Iteration 1 planned by both schedulers as the runs planned it (with the runs' cost
    model)."""
    cost = run_cost_model(model)
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


def plot_first_plans(model: Dict[str, object], path: Path) -> Dict[str, int]:
    """Plan iteration 1 with both schedulers (as the runs did) and draw them side by side."""
    from megatron_dcp.tools.plot import plan_panel, plot_panels
    from megatron_dcp.tools.simulator import report

    cost, panels = run_cost_model(model), []
    plans = first_plans(model, first_batch_lengths(model))
    for name, plan in plans.items():
        panels.append(plan_panel(plan, cost, report(name, plan, cost)))
    plot_panels(panels, str(path), suptitle="iteration 1: static CP (left) and DCP (right)")
    return {name: plan.num_microbatches for name, plan in plans.items()}


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
    print("\n".join(["", *comparison(static, dcp), ""]))
    counts = plot_first_plans(model, args.out / "plan_iteration1.png")
    assert counts == {
        "dp_balanced": static.dcp[1].microbatches,
        "default_dynamic_cp": dcp.dcp[1].microbatches,
    }, "replanned plan differs"
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
