"""``megatron-dcp check``: the first command on a new machine or cluster node.

    megatron-dcp check [--nproc N] [--out check_out] [--json check.json] [--timeout 900] \\
        [megatron model flags, e.g. --num-layers 4 --hidden-size 256]

1. **Environment**: versions, the patch-table entries that apply, devices, node layout
   (``tools.check.environment``).
2. **Correctness**: a tiny GPT (:data:`DEFAULTS`, dropout off, ``--lr 0``) trains three global
   batches, each run by static CP, by static CP with its plan in reverse order and by DCP, on
   identical samples (bench-train's run, its digests checked). DCP's plans must mix CP sizes.
   Static CP's and DCP's loss and every gradient must be within the tolerance of a float64
   reference run outside DCP (``tools.check.reference_arm``: megatron-core's own layers, one
   sample at a time, no packing, CP or pipeline), and DCP's within twice the tolerance of static
   CP's, from the rounding the reordered run measures (``tools.check.tolerance``). On the DP×CP
   domain of every rank, and with 4 or more ranks also on two pipeline stages
   (``tools.check.layout_runs.layouts_for``).
3. **Speed**: the same run's step times (bench-train's figures over its last two batches): a
   smoke figure, not a benchmark.
4. **Verdict**: one last line, ``megatron-dcp check: PASS ...`` (exit 0) or ``FAIL ...`` (exit 1).
   A machine it cannot check (one rank, a GPU without Transformer Engine, an unsupported
   megatron-core) gets one ``error:`` line with the reason, after the environment (exit 2).

``--nproc`` defaults to the GPUs, else the cores (ranks beyond the cores share them: the speed
figure says so). On a GPU the run is bf16 with Transformer Engine. A bf16 or fp16 run (``--bf16``,
``--fp16``, a GPU's default) is checked in two stages, its precision, then float32 for what that
precision cannot resolve (``tools.check.stages``); the report names the stage of every finding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.tools.argument_types import given_flags, positive_int
from megatron_dcp.tools.cli.args import add_pass_through

PROG = "megatron-dcp check"
DEFAULTS: Dict[str, object] = {
    "--num-layers": 2,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--ffn-hidden-size": 256,
    "--seq-length": 1024,
    "--max-position-embeddings": 1024,
    "--global-batch-size": 8,
    "--vocab-size": 1024,
    "--varlen-distribution": "lognormal:median=256,sigma=1.0,min=16,max=1024",
    "--max-seqlen-per-dp-cp-rank": 512,
    # A quarter of each sample is a prompt outside the loss, as in SFT data: a defect in how the
    # runtime carries the loss mask shows (planted as ``loss_mask_shifted``).
    "--varlen-prompt-fraction": 0.25,
}
# With --fp16, megatron's dynamic loss scale starts at 2**32: the tiny model's weight gradients
# (a sum over ~2,000 tokens) overflow fp16 at any scale over ~2**9, and every step of the check
# would be skipped. It starts at 2**7 unless the user sets a scale.
LOSS_SCALE_FLAGS = ("--loss-scale", "--initial-loss-scale")
FP16_LOSS_SCALE = 128.0
# Set by the check whatever the user passes: the layout, and what makes the arms comparable.
CHECK_SETS = {
    "--context-parallel-size": "the layout",
    "--pipeline-model-parallel-size": "the layout",
    "--tensor-model-parallel-size": "the layout",
    "--lr": "0: every arm of a batch starts from the same weights",
    "--hidden-dropout": "0: dropout masks depend on the packing",
    "--attention-dropout": "0: dropout masks depend on the packing",
}


def check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [check flags] [megatron model flags]",
        description="Environment report; static CP and DCP against a float64 reference outside "
        "DCP, and DCP against static CP; a smoke speed figure; a verdict.",
        allow_abbrev=False,
    )
    p.add_argument("--nproc", type=positive_int, help="ranks (default: the GPUs, else the cores)")
    p.add_argument("--out", type=Path, default=Path("check_out"), help="run folder")
    p.add_argument("--json", type=Path, help="write everything the check found here")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per layout's run")
    return p


def add_check(sub: argparse._SubParsersAction) -> None:
    summary = (
        "environment report, static CP and DCP against a float64 reference outside DCP and DCP "
        "against static CP, smoke speed, one verdict (docs/usage.md)"
    )
    add_pass_through(sub, "check", summary, check)


def training_flags(extra: Sequence[str], on_gpu: bool) -> List[str]:
    """:data:`DEFAULTS` under the user's model flags, with what the check sets itself."""
    from megatron_dcp.tools.launching.training_runs import flag_list

    given = given_flags(extra)
    refused = sorted(given.intersection(CHECK_SETS))
    if refused:
        why = "; ".join(f"{flag}: {CHECK_SETS[flag]}" for flag in refused)
        raise ValueError(f"{', '.join(refused)}: check sets these itself ({why}); leave them out.")
    defaults = {flag: value for flag, value in DEFAULTS.items() if flag not in given}
    fixed: Dict[str, object] = {"--lr": 0.0, "--hidden-dropout": 0.0, "--attention-dropout": 0.0}
    if on_gpu and not given.intersection({"--bf16", "--fp16"}):
        fixed["--bf16"] = True
    if "--fp16" in given and not given.intersection(LOSS_SCALE_FLAGS):
        fixed["--initial-loss-scale"] = FP16_LOSS_SCALE
    return [*flag_list({**defaults, **fixed}), *extra]


