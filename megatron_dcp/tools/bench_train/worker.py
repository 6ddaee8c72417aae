"""What each rank of a ``bench-train`` run executes: the training entry point (pretrain_gpt,
pretrain_mamba or pretrain_vlm, megatron's own loop) with three changes that make its arms
comparable.

- **Every global batch n times.** The training dataset is wrapped so that its global batch
  ``b`` is read ``n`` times in a row (n arms): iteration ``t`` reads batch ``(t − 1) // n``.
- **One arm per iteration.** The DCP wrapper's scheduler is an :class:`~.arms.ArmRotation`: each
  batch is planned by every arm under the run's cost model and run with the arm whose turn it
  is. Rank 0 writes every batch's plans (``plans.jsonl``, with each position's cost-model
  features, in total and per micro-batch), every step's busy time per position, in total and per
  micro-batch (``times.jsonl``; every step is timed, ``DCPConfig.time_steps``, also with
  ``--dcp-cost-adapt off``), and the cost model the run starts from (``prior.json``): what
  ``megatron-dcp replay-refinement`` replays.
- **Digests.** Each rank hashes the samples it reads, one digest per global batch read
  (``digests/rank<r>.txt``): the command checks that every arm of a batch saw the same samples.
  A vision-language sample's digest covers its pixels (``images``) and image slots too.

The command passes its settings in the environment (:data:`SPEC_VARIABLE`, JSON): megatron's
parser sees only megatron's and the DCP flags. ``perturb_arm`` (tests only) changes one token of
every sample that arm reads, so that the digest check can be seen to fail.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from megatron_dcp.tools.bench_train.arms import arm_at

SPEC_VARIABLE = "MEGATRON_DCP_BENCH"
PLANS_FILE = "plans.jsonl"
TIMES_FILE = "times.jsonl"
PRIOR_FILE = "prior.json"  # the cost model iteration 1 planned with (what refinement starts from)
DIGEST_DIR = "digests"
PROFILE_DIR = "profile"  # bench-train --profile's attributions and traces
TRACE_PREFIX = "trace_"  # a Chrome trace in PROFILE_DIR


@dataclass(frozen=True)
class BenchSpec:
    """The command's settings for its workers."""

    arms: Sequence[str]
    out: str
    entry: str = "pretrain_gpt"
    perturb_arm: Optional[str] = None
    profile_batches: Sequence[int] = ()  # global batches whose every arm is profiled

    def to_env(self) -> str:
        profiled = list(self.profile_batches)
        return json.dumps({**self.__dict__, "arms": list(self.arms), "profile_batches": profiled})

    @classmethod
    def from_env(cls) -> "BenchSpec":
        return cls(**json.loads(os.environ[SPEC_VARIABLE]))


class RepeatedBatches:
    """A training dataset whose global batches (``global_batch`` consecutive samples) each come
    ``len(arms)`` times in a row; the copy an arm reads may be perturbed (``perturb_arm``)."""

    def __init__(
        self, dataset: Any, global_batch: int, arms: Sequence[str], perturb_arm: Optional[str]
    ) -> None:
        self.dataset, self.global_batch = dataset, global_batch
        self.arms, self.perturb_arm = tuple(arms), perturb_arm

    def __len__(self) -> int:
        return len(self.dataset) * len(self.arms)

    def __getitem__(self, index: int) -> Any:
        served, within = divmod(index, self.global_batch)
        batch, arm = arm_at(served + 1, self.arms)
        sample = self.dataset[batch * self.global_batch + within]
        return perturbed(sample) if arm == self.perturb_arm else sample

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)  # sequence_length and the like


def perturbed(sample: dict) -> dict:
    tokens = sample["tokens"].clone()
    tokens.reshape(-1)[0] += 1
    return {**sample, "tokens": tokens}


