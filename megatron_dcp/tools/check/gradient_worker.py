"""What each rank of a ``megatron-dcp check`` run executes: ``bench-train``'s worker (every
global batch once per arm, digests, plans and times recorded: ``tools.bench_train.worker``) with
the arms of ``tools.check.reordered`` and, after every training step, the step's global loss and
this rank's gradients kept until every arm has run the batch; then one JSON line per batch in
``check/rank<r>.jsonl``: the loss of each arm and, per gradient tensor of this rank, its largest
magnitude under static CP and the largest distance of static CP reordered and of DCP from it.

The run trains with ``--lr 0`` (the command sets it), so every arm of a batch starts from the same
weights. The gradients are megatron's after its finalisation (``main_grad``: summed over DP×CP
and divided by the global token count), read where the schedule returns.

For the reference arm (``tools.check.reference_arm``) the workers also leave the model's
description, their weights, every batch's samples as the data loader delivered them and the
static and DCP arms' gradients by single-process name (``tools.check.reference_records``).

Planted defects (tests only): ``tools.check.planted_defects``, applied before training applies
the patch table, so that ``check`` can be seen to fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.bench_train.worker import BenchSpec, bench_schedule_class
from megatron_dcp.tools.bench_train.worker import main as bench_worker_main
from megatron_dcp.tools.check import reference_records as records
from megatron_dcp.tools.check.global_names import by_global_name, unwrap
from megatron_dcp.tools.check.layout_runs import RANKS_DIR
from megatron_dcp.tools.check.planted_defects import plant_from_environment
from megatron_dcp.tools.check.reordered import REORDERED, check_schedulers

Held = Tuple[Tuple[float, int], Dict[str, torch.Tensor]]
REFERENCE_ARMS = ("static", "dcp")  # the arms compared with the reference arm


def rank_gradients(model: Any) -> Dict[str, torch.Tensor]:
    """This rank's gradient of every parameter (float64 copies), by single-process name, of the
    loss itself: with fp16 megatron's ``main_grad`` holds the gradient of the loss times the
    loss scale until the optimizer step unscales it, so it is divided by that scale here."""
    chunks = model if isinstance(model, list) else [model]
    scale = loss_scale(chunks[0])
    return {name: grad.double() / scale for name, grad in by_global_name(chunks, True).items()}


def loss_scale(model: Any) -> float:
    """The factor the step's backward pass scaled the loss by (1 without a loss scaler): what the
    optimizer's ``grad_scale_func`` makes of a loss of 1."""
    from megatron.core.utils import get_model_config

    scale = get_model_config(model).grad_scale_func
    return 1.0 if scale is None else float(scale(torch.ones(1)))


class SampleRecorder:
    """Passes the items of ``inner`` through and saves each global batch's samples as read the
    first time (``arms`` copies of every batch come in a row, ``per_batch`` samples each; the
    DCP wrapper may read a batch ahead of its step, so the samples are counted, not timed)."""

    def __init__(self, inner: Any, per_batch: int, arms: int, out: Path) -> None:
        self.inner, self.per_batch, self.arms, self.out = inner, per_batch, arms, out
        self.samples: list = []
        self.read = 0

    def __iter__(self) -> "SampleRecorder":
        return self

    def __next__(self) -> Any:
        from megatron_dcp.integration.forward_backward import as_sample

        item = next(self.inner)
        served, _ = divmod(self.read, self.per_batch)
        self.read += 1
        if served % self.arms == 0:  # the first copy of batch served // arms
            self.samples.append({k: v.clone() for k, v in as_sample(item).items()})
            if len(self.samples) == self.per_batch:
                records.save_samples(self.out, served // self.arms, self.samples)
                self.samples = []
        return item


def save_reference_inputs(out: Path, model: Any) -> None:
    """The model's description (rank 0) and this rank's weights, once, before the first step."""
    import torch.distributed as dist

    chunks = model if isinstance(model, list) else [model]
    if dist.get_rank() == 0:
        records.save_model(out, unwrap(chunks[0]))
    records.save_weights(out, dist.get_rank(), by_global_name(chunks, False))


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
            self.recorder: Optional[SampleRecorder] = None

        def __call__(self, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                return super().__call__(**kwargs)
            if self.calls == 0:
                save_reference_inputs(Path(spec.out), kwargs["model"])
            losses = super().__call__(**kwargs)
            batch, arm = arm_at(self.calls, spec.arms)
            self.held[arm] = (global_loss(losses), rank_gradients(kwargs["model"]))
            if len(self.held) == len(spec.arms):
                self.write(batch_record(batch, self.held))
                self.save_gradients(batch)
                self.held = {}
            return losses

        def digesting(self, data_iterator: Any, kwargs: dict) -> Any:
            """bench-train's digesting iterator; on rank 0 its samples also recorded."""
            digesting = super().digesting(data_iterator, kwargs)
            if dist.get_rank() != 0:
                return digesting
            first = digesting[0] if isinstance(digesting, list) else digesting
            if self.recorder is None or self.recorder.inner is not first:
                per_batch = kwargs["num_microbatches"] * kwargs.get("micro_batch_size", 1)
                self.recorder = SampleRecorder(first, per_batch, len(spec.arms), Path(spec.out))
            if isinstance(digesting, list):
                return [self.recorder, *digesting[1:]]
            return self.recorder

        def save_gradients(self, batch: int) -> None:
            by_arm = {
                arm: (loss, {name: grad.float() for name, grad in grads.items()})
                for arm, (loss, grads) in self.held.items()
                if arm in REFERENCE_ARMS
            }
            records.save_gradients(Path(spec.out), batch, dist.get_rank(), by_arm)

        def write(self, record: Dict[str, Any]) -> None:
            path = Path(spec.out) / RANKS_DIR / f"rank{dist.get_rank()}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")

    return CheckSchedule


def main() -> None:
    """bench-train's worker with the check's schedule and the planted defect if asked for."""
    bench_worker_main(check_schedule_class, plant_from_environment)


if __name__ == "__main__":
    main()
