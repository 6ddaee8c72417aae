"""Functional test cases: full training runs of ``megatron_dcp.pretrain_gpt`` (or, with
``entry: pretrain_mamba``, of the hybrid Mamba entry point) against goldens.

A case is a folder of ``functional_tests/test_cases``: ``model_config.yaml`` (the job: ``nproc``,
``train_iters``, ``save_interval``, the ``model_args`` flags and optionally ``resume: false``) and ``golden_values.json`` (the
per-iteration ``lm loss`` this project produced). A case's ranks are forked from one process
that imported the entry point (``testing.forked_launch``: torch and megatron imported once per
job, not once per rank). Regenerating goldens overwrites the reference
every later run is judged by, so it refuses to run without ``--overwrite-goldens``:

    python -m megatron_dcp.testing.functional gpt3_tp2_pp1_cp4_dcp --overwrite-goldens
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

from megatron_dcp.testing.force_static_plan import launch_entry
from megatron_dcp.testing.plan_coverage import Layout
from megatron_dcp.tools.launching.training_runs import RunLog, flag_list, run_pretrain

CASES_DIR = Path(__file__).resolve().parents[2] / "functional_tests" / "test_cases"
# The vision-language case (entry pretrain_vlm): its own test, no goldens, so not in CASES_DIR.
VLM_CASES_DIR = CASES_DIR.parent / "vlm_cases"


@dataclass(frozen=True)
class FunctionalCase:
    """One functional test case: its launch settings and model flags (``model_config.yaml``)."""

    name: str
    nproc: int
    train_iters: int
    save_interval: int
    model_args: Dict[str, object]
    entry: str = "pretrain_gpt"  # the training module: pretrain_gpt, pretrain_mamba, pretrain_vlm
    # Whether the resume test runs this case: resuming is model-independent (megatron's
    # checkpoint and DCP's data iterator), so cases added for a model kind may leave it out.
    resume: bool = True

    @property
    def golden_path(self) -> Path:
        return CASES_DIR / self.name / "golden_values.json"

    @property
    def layout(self) -> Layout:
        """The parallel layout the case's flags ask for."""
        args = self.model_args
        tp, pp, cp = (
            int(args.get(f"--{name}-parallel-size", 1))
            for name in ("tensor-model", "pipeline-model", "context")
        )
        per_virtual = args.get("--num-layers-per-virtual-pipeline-stage")
        vpp = int(args["--num-layers"]) // (pp * int(per_virtual)) if per_virtual else 1
        dp = self.nproc // (tp * pp * cp)
        return Layout(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp if vpp > 1 else None)

    def goldens(self) -> Dict[int, float]:
        values = json.loads(self.golden_path.read_text())["lm loss"]["values"]
        return {int(iteration): float(loss) for iteration, loss in values.items()}


def load_case(name: str, cases_dir: Path = CASES_DIR) -> FunctionalCase:
    config = yaml.safe_load((cases_dir / name / "model_config.yaml").read_text())
    return FunctionalCase(
        name,
        config["nproc"],
        config["train_iters"],
        config["save_interval"],
        config["model_args"],
        config.get("entry", "pretrain_gpt"),
        bool(config.get("resume", True)),
    )


def case_names() -> List[str]:
    return sorted(path.parent.name for path in CASES_DIR.glob("*/model_config.yaml"))


def resumed_case_names() -> List[str]:
    """The cases the resume test runs (``resume: false`` in a case's yaml leaves it out)."""
    return [name for name in case_names() if load_case(name).resume]


def run_case(
    case: FunctionalCase,
    workdir: Path,
    label: str,
    scheduler: Optional[str] = None,
    save: Optional[Path] = None,
    load: Optional[Path] = None,
    ckpt_step: Optional[int] = None,
) -> RunLog:
    """One training run of ``case`` (log in ``workdir/label.log``): optionally with another
    scheduler, saving checkpoints every ``save_interval`` iterations, or resuming from ``load``
    (at ``ckpt_step``, default the latest checkpoint)."""
    options: Dict[str, object] = {**case.model_args, "--train-iters": case.train_iters}
    if scheduler is not None:
        options["--sequence-packing-scheduler"] = scheduler
    if save is not None:
        options.update({"--save": save, "--save-interval": case.save_interval})
    if load is not None:
        options.update({"--load": load, "--ckpt-step": ckpt_step})
    entry, args = launch_entry(case.entry, flag_list(options))  # the coverage check's switch
    log_path = workdir / f"{label}.log"
    return run_pretrain(args, case.nproc, log_path, entry=entry, launcher=forked(case.entry))


def forked(entry: str) -> Tuple[str, ...]:
    """``run_pretrain``'s launcher that forks the ranks of a ``megatron_dcp.<entry>`` job from
    one process that imported it (``testing.forked_launch``), and megatron's tokenizers, which
    every rank imports when it builds its tokenizer (transformers with them: 2 s a rank)."""
    preload = (f"megatron_dcp.{entry}", "megatron.core.tokenizers.text")
    return ("-m", "megatron_dcp.testing.forked_launch", *(f"--preload={m}" for m in preload))


def write_goldens(case: FunctionalCase, log: RunLog) -> None:
    values = {str(iteration): loss for iteration, loss in sorted(log.losses.items())}
    document = {"lm loss": {"start_step": 1, "end_step": case.train_iters, "values": values}}
    case.golden_path.write_text(json.dumps(document, indent=2) + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=case_names())
    parser.add_argument("--overwrite-goldens", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("functional_runs"))
    args = parser.parse_args(argv)
    if not args.overwrite_goldens:
        parser.error("regenerating goldens replaces the reference: pass --overwrite-goldens")
    for name in args.cases:
        case = load_case(name)
        (args.workdir / name).mkdir(parents=True, exist_ok=True)
        log = run_case(case, args.workdir / name, "golden")
        write_goldens(case, log)
        print(f"{name}: wrote {len(log.losses)} losses to {case.golden_path}")


if __name__ == "__main__":
    main()