def repeated_provider(provider: Callable, spec: BenchSpec, global_batch: int) -> Callable:
    """``provider`` (megatron's dataset provider) with its training set wrapped in
    :class:`RepeatedBatches`: it builds ``1 / n`` of the samples megatron asks for."""
    n = len(spec.arms)

    def provide(num_samples: List[int], vp_stage: Optional[int] = None) -> Any:
        train, valid, test = provider([num_samples[0] // n, *num_samples[1:]], vp_stage)
        return RepeatedBatches(train, global_batch, spec.arms, spec.perturb_arm), valid, test

    provide.is_distributed = getattr(provider, "is_distributed", False)
    return provide


class DigestingIterator:
    """Passes the samples of ``inner`` through, hashing them ``per_batch`` at a time; each
    finished batch's digest is appended to ``path`` as ``index digest``."""

    def __init__(self, inner: Iterator[Any], per_batch: int, path: Path) -> None:
        self.inner, self.per_batch, self.path = inner, per_batch, path
        self.hasher, self.seen, self.batches = hashlib.sha256(), 0, 0

    def __iter__(self) -> "DigestingIterator":
        return self

    def __next__(self) -> Any:
        from megatron_dcp.integration.forward_backward import as_sample
        from megatron_dcp.integration.vision_batches import IMAGES

        item = next(self.inner)
        sample = as_sample(item, vision=IMAGES in item)  # with its images and image slots
        for key in sorted(sample):
            self.hasher.update(sample[key].numpy().tobytes())
        self.seen += 1
        if self.seen == self.per_batch:
            with open(self.path, "a") as out:
                out.write(f"{self.batches} {self.hasher.hexdigest()}\n")
            self.hasher, self.seen, self.batches = hashlib.sha256(), 0, self.batches + 1
        return item


def bench_schedule_class(spec: BenchSpec, schedulers: Optional[Mapping[str, Any]] = None) -> type:
    """The DCP schedule of a benchmark run, the arms planned by ``schedulers`` (``arms.ARMS``)."""
    import torch.distributed as dist

    from megatron_dcp.integration.training.dcp_schedule import DCPSchedule
    from megatron_dcp.scheduling.cost_fit import CostProfile, save_profile
    from megatron_dcp.tools.bench_train.arms import ARMS, ArmRotation, as_record

    class BenchSchedule(DCPSchedule):
        """:class:`DCPSchedule` with the arms' scheduler and the digesting data iterator."""

        digests: Optional[DigestingIterator] = None

        def __call__(self, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                return super().__call__(**kwargs)
            kwargs["data_iterator"] = self.digesting(kwargs["data_iterator"], kwargs)
            step = functools.partial(super().__call__, **kwargs)
            return run_step(step, spec, self.calls + 1, kwargs["model"])

        def build(self, model: Any) -> Any:
            wrapper = super().build(model)
            base = wrapper.scheduler
            if dist.get_rank() == 0:
                source = {"by": "bench-train", "what": "the cost model iteration 1 planned with"}
                save_profile(str(Path(spec.out) / PRIOR_FILE), CostProfile(base.cost_model, source))
            wrapper.scheduler = ArmRotation(
                spec.arms,
                record=self.record_plans, schedulers=schedulers or ARMS,  # fmt: skip
                dp_size=base.domain.dp_size,
                cp_size=base.domain.cp_size,
                max_seqlen_per_dp_cp_rank=base.domain.max_seqlen_per_dp_cp_rank,
                min_cp_size=base.domain.min_cp_size,
                microbatch_group_size_per_vp_stage=base.microbatch_group_size_per_vp_stage,
                cost_model=base.cost_model,
            )
            return wrapper

        def digesting(self, data_iterator: Any, kwargs: dict) -> Any:
            first = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
            if self.digests is None or self.digests.inner is not first:
                per_batch = kwargs["num_microbatches"] * kwargs.get("micro_batch_size", 1)
                path = Path(spec.out) / DIGEST_DIR / f"rank{dist.get_rank()}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                self.digests = DigestingIterator(first, per_batch, path)
            if isinstance(data_iterator, list):
                return [self.digests, *data_iterator[1:]]
            return self.digests

        def refine(self, times: Any) -> None:
            """Record every position's busy forward-backward seconds, then refine as usual."""
            if dist.get_rank() == 0:
                append_line(Path(spec.out) / TIMES_FILE, times_record(self.calls, times))
            super().refine(times)

        def record_plans(self, batch: int, figures: Sequence[Any]) -> None:
            if dist.get_rank() == 0:
                append_line(Path(spec.out) / PLANS_FILE, as_record(batch, figures))

    return BenchSchedule


def run_step(step: Callable[[], Any], spec: BenchSpec, call: int, model: Any) -> Any:
    """Training call ``call`` (1-based), profiled when its batch is one of the spec's."""
    batch, arm = arm_at(call, spec.arms)
    if batch not in spec.profile_batches:
        return step()
    return profile_call(step, model, Path(spec.out), batch, arm)


def profile_call(step: Callable[[], Any], model: Any, out: Path, batch: int, arm: str) -> Any:
    """Run ``step`` under the profiler (``profiling``) and write this rank's attribution to
    ``out/profile/<arm>_b<batch>_rank<r>.json``; rank 0 also writes the call's Chrome trace."""
    import torch.distributed as dist

    from megatron_dcp.tools.bench_train.profiling import profiled

    figures: Dict[str, Any] = {}
    with profiled(model if isinstance(model, list) else [model], figures):
        result = step()
    rank, folder = dist.get_rank(), out / PROFILE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    trace = figures.pop("trace")
    record = {"arm": arm, "batch": batch, "rank": rank, **figures}
    (folder / f"{arm}_b{batch}_rank{rank}.json").write_text(json.dumps(record, indent=1))
    if rank == 0:
        trace.export_chrome_trace(str(folder / f"{TRACE_PREFIX}{arm}_b{batch}_rank0.json"))
    return result


def times_record(call: int, times: Any) -> Dict[str, Any]:
    """One line of ``times.jsonl``: a step's ``StepTimes`` (per position: the sum, per
    micro-batch, and the seconds no micro-batch claimed)."""
    return {
        "call": call,
        "times": times.totals,
        "microbatch_times": times.microbatches,
        "unclaimed": times.unclaimed,
    }


def append_line(path: Path, record: Dict[str, Any]) -> None:
    """Append ``record`` to the JSON-lines file ``path``."""
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def main(
    schedule_class_of: Callable[[BenchSpec], type] = bench_schedule_class,
    before_prepare: Optional[Callable[[], None]] = None,
) -> None:
    """Run the entry point named by the spec with the benchmark's dataset and the schedule
    ``schedule_class_of(spec)``; ``before_prepare`` runs once the entry point is imported (the
    CPU backend on) and before it parses the arguments (``megatron-dcp check``'s planted defect)."""
    import importlib

    spec = BenchSpec.from_env()
    entry = importlib.import_module(f"megatron_dcp.{spec.entry}")
    if before_prepare is not None:
        before_prepare()
    args, config, model_config = entry.prepare()
    from megatron_dcp.integration.training.entry import train

    provider, entry_model = entry_parts(entry, model_config)
    train(
        args,
        replace(config, time_steps=True),  # a benchmark measures, whatever --dcp-cost-adapt says
        model_config,
        datasets=repeated_provider(provider, spec, args.global_batch_size),
        schedule_class=schedule_class_of(spec),
        entry=entry_model,
    )


def entry_parts(entry: Any, model_config: Any) -> "tuple[Callable, Any]":
    """The dataset provider and the model the entry point's own ``main`` trains with: for
    ``pretrain_vlm``, its samples with images and LLaVA built through its model provider (as
    its ``main`` builds them); for the text entry points, training's datasets and no provider
    (the model comes from ``model_config``)."""
    from megatron_dcp.integration.training.entry import EntryModel, datasets_provider

    if not hasattr(entry, "vlm_datasets_provider"):
        return datasets_provider, None
    tiles = model_config.spec
    model = EntryModel(entry.model_provider(model_config), entry.vlm_forward_step, tiles)
    return entry.vlm_datasets_provider(tiles.tokens_per_tile), model


if __name__ == "__main__":
    main()
