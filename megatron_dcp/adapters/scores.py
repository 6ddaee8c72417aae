"""Reward models under DCP: one score per sample, read at the sample's last token.

The adapter's samples carry no padding (packing adds it), so a sample's last token is its last
non-padding token. Under CP that token lives on one rank of its CP group: the zigzag chunk that
holds it. :func:`last_token_marks` marks it there, laid out like the packed tokens as
``shard_per_token`` lays out per-token values (built for the micro-batch's own samples only),
so every rank knows which of its tokens carry a score without asking.

- **Pointwise losses** (e.g. a regression to a target score) need no communication: the rank
  holding a sample's last token owns its score, ``masked_mean_loss`` with the marks as the mask
  and the sample count as the count gives the loss of the mini-batch, and the gradient
  all-reduce sums the owners' contributions.
- **Scores on every rank** (:func:`gather_scores`): one all-reduce of one float per sample over
  the DP×CP domain, instead of ``merge_outputs``' all-gather of every token.
- **Losses that couple samples** (Bradley–Terry pairs whose chosen and rejected responses landed
  in different CP groups or micro-batches): :func:`score_loss_backward` gathers the scores (the
  all-reduce above), takes the loss and its gradient per score on every rank, and back-propagates
  ``Σ_j (∂loss/∂s_j) · s_j`` from the owners, through every micro-batch's graph. That is the
  loss's exact gradient, with no second forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.adapters.heads import scalar_outputs
from megatron_dcp.adapters.loss import GradReduce
from megatron_dcp.adapters.split import SplitBatch, shard_packed
from megatron_dcp.runtime.groups import DCPGroups


def last_token_marks(split: SplitBatch, index: int) -> torch.Tensor:
    """``[1, T_local]`` int64 for micro-batch ``index``: ``j + 1`` at sample ``j``'s last token
    on the rank that holds it, 0 elsewhere (padding and every other token)."""
    _check_non_empty(split.plan.seqlens)
    microbatch = split.microbatches[index]
    marks = []
    for sample_id in microbatch.sample_ids:  # only this micro-batch's samples are laid out
        mark = torch.zeros(split.plan.seqlens[sample_id], dtype=torch.int64)
        mark[-1] = sample_id + 1
        marks.append(mark)
    return shard_packed(marks, microbatch, torch.zeros(0, dtype=torch.int64), 0)


def last_token_mask(split: SplitBatch, index: int) -> torch.Tensor:
    """``[1, T_local]`` float: 1 at the last tokens this rank holds in micro-batch ``index``."""
    return (last_token_marks(split, index) > 0).float()


def local_scores(
    output: torch.Tensor, split: SplitBatch, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores this rank owns in micro-batch ``index``: ``(sample_ids, scores)``, the scores
    differentiable; ``output`` is the model's ``[1, T_local]`` or ``[1, T_local, 1]``."""
    marks = last_token_marks(split, index).to(output.device)
    flat = _per_token(output, marks)
    held = marks > 0
    return marks[held] - 1, flat[held]


def gather_scores(
    outputs: Sequence[torch.Tensor], split: SplitBatch, groups: DCPGroups
) -> torch.Tensor:
    """Every sample's score on every rank, ``[num_samples]`` float32, detached: each rank writes
    the scores it owns, and one all-reduce of ``num_samples`` floats over the domain (each score
    has exactly one owner) completes them. Collective over the domain."""
    scores = torch.zeros(split.num_samples, dtype=torch.float32)
    for index, output in enumerate(outputs):
        ids, values = local_scores(output.detach(), split, index)
        scores[ids.cpu()] = values.float().cpu()
    if groups.domain_size > 1:
        device = outputs[0].device if outputs else scores.device
        scores = scores.to(device)
        dist.all_reduce(scores, group=groups.group(groups.domain_size))
    return scores


def score_surrogate(
    outputs: Sequence[torch.Tensor], split: SplitBatch, coefficients: torch.Tensor
) -> torch.Tensor:
    """``Σ_j coefficients[j] · s_j`` over the scores this rank owns, as one scalar whose graph
    reaches every micro-batch's output (so every rank of a CP group runs its backward)."""
    total = None
    for index, output in enumerate(outputs):
        marks = last_token_marks(split, index).to(output.device)
        weights = torch.cat([coefficients.new_zeros(1), coefficients])[marks].to(output.device)
        term = (_per_token(output, marks).float() * weights).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("score_surrogate: outputs is empty; pass one output per micro-batch")
    return total


def score_loss_backward(
    outputs: Sequence[torch.Tensor],
    split: SplitBatch,
    groups: DCPGroups,
    loss_of_scores: Callable[[torch.Tensor], torch.Tensor],
    grad_reduce: GradReduce = "sum",
) -> torch.Tensor:
    """Back-propagate ``loss_of_scores(every sample's score)`` through every micro-batch's
    output and return the loss (detached). ``grad_reduce``: what the DP×CP gradient all-reduce
    does (``"mean"``, megatron DDP's default, divides by the domain size: made up here)."""
    scores = gather_scores(outputs, split, groups).requires_grad_(True)
    loss = loss_of_scores(scores)
    (coefficients,) = torch.autograd.grad(loss, scores)
    scale = split.plan.domain.size if grad_reduce == "mean" else 1
    score_surrogate(outputs, split, coefficients.detach() * scale).backward()
    return loss.detach()


def bradley_terry_loss(scores: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The pairwise reward-model loss ``mean over (chosen, rejected) of −log σ(s_c − s_r)``."""
    if not pairs:
        raise ValueError("pairs is empty; pass (chosen sample id, rejected sample id) pairs")
    chosen = torch.tensor([c for c, _ in pairs], device=scores.device)
    rejected = torch.tensor([r for _, r in pairs], device=scores.device)
    return -torch.nn.functional.logsigmoid(scores[chosen] - scores[rejected]).mean()


def _per_token(output: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """The model's output as ``[1, T_local]`` (a trailing width-1 head squeezed; a wider head
    refused, not cut to its first column)."""
    flat = scalar_outputs(output, 2, "output")
    if flat.shape != marks.shape:
        raise ValueError(
            f"output has shape {tuple(output.shape)}; expected {tuple(marks.shape)} or "
            f"{tuple(marks.shape) + (1,)} (one score per local token of the micro-batch)"
        )
    return flat


def _check_non_empty(seqlens: Sequence[int]) -> None:
    empty = [i for i, length in enumerate(seqlens) if length == 0]
    if empty:
        raise ValueError(
            f"samples {empty[:8]} have no tokens: a reward model reads each sample's score at "
            "its last token; drop empty samples before split_batch"
        )
