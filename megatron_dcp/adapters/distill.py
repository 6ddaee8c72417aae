"""Distillation under DCP: per-token KL between the student and a teacher's log-probabilities.

The teacher's log-probabilities come per sample, in the caller's order: from the rollout engine,
or from a teacher forward under DCP with its own plan, brought back by ``merge_outputs`` (top-k
per token: :func:`teacher_top_k` before the merge keeps the gather small). They meet the
student's layout through ``shard_per_token`` for each student micro-batch, whatever either plan
was: nothing is recomputed to make the plans match. The per-token KL then goes through
``masked_mean_loss``, normalised over the mini-batch's response tokens, with the response mask
moved one place left (``to_state_positions``, before ``shard_per_token``): position ``t``'s
distributions, the student's and the teacher's, are over token ``t + 1``, so response token
``t + 1`` is scored at position ``t`` (verl's positions too; docs/rl.md, "Distillation").

Two forms of the teacher, per token:

- full log-probabilities ``[1, T_local, V]`` (small vocabularies): the exact KL;
- top-k log-probabilities and their token ids ``[1, T_local, k]``: the KL over the teacher's
  top-k tokens (forward KL weights them by the teacher, reverse KL by the student; neither is
  renormalised).

Under tensor parallelism megatron's logits are split over the vocabulary. Two ways:

- ``vocab_parallel=True`` (:func:`kl_per_token`, :func:`teacher_top_k`): each TP rank keeps its
  vocabulary shard; the log-softmax's normaliser, the student's log-probabilities at the
  teacher's ids and the KL's sum over the vocabulary are per-token all-reduces over the TP group
  (a few floats per token), as megatron's vocabulary-parallel cross entropy does it;
- :func:`full_vocab_logits` gathers the vocabulary on every TP rank first: simpler, but memory
  grows with the vocabulary.

Either way every TP rank computes the same loss and back-propagates into its own shard only.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.distributed as dist

Direction = Literal["forward", "reverse"]


def full_vocab_logits(logits: torch.Tensor) -> torch.Tensor:
    """The student's logits over the whole vocabulary on every TP rank (identity at TP 1)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if _tp_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def teacher_top_k(
    logits: torch.Tensor, k: int, vocab_parallel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely tokens per position: ``(log_probs, ids)``, each
    ``[..., k]``, detached (the teacher is not trained). ``logits``: over the whole vocabulary,
    or with ``vocab_parallel`` this TP rank's shard (each shard's top k, gathered, then the top k
    of those: the same tokens, ids global)."""
    logits = logits.detach().float()
    if not vocab_parallel or _tp_size() == 1:
        log_probs = torch.log_softmax(logits, dim=-1)
        _check_k(k, log_probs.shape[-1])
        return torch.topk(log_probs, k, dim=-1)
    _check_k(k, logits.shape[-1])
    values, ids = torch.topk(_vocab_parallel_log_softmax(logits), k, dim=-1)
    ids = ids + _vocab_start(logits)
    group = _tp_group()
    all_values = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    all_ids = [torch.empty_like(ids) for _ in all_values]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    best, where = torch.topk(torch.cat(all_values, -1), k, dim=-1)
    return best, torch.gather(torch.cat(all_ids, -1), -1, where)


def kl_per_token(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    teacher_ids: Optional[torch.Tensor] = None,
    direction: Direction = "forward",
    vocab_parallel: bool = False,
) -> torch.Tensor:
    """KL per token, ``[1, T_local]``. ``student_logits``: ``[1, T_local, V]`` over the whole
    vocabulary, or with ``vocab_parallel`` this TP rank's shard ``[1, T_local, V / TP]``
    (megatron's output). ``teacher_log_probs``: ``[1, T_local, V]`` (the whole vocabulary also
    under ``vocab_parallel``), or ``[1, T_local, k]`` with ``teacher_ids`` (top-k, global ids).
    ``direction``: ``"forward"``, KL(teacher ‖ student), or ``"reverse"``, KL(student ‖
    teacher)."""
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction={direction!r}: use 'forward' or 'reverse'")
    sharded = vocab_parallel and _tp_size() > 1
    logits = student_logits.float()
    student = _vocab_parallel_log_softmax(logits) if sharded else torch.log_softmax(logits, -1)
    teacher = teacher_log_probs.to(student.device).float()
    if teacher_ids is not None:
        ids = teacher_ids.to(student.device).long()
        student = _at_ids(student, ids, sharded)
    elif sharded:
        start = _vocab_start(logits)
        teacher = teacher[..., start : start + logits.shape[-1]]
    if student.shape != teacher.shape:
        raise ValueError(
            f"teacher_log_probs has shape {tuple(teacher_log_probs.shape)}; expected the "
            "student's local tokens and vocabulary (top-k needs teacher_ids of its shape)"
        )
    if direction == "forward":
        terms = teacher.exp() * (teacher - student)
    else:
        terms = student.exp() * (student - teacher)
    total = terms.sum(-1)
    return _tp_sum(total) if sharded and teacher_ids is None else total


def _check_k(k: int, vocabulary: int) -> None:
    if not 0 < k <= vocabulary:
        raise ValueError(f"k={k}: use 1 <= k <= the vocabulary (shard) size ({vocabulary})")


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _tp_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group; the backward hands each rank the gradient as is (each rank's
    copy of the loss back-propagates into its own shard only)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(tensor)


def _vocab_start(shard: torch.Tensor) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() * shard.shape[-1]


def _vocab_parallel_log_softmax(shard: torch.Tensor) -> torch.Tensor:
    """This shard's log-probabilities: the normaliser over the whole vocabulary from two
    per-token all-reduces (the maximum, held constant, and the sum of exponentials). The
    normaliser, the same on every TP rank, enters this rank's partial sums, so its gradient is
    summed over the TP group in the backward (megatron's copy-to-region): each rank's partial
    sum sees only its own share of it."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    peak = shard.detach().max(-1, keepdim=True).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=_tp_group())
    normaliser = peak + _tp_sum((shard - peak).exp().sum(-1, keepdim=True)).log()
    return shard - copy_to_tensor_model_parallel_region(normaliser)


def _at_ids(log_probs: torch.Tensor, ids: torch.Tensor, sharded: bool) -> torch.Tensor:
    """The log-probabilities at global ``ids``: gathered locally, or under ``sharded`` by the
    shard that holds each id and summed over the TP group (the others add 0)."""
    if not sharded:
        return torch.gather(log_probs, -1, ids)
    local = ids - _vocab_start(log_probs)
    inside = (local >= 0) & (local < log_probs.shape[-1])
    picked = torch.gather(log_probs, -1, local.clamp(0, log_probs.shape[-1] - 1))
    return _tp_sum(picked * inside)
