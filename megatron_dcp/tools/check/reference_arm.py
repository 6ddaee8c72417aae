"""The reference arm of ``megatron-dcp check``: the trained model run outside DCP, in float64.

    python -m megatron_dcp.tools.check.reference_arm --out RUN_FOLDER --precision fp32|bf16|fp16

After a layout's run, this process (a fresh interpreter, no GPU visible: it computes on the CPU)
reads what the workers left (``tools.check.reference_records``): the model's description, its
weights, every global batch's samples as the data loader delivered them, and the static and DCP
arms' gradients. It builds the same GPT from megatron-core's own local layer spec (megatron's
``DotProductAttention``: none of this package's attention, no packing, no CP, no pipeline) in one
rank, and runs every sample on its own (``[1, L]``, causal, unpadded), summing the masked token
losses. Of this package it uses only the CPU stand-ins that let megatron-core run without CUDA
(patch group ``cpu_backend``); it checks that no other patch-table entry is applied here.

Each batch runs three times: in float64 (the exact values) and at the run's precision with the
samples in two orders, which measures what rounding does to the reference itself
(``tools.check.rounding``). Each arm's loss and every rank's gradient of every tensor is then
compared with the exact values (``tools.check.tolerance``: within ``ERROR_FACTOR`` times that
rounding, floored at ``FLOOR_ULPS`` ulps of the run's precision). The findings go to
``reference/findings.json``, one entry per quantity.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

import torch

from megatron_dcp.tools.check import reference_records as records
from megatron_dcp.tools.check.rounding import ExactRun, add_gradients, exact_run
from megatron_dcp.tools.check.rounding import largest_difference
from megatron_dcp.tools.check.rounding import largest_magnitude, to_dtype

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RUNTIME_GROUPS = ("training", "cpu_training", "dcp", "pipeline", "upstream")  # never applied here
SEED = 1234


def reference_config(config: Any) -> Any:
    """The run's ``TransformerConfig`` on one rank, float32, with megatron-core's unfused local
    code paths (the reference computes on the CPU)."""
    return dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )


def unsupported(config: Any) -> List[str]:
    """What the reference model cannot build (each makes the arm refuse, not guess)."""
    found = []
    if config.mtp_num_layers:
        found.append("multi-token prediction (--mtp-num-layers)")
    if getattr(config, "experimental_attention_variant", None):
        found.append(f"the attention variant {config.experimental_attention_variant}")
    if config.num_moe_experts:
        found.append("mixture of experts (--num-experts)")
    return found


def build_reference_model(description: Mapping[str, Any]) -> torch.nn.Module:
    """The run's GPT on one rank from megatron's local layer spec (needs ``init_megatron``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = reference_config(description["transformer"])
    spec = get_gpt_layer_local_spec(
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
    )
    return GPTModel(config=config, transformer_layer_spec=spec, **description["gpt"])


def load_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy the run's weights in; the names must match the reference model's exactly."""
    names = dict(model.named_parameters())
    if names.keys() != weights.keys():
        missing, extra = sorted(names.keys() - weights), sorted(weights.keys() - names)
        raise ValueError(f"the run's weights do not fit the reference model: missing "
                         f"{missing}, not in the reference {extra}")  # fmt: skip
    shapes = [n for n, p in names.items() if p.shape != weights[n].shape]
    if shapes:
        raise ValueError(f"the run's weights do not fit the reference model: shapes of {shapes}")
    with torch.no_grad():
        for name, param in names.items():
            param.copy_(weights[name])


def reference_pass(
    description: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    samples: Sequence[Mapping[str, torch.Tensor]],
    dtype: torch.dtype,
) -> tuple:
    """One pass at ``dtype``: (summed masked loss, loss tokens, gradients by name, float64).
    Mixed precision as megatron trains it: parameters and compute in ``dtype``, each sample's
    gradient (in ``dtype``) added to float32 sums, as megatron's DDP adds each micro-batch's
    gradient to its float32 ``main_grad``; the float64 pass sums in float64."""
    model = build_reference_model(description)
    load_weights(model, weights)
    to_dtype(model, dtype)
    summing = torch.float64 if dtype == torch.float64 else torch.float32
    sums: Dict[str, torch.Tensor] = {}
    total, tokens = 0.0, 0
    for sample in samples:
        length = sample["tokens"].numel()
        if length == 0:
            continue
        losses = model(
            input_ids=sample["tokens"].view(1, -1),
            position_ids=torch.arange(length).view(1, -1),
            attention_mask=None,
            labels=sample["labels"].view(1, -1),
        )
        mask = sample["loss_mask"].view(1, -1).to(summing)
        loss = (losses.to(summing) * mask).sum()  # the run sums its losses in float32
        loss.backward()
        add_gradients(model, sums, summing)
        total += float(loss)
        tokens += int((sample["loss_mask"] != 0).sum())
    return total, tokens, {name: grad.double() for name, grad in sums.items()}


def batch_reference(
    description: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    samples: Sequence[Mapping[str, torch.Tensor]],
    dtype: torch.dtype,
) -> tuple:
    """(ExactRun of the batch, loss tokens): float64, and ``dtype`` in two sample orders."""
    exact_loss, tokens, exact = reference_pass(description, weights, samples, torch.float64)
    rounded = []
    for order in (samples, samples[::-1]):
        loss, _, grads = reference_pass(description, weights, order, dtype)
        rounded.append((loss, grads))
    return exact_run(exact_loss, exact, rounded), tokens


def compare_batch(
    batch: int, reference: ExactRun, tokens: int, by_rank: Mapping[int, Any], eps: float
) -> List[Dict[str, Any]]:
    """Every arm's loss and every rank's gradients against the exact values. megatron's
    gradients are of the loss sum over the global token count (its per-token loss), so the
    reference's are divided by it."""
    check_coverage(reference, by_rank)
    found = []
    for rank, by_arm in sorted(by_rank.items()):
        for arm, ((loss_sum, arm_tokens), grads) in sorted(by_arm.items()):
            if rank == 0:
                found.append(finding(batch, arm, rank, "loss", abs(reference.loss_sum),
                                     reference.loss_error, abs(loss_sum - reference.loss_sum),
                                     eps, tokens=(arm_tokens, tokens)))  # fmt: skip
            for name, grad in grads.items():
                exact = reference.tensors[name] / tokens
                found.append(finding(batch, arm, rank, name, largest_magnitude(exact),
                                     reference.errors[name] / tokens,
                                     largest_difference(grad, exact), eps))  # fmt: skip
    return found


def check_coverage(reference: ExactRun, by_rank: Mapping[int, Any]) -> None:
    """Every arm's ranks together hold every tensor of the reference, and none it lacks."""
    arms = sorted({arm for by_arm in by_rank.values() for arm in by_arm})
    for arm in arms:
        held = {name for by_arm in by_rank.values() for name in by_arm.get(arm, (0, {}))[1]}
        expected = reference.tensors.keys()
        missing, extra = sorted(expected - held), sorted(held - expected)
        if missing or extra:
            raise ValueError(f"{arm}'s ranks hold other gradients than the reference: missing "
                             f"{missing}, not in the reference {extra}")  # fmt: skip


def finding(batch: int, arm: str, rank: int, name: str, magnitude: float, rounding: float,
            difference: float, eps: float, **extra: Any) -> Dict[str, Any]:  # fmt: skip
    where = {"batch": batch, "arm": arm, "rank": rank, "name": name}
    figures = {"magnitude": magnitude, "rounding": rounding, "difference": difference, "eps": eps}
    return {**where, **figures, **extra}


def outside_runtime() -> None:
    """Raise if any patch-table entry beyond the CPU stand-ins is applied in this process."""
    from megatron_dcp.integration.patches import entries
    from megatron_dcp.integration.patches.table import is_applied

    applied = [e.name for e in entries(*RUNTIME_GROUPS) if is_applied(e)]
    if applied:
        raise RuntimeError(f"the reference arm runs inside the patch table: {applied}")


def reference_worker(rank: int, world_size: int, out: str, precision: str) -> List[dict]:
    from megatron_dcp.integration.model_parallel import init_megatron

    init_megatron(seed=SEED)
    outside_runtime()
    description = records.load_model(Path(out))
    problems = unsupported(description["transformer"])
    if problems:
        raise ValueError(f"the reference arm cannot build {', '.join(problems)}")
    weights, dtype = records.load_weights(Path(out)), PRECISIONS[precision]
    found = []
    for batch, samples in sorted(records.load_samples(Path(out)).items()):
        reference, tokens = batch_reference(description, weights, samples, dtype)
        by_rank = records.load_gradients(Path(out), batch)
        found += compare_batch(batch, reference, tokens, by_rank, torch.finfo(dtype).eps)
    return found


def main(argv: Sequence[str] = ()) -> int:
    from megatron_dcp.tools.launching.local_ranks import run_distributed

    parser = argparse.ArgumentParser(description="check's reference arm (module docstring)")
    parser.add_argument("--out", type=Path, required=True, help="the layout's run folder")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--timeout", type=float, default=600.0)
    options = parser.parse_args(list(argv))
    (found,) = run_distributed(
        reference_worker, 1, str(options.out), options.precision,
        backend="gloo", timeout_s=options.timeout,  # fmt: skip
    )
    records.findings_path(options.out).write_text(json.dumps(found) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
