"""What each rank of a ``megatron-dcp check`` run executes: ``bench-train``'s worker (every
global batch once per arm, digests, plans and times recorded: ``tools.bench_train.worker``) with
the arms of ``tools.check.reordered`` and, after every training step, the step's global loss and
this rank's gradients kept until every arm has run the batch; then one JSON line per batch in
``check/rank<r>.jsonl``: the loss of each arm and, per gradient tensor of this rank, its largest
magnitude under static CP and the largest distance of static CP reordered and of DCP from it.

The run trains with ``--lr 0`` (the command sets it), so every arm of a batch starts from the same
weights. The gradients are megatron's after its finalisation (``main_grad``: summed over DP×CP
and divided by the global token count), read where the schedule returns.

Planted defect (tests only): ``MEGATRON_DCP_CHECK_NOOP_PATCH=<entry>`` turns that entry of the
patch table into a no-op before training applies the table (the entry counts as applied, its
targets keep megatron's originals), so that ``check`` can be seen to fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.bench_train.worker import BenchSpec, bench_schedule_class
from megatron_dcp.tools.bench_train.worker import main as bench_worker_main
from megatron_dcp.tools.check.reordered import REORDERED, check_schedulers
from megatron_dcp.tools.check.layout_runs import RANKS_DIR

NOOP_VARIABLE = "MEGATRON_DCP_CHECK_NOOP_PATCH"
Held = Tuple[Tuple[float, int], Dict[str, torch.Tensor]]


def neutralize(name: str) -> None:
    """Apply the patch-table entry ``name`` as a no-op (module docstring)."""
    from megatron_dcp.integration.patches import entries
    from megatron_dcp.integration.patches.table import Patch, apply

    found = [entry for entry in entries() if entry.name == name]
    if not found or not isinstance(found[0], Patch):
        names = ", ".join(e.name for e in entries() if isinstance(e, Patch))
        raise ValueError(
            f"{NOOP_VARIABLE}={name}: not an attribute entry of the patch table; use one of "
            f"{names}."
        )
    apply(dataclasses.replace(found[0], replace=lambda owner, original: original))


def rank_gradients(model: Any) -> Dict[str, torch.Tensor]:
    """This rank's gradient of every parameter (float64 copies), by chunk and local name."""
    chunks = model if isinstance(model, list) else [model]
    grads = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads[f"{index}.{name}"] = grad.detach().double().clone()
    return grads


def largest(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def batch_record(batch: int, held: Dict[str, Held]) -> Dict[str, Any]:
    """One batch's line: every arm's (loss sum, tokens), and per tensor (name, largest |static|,
    largest |reordered − static|, largest |dcp − static|)."""
    static, reordered, dcp = (held[arm][1] for arm in ("static", REORDERED, "dcp"))
    tensors = [
        [name, largest(value), largest(reordered[name] - value), largest(dcp[name] - value)]
        for name, value in static.items()
    ]
    losses = {arm: list(h[0]) for arm, h in held.items()}
    return {"batch": batch, "loss": losses, "tensors": tensors}


def check_schedule_class(spec: BenchSpec) -> type:
    """bench-train's schedule with the check's arms and what each step computed kept."""
    import torch.distributed as dist

    from megatron_dcp.integration.training.forward_step import global_loss

    class CheckSchedule(bench_schedule_class(spec, check_schedulers())):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.held: Dict[str, Held] = {}

        def __call__(self, **kwargs: Any) -> Any:
            losses = super().__call__(**kwargs)
            if not kwargs.get("forward_only", False):
                batch, arm = arm_at(self.calls, spec.arms)
                self.held[arm] = (global_loss(losses), rank_gradients(kwargs["model"]))
                if len(self.held) == len(spec.arms):
                    self.write(batch_record(batch, self.held))
                    self.held = {}
            return losses

        def write(self, record: Dict[str, Any]) -> None:
            path = Path(spec.out) / RANKS_DIR / f"rank{dist.get_rank()}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")

    return CheckSchedule


def plant_defect() -> None:
    """The planted defect, if the test asked for one (module docstring)."""
    if os.environ.get(NOOP_VARIABLE):
        neutralize(os.environ[NOOP_VARIABLE])


def main() -> None:
    """bench-train's worker with the check's schedule and the planted defect if asked for."""
    bench_worker_main(check_schedule_class, plant_defect)


if __name__ == "__main__":
    main()
