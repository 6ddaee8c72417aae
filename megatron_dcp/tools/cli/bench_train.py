"""``megatron-dcp bench-train``: time real training steps of several planners on identical
global batches, one rank per core.

    megatron-dcp bench-train [--nproc 2] [--arms static,dcp,megatron_dev] [--batches 14] \\
        [--warmup 2] [--out bench_train_out] [--entry pretrain_gpt] [--oversubscribe] \\
        [--link-rate 200mbit [--nodes 2]] \\
        [megatron and DCP flags, e.g. --varlen-distribution ... --max-seqlen-per-dp-cp-rank ...]

One training run (:mod:`.worker`) runs every global batch once per arm, the arms taking turns
in a rotating order, so that both arms of a comparison run the same samples on the same warm
process within seconds of each other. Flags not given take :data:`DEFAULTS` (a 4-layer,
hidden-256 GPT, 32 sequences per global batch, DP 1 × CP ``--nproc``). The first ``--warmup``
batches are left out; what is left is compared batch by batch (``stats``). ``--link-rate``
runs it all inside a fresh network namespace whose loopback is shaped to the rate, ``--nodes 2``
on two namespaces joined by a shaped veth (``tools.link``, root only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from megatron_dcp.tools.bench_train.arms import DEFAULT_ARMS, arm_at, parse_arms, runnable
from megatron_dcp.tools.bench_train.results import BenchResult, collect
from megatron_dcp.tools.bench_train.worker import (
    PLANS_FILE,
    PRIOR_FILE,
    PROFILE_DIR,
    SPEC_VARIABLE,
    TIMES_FILE,
    BenchSpec,
)
from megatron_dcp.tools.cli.args import add_pass_through, given_flags, positive_int
from megatron_dcp.tools.launcher import TrainingRunError, available_cores, check_rank_per_core
from megatron_dcp.tools.link.launch import LinkSpec

PROG = "megatron-dcp bench-train"
WORKER_ENTRY = "tools.bench_train.worker"  # run as ``python -m megatron_dcp.<entry>``
ENTRIES = ("pretrain_gpt", "pretrain_mamba", "pretrain_vlm")
DEFAULTS: Dict[str, object] = {
    "--num-layers": 4,
    "--hidden-size": 256,
    "--num-attention-heads": 4,
    "--ffn-hidden-size": 1024,
    "--seq-length": 4096,
    "--max-position-embeddings": 4096,
    "--position-embedding-type": "rope",
    "--micro-batch-size": 1,
    "--global-batch-size": 32,
    "--hidden-dropout": 0.0,
    "--attention-dropout": 0.0,
    "--lr": 1e-4,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 1024,
    "--varlen-distribution": "lognormal:median=500,sigma=0.8,min=32,max=4096",
    "--max-seqlen-per-dp-cp-rank": 2048,
    "--seed": 1234,
    "--eval-iters": 0,
    "--eval-interval": 1000000,
}
# Added for ``--entry pretrain_vlm`` (megatron-core's LLaVA) where not given: a tiny CLIP ViT on
# 64-pixel tiles of 16-pixel patches (16 patches and the class token a tile), so that a CPU step
# encodes its tiles in a share of the step like the language model's. ``estimate`` takes the same
# defaults for vision-language data: the same flags mean the same model in both commands.
VLM_DEFAULTS: Dict[str, object] = {
    "--vision-num-layers": 2,
    "--vision-hidden-size": 128,
    "--vision-num-attention-heads": 4,
    "--img-h": 64,
    "--img-w": 64,
    "--patch-dim": 16,
}
# Added where the ranks compute on the CPU (``cuda_ranks``): the next batch prepared between the
# steps, not in a background thread; samples read in the rank's process, not by data-loader
# worker processes (whose samples cross to the rank one shared-memory handle per tensor).
CPU_DEFAULTS: Dict[str, object] = {"--dcp-prefetch": "off", "--num-workers": 0}
# The data sources of the training entry point besides the default mock lengths.
DATA_SOURCES = ("--sft-data", "--varlen-lengths-file", "--data-path")
# pretrain_vlm's conversations with images: they replace the mock lengths too (pretrain_vlm
# refuses --varlen-distribution beside them).
VLM_DATA_SOURCES = ("--vlm-data",)
# Set by the command whatever the user passes: the run is a benchmark of these arms.
FORCED_FLAGS = ("--dynamic-context-parallel", "--log-interval", "--train-iters")
# With --link-rate, bench-train passes the probed link bandwidth unless one of these is given.
LINK_PRIOR_FLAGS = (
    "--dcp-link-bandwidth", "--dcp-inter-node-link-bandwidth", "--dcp-cost-profile"
)  # fmt: skip


class DigestMismatch(ValueError):
    """Two arms of one global batch read different samples: the comparison would be unfair."""


def bench_parser() -> argparse.ArgumentParser:
    """The benchmark's own flags; every other flag goes to the training entry point."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [benchmark flags] [megatron and DCP flags]",
        description="Time real training steps of several planners on identical global batches.",
        epilog="Other flags: those of `python -m megatron_dcp.pretrain_gpt --help`.",
        allow_abbrev=False,
    )
    p.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--arms",
        type=parse_arms,
        default=DEFAULT_ARMS,
        help=f"comma-separated arms, static first (default {','.join(DEFAULT_ARMS)})",
    )
    p.add_argument(
        "--batches", type=positive_int, default=14, help="global batches, warm-up included"
    )
    p.add_argument("--warmup", type=int, default=2, help="first batches left out (default 2)")
    p.add_argument("--out", type=Path, default=Path("bench_train_out"), help="output folder")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile every arm's step of the first N compared batches with torch.profiler and "
        "print where the busiest rank's time goes (default 0: off; docs/performance.md)",
    )
    p.add_argument("--entry", choices=ENTRIES, default="pretrain_gpt", help="training entry point")
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than cores (the figures then time the OS scheduler too)",
    )
    p.add_argument(
        "--link-rate",
        help="run inside a fresh network namespace whose links are shaped to this rate, in "
        "tc's units (200mbit = 25 MB/s; 25mbps is bytes/s); root only",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="with --link-rate: 2 splits the ranks over two namespaces joined by a veth, only "
        "the veth shaped",
    )
    return p


