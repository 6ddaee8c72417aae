"""One ``bench-train`` run: every arm's training steps in one training run (:mod:`.worker`),
the arms taking turns in a rotating order, so that both arms of a comparison run the same
samples on the same warm process within seconds of each other; optionally inside shaped network
namespaces (``--link-rate``, ``--nodes 2``: ``tools.link``). Then the fairness check (every arm
read the same samples for every global batch) and what was measured (:mod:`.results`). The
command line is ``cli/bench_train.py``; ``check`` runs its own arms through :func:`run_bench`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from megatron_dcp.tools.argument_types import given_flags
from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.bench_train.results import BenchResult, collect
from megatron_dcp.tools.bench_train.run_flags import training_flags
from megatron_dcp.tools.bench_train.worker import (
    PLANS_FILE,
    PRIOR_FILE,
    PROFILE_DIR,
    SPEC_VARIABLE,
    TIMES_FILE,
    BenchSpec,
)
from megatron_dcp.tools.launching.training_runs import available_cores, check_rank_per_core
from megatron_dcp.tools.link.launch import LinkSpec

WORKER_ENTRY = "tools.bench_train.worker"  # run as ``python -m megatron_dcp.<entry>``
# With --link-rate, bench-train passes the probed link bandwidth unless one of these is given.
LINK_PRIOR_FLAGS = (
    "--dcp-link-bandwidth", "--dcp-inter-node-link-bandwidth", "--dcp-cost-profile"
)  # fmt: skip


class DigestMismatch(ValueError):
    """Two arms of one global batch read different samples: the comparison would be unfair."""


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


def iteration_progress(iterations: int, arms: Sequence[str]) -> Callable[[str], None]:
    """A reader of the training output that reports each finished iteration (its ``[DCP]``
    line): the batch and the arm it ran, the elapsed time and an estimate of what is left."""
    from megatron_dcp.tools.progress import Progress, iteration_reader

    def note(iteration: int) -> str:
        batch, arm = arm_at(iteration, arms)
        return f"batch {batch + 1}/{iterations // len(arms)}, arm {arm}"

    return iteration_reader(Progress("bench-train", iterations, "iterations"), note)


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
    from megatron_dcp.tools.launching.training_runs import run_pretrain
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