def refusal(env: Dict[str, Any], nproc: int) -> Optional[str]:
    """Why this machine cannot be checked at ``nproc`` ranks (None: it can)."""
    reasons = []
    megatron, gpus = env["megatron_core"], env["devices"]["gpus"]
    if not megatron["supported"]:
        reasons.append(
            f"megatron-core {megatron['version']} is not supported (this package patches "
            f"{', '.join(megatron.get('supports', []))}); install a supported version"
        )
    if nproc < 2:
        reasons.append(
            f"--nproc={nproc}: a DP×CP domain of one rank has CP size 1 only, so DCP cannot mix "
            "CP sizes; use --nproc 2 or more (2 GPUs, or CPU ranks)"
        )
    if gpus and nproc > len(gpus):
        reasons.append(f"--nproc={nproc}: this machine has {len(gpus)} GPU(s), one rank each")
    if gpus and env["transformer_engine"] is None:
        reasons.append(
            "no Transformer Engine: on a GPU the check runs DCP as it trains there, bf16 with "
            "Transformer Engine's THD attention; install it with scripts/install_gpu.sh "
            "(docs/gpu.md)"
        )
    return "; ".join(reasons) or None


def check(argv: Sequence[str]) -> int:
    """The whole command (module docstring); returns the exit code."""
    from megatron_dcp.tools.check import environment as environment_report
    from megatron_dcp.tools.check.verdict import TOLERANCE_RULE, write_json

    options, extra = check_parser().parse_known_args(list(argv))
    env = environment_report.environment()
    nproc = options.nproc or len(env["devices"]["gpus"]) or env["devices"]["cores"]
    flags = training_flags(extra, bool(env["devices"]["gpus"]))
    report: Dict[str, Any] = {"environment": env, "nproc": nproc, "flags": flags}
    report["tolerance"] = TOLERANCE_RULE
    print("environment", *environment_report.describe(env), sep="\n  ", flush=True)
    reason = refusal(env, nproc)
    if reason is not None:
        report["refused"] = reason
        if options.json:
            write_json(options.json, report)
        raise ValueError(reason)
    return run_checks(options, nproc, flags, report)


def run_checks(
    options: argparse.Namespace, nproc: int, flags: List[str], report: Dict[str, Any]
) -> int:
    """Every stage's and layout's run, its findings, the verdict line; 0 on PASS, 1 on FAIL.
    A second (float32) stage runs only when the first found nothing (``tools.check.stages``)."""
    from megatron_dcp.tools.check.layout_runs import layouts_for
    from megatron_dcp.tools.check.stages import stages_for
    from megatron_dcp.tools.check.verdict import layout_json, verdict_line, write_json

    results, problems = [], []
    stages = stages_for(flags, on_gpu=bool(report["environment"]["devices"]["gpus"]))
    for stage in stages:
        if problems:
            print(f"check: {stage.label} stage not run: the {stages[0].label} stage failed")
            break
        found, stage_problems = run_stage(options, nproc, stage)
        results += found
        problems += stage_problems
    if len(layouts_for(nproc)) == 1:
        print(f"check: no pipeline layout: it needs 4 ranks or more (--nproc {nproc})")
    line = verdict_line(results, problems)
    report.update(layouts=[layout_json(r) for r in results], passed=not problems, verdict=line)
    report["stages"] = [stage.precision for stage in stages]
    if options.json:
        write_json(options.json, report)
    print(line, flush=True)
    return 1 if problems else 0


def run_stage(options: argparse.Namespace, nproc: int, stage: Any) -> Tuple[List[Any], List[str]]:
    """Every layout's run at one stage's precision: (results, problems found)."""
    from megatron_dcp.tools.check.layout_runs import LayoutResult, layouts_for, run_layout
    from megatron_dcp.tools.check.verdict import describe, failures
    from megatron_dcp.tools.launching.training_runs import TrainingRunError

    results, problems = [], []
    for layout in layouts_for(nproc):
        label = f" ({stage.label})" if stage.label else ""
        print(f"check: {layout}{label} on {layout.nproc} ranks ...", flush=True)
        out = options.out / stage.label / str(layout) if stage.label else options.out / str(layout)
        try:
            result = run_layout(layout, stage, out, options.timeout)
        except TrainingRunError as error:
            result = LayoutResult(layout, error=str(error), stage=stage.label)
            result.low_precision = stage.low_precision
        print(*describe(result), sep="\n", flush=True)
        results.append(result)
        problems += failures(result)
    return results, problems


if __name__ == "__main__":
    sys.exit(check(sys.argv[1:]))