def add_bench_train(sub: argparse._SubParsersAction) -> None:
    """The ``bench-train`` subcommand: the rest of the command line goes to :func:`bench_train`."""
    summary = "time training steps of several planners side by side (docs/performance.md)"
    add_pass_through(sub, "bench-train", summary, bench_train)


def bench_train(argv: Sequence[str]) -> int:
    """The whole command: check, run, check fairness, report. Returns the exit code."""
    from megatron_dcp.tools.bench_train.profile_report import print_attribution
    from megatron_dcp.tools.bench_train.report import print_report, write_outputs

    options, extra = bench_parser().parse_known_args(list(argv))
    check_cores(options.nproc, options.oversubscribe)
    if not 0 <= options.warmup < options.batches:
        raise ValueError(
            f"--warmup={options.warmup}: must leave batches to compare (0 ≤ warmup < --batches="
            f"{options.batches})."
        )
    if not 0 <= options.profile <= options.batches - options.warmup:
        raise ValueError(
            f"--profile={options.profile}: profiles the first N compared batches, so 0 ≤ N ≤ "
            f"--batches − --warmup = {options.batches - options.warmup}."
        )
    link = link_spec(options, extra)
    arms, missing = runnable(options.arms)
    try:
        result = run_bench(options, arms, extra, link)
    except TrainingRunError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    result.unavailable.update(missing)
    print_report(result)
    write_outputs(result, options.out)
    print_attribution(options.out)
    return 0


def check_cores(nproc: int, oversubscribe: bool) -> None:
    if not oversubscribe:
        check_rank_per_core(
            nproc, "Use --nproc ≤ {cores}, or add --oversubscribe (the report then says so)."
        )


def link_spec(options: argparse.Namespace, extra: Sequence[str]) -> Optional[LinkSpec]:
    """The shaped link ``--link-rate`` and ``--nodes`` ask for, checked (the flags and this
    machine's support) before anything runs; None without ``--link-rate``. Training gets the
    probed per-rank bandwidth as its cost model's prior unless the user's flags set the links
    (or a measured cost profile, which training refuses beside them)."""
    from megatron_dcp.tools.link.preflight import check_link_support
    from megatron_dcp.tools.link.rate import parse_link_rate

    nodes = options.nodes
    if options.link_rate is None:
        if nodes != 1:
            raise ValueError(f"--nodes={nodes} needs --link-rate (the link between the nodes).")
        return None
    if nodes not in (1, 2):
        raise ValueError(f"--nodes={nodes}: 1 or 2 nodes can be emulated; use --nodes 2.")
    if options.nproc % nodes:
        raise ValueError(
            f"--nodes={nodes} splits the ranks evenly: --nproc={options.nproc} is odd; use an "
            "even --nproc."
        )
    rate = parse_link_rate(options.link_rate)
    check_link_support(options.link_rate, rate, nodes)
    prior = not given_flags(extra).intersection(LINK_PRIOR_FLAGS)
    return LinkSpec(options.link_rate, rate, nodes, options.nproc, options.out, prior)


def training_flags(
    extra: Sequence[str], nproc: int, iterations: int, entry: str = "pretrain_gpt"
) -> List[str]:
    """:data:`DEFAULTS` (and :data:`VLM_DEFAULTS` for ``pretrain_vlm``) under the user's flags,
    DP 1 × CP ``nproc`` unless given, and the flags the benchmark needs."""
    from megatron_dcp.tools.launcher import flag_list

    given = given_flags(extra)
    forced = sorted(given.intersection(FORCED_FLAGS))
    if forced:
        raise ValueError(f"{', '.join(forced)}: bench-train sets these itself; leave them out.")
    entry_defaults = {**DEFAULTS, **(VLM_DEFAULTS if entry == "pretrain_vlm" else {})}
    defaults = {flag: value for flag, value in entry_defaults.items() if flag not in given}
    if "--context-parallel-size" not in given:
        defaults["--context-parallel-size"] = nproc
    if "--varlen-distribution" in defaults and given.intersection(
        DATA_SOURCES + VLM_DATA_SOURCES
    ):
        del defaults["--varlen-distribution"]  # the user's data replaces the mock lengths
    if not cuda_ranks():  # no idle core for background work: see cuda_ranks
        defaults.update({f: v for f, v in CPU_DEFAULTS.items() if f not in given})
    bench = {"--dynamic-context-parallel": True, "--log-interval": 1, "--train-iters": iterations}
    return [*flag_list({**defaults, **bench}), *extra]


def iteration_progress(iterations: int, arms: Sequence[str]) -> Callable[[str], None]:
    """A reader of the training output that reports each finished iteration (its ``[DCP]``
    line): the batch and the arm it ran, the elapsed time and an estimate of what is left."""
    from megatron_dcp.tools.progress import Progress, iteration_reader

    def note(iteration: int) -> str:
        batch, arm = arm_at(iteration, arms)
        return f"batch {batch + 1}/{iterations // len(arms)}, arm {arm}"

    return iteration_reader(Progress("bench-train", iterations, "iterations"), note)


def cuda_ranks() -> bool:
    """Whether the ranks will compute on GPUs. Where they compute on the CPU, bench-train
    adds :data:`CPU_DEFAULTS` unless the user gives those flags: with one rank per core no
    core is idle for background work, which then takes its time from the step it overlaps,
    and the arms' busy times would carry it (docs/performance.md, "The missing term: a cost
    per sequence"). On a GPU the host is idle while kernels run, and training's defaults are
    what is measured."""
    import torch

    return torch.cuda.is_available()


def run_bench(
    args: argparse.Namespace,
    arms: Sequence[str],
    extra: Sequence[str],
    link: Optional[LinkSpec] = None,
    worker: str = WORKER_ENTRY,
    timeout_s: float = 3600.0,
) -> BenchResult:
    """One training run of every arm (under the shaped ``link`` if any) by the ``worker``
    module (``megatron_dcp.<worker>``: bench-train's, or one built on it); its results, checked
    for fairness."""
    from megatron_dcp.tools.launcher import run_pretrain
    from megatron_dcp.tools.link.launch import run_linked

    args.out.mkdir(parents=True, exist_ok=True)
    stale_files = [args.out / PLANS_FILE, args.out / TIMES_FILE, args.out / PRIOR_FILE]
    stale_files += [*args.out.glob("digests/*.txt"), *args.out.glob(f"{PROFILE_DIR}/*.json")]
    for stale in stale_files:
        stale.unlink(missing_ok=True)
    iterations = args.batches * len(arms)
    flags = training_flags(extra, args.nproc, iterations, args.entry)
    if link is not None and link.nodes > 1 and "--dcp-ranks-per-node" not in extra:
        flags += ["--dcp-ranks-per-node", str(args.nproc // link.nodes)]
    profiled = range(args.warmup, args.warmup + getattr(args, "profile", 0))
    perturb = os.environ.get("MEGATRON_DCP_BENCH_PERTURB")
    spec = BenchSpec(arms, str(args.out), args.entry, perturb, tuple(profiled))
    shaped = "" if link is None else f", link {link.rate} over {link.nodes} node(s)"
    print(
        f"bench-train: {args.entry} on {args.nproc} ranks ({available_cores()} cores){shaped}, "
        f"arms {', '.join(arms)}, {args.batches} global batches ({iterations} iterations) ...",
        flush=True,
    )
    start, figures = time.perf_counter(), None
    os.environ[SPEC_VARIABLE] = spec.to_env()
    try:
        progress = iteration_progress(iterations, arms)
        if link is None:
            log = run_pretrain(
                flags, args.nproc, args.out / "train.log", timeout_s=timeout_s, entry=worker,
                on_line=progress,
            )  # fmt: skip
        else:
            log, figures = run_linked(flags, link, worker, timeout_s=timeout_s, on_line=progress)
    finally:
        del os.environ[SPEC_VARIABLE]
    print(f"bench-train: done in {time.perf_counter() - start:.0f} s", flush=True)
    check_digests(args.out, arms, args.batches)
    oversubscribed = args.nproc > available_cores()
    result = collect(log, args.out, arms, args.warmup, flags, args.nproc, oversubscribed)
    result.link = figures
    return result


def read_digests(path: Path) -> List[str]:
    return [line.split()[1] for line in path.read_text().splitlines() if line.strip()]


def check_digests(out: Path, arms: Sequence[str], batches: int) -> None:
    """Every rank read, for every global batch, the same samples in every arm's turn."""
    files = sorted((out / "digests").glob("rank*.txt"))
    if not files:
        raise DigestMismatch(f"no sample digests in {out / 'digests'}: the workers wrote none")
    for path in files:
        digests = read_digests(path)
        if len(digests) < batches * len(arms):
            raise DigestMismatch(f"{path}: {len(digests)} batches read, {batches * len(arms)} run")
        for batch in range(batches):
            seen = {}
            for turn in range(len(arms)):
                iteration = batch * len(arms) + turn + 1
                seen[arm_at(iteration, arms)[1]] = digests[iteration - 1]
            if len(set(seen.values())) > 1:
                raise DigestMismatch(
                    f"global batch {batch}: the arms read different samples on {path.stem} "
                    f"({', '.join(f'{a} {d[:10]}' for a, d in seen.items())}); the comparison "
                    "would not be fair."
                )
