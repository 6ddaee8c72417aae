"""Distillation under DCP: per-token KL between the student and a teacher's log-probabilities.

The teacher's log-probabilities come per sample, in the caller's order: from the rollout engine,
or from a teacher forward under DCP with its own plan, brought back by ``merge_outputs`` (top-k
per token: :func:`teacher_top_k` before the merge keeps the gather small). They meet the
student's layout through ``shard_per_token`` for each student micro-batch, whatever either plan
was: nothing is recomputed to make the plans match. The per-token KL then goes through
``masked_mean_loss`` with the response mask, normalised over the mini-batch's tokens.

Two forms of the teacher, per token:

- full log-probabilities ``[1, T_local, V]`` (small vocabularies): the exact KL;
- top-k log-probabilities and their token ids ``[1, T_local, k]``: the KL over the teacher's
  top-k tokens (forward KL weights them by the teacher, reverse KL by the student; neither is
  renormalised).

Under tensor parallelism megatron's logits are split over the vocabulary;
:func:`full_vocab_logits` gathers them (every TP rank then computes the same loss and keeps its
slice's gradient): memory grows with the vocabulary, as for the full-logits form itself.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

Direction = Literal["forward", "reverse"]


def full_vocab_logits(logits: torch.Tensor) -> torch.Tensor:
    """The student's logits over the whole vocabulary on every TP rank (identity at TP 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def teacher_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely tokens per position: ``(log_probs, ids)``, each
    ``[..., k]``, from its full-vocabulary logits (detached: the teacher is not trained)."""
    log_probs = torch.log_softmax(logits.detach().float(), dim=-1)
    if not 0 < k <= log_probs.shape[-1]:
        raise ValueError(f"k={k}: use 1 <= k <= the vocabulary ({log_probs.shape[-1]})")
    return torch.topk(log_probs, k, dim=-1)


def kl_per_token(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    teacher_ids: Optional[torch.Tensor] = None,
    direction: Direction = "forward",
) -> torch.Tensor:
    """KL per token, ``[1, T_local]``. ``student_logits``: ``[1, T_local, V]`` over the whole
    vocabulary (:func:`full_vocab_logits`). ``teacher_log_probs``: ``[1, T_local, V]``, or
    ``[1, T_local, k]`` with ``teacher_ids`` (top-k). ``direction``: ``"forward"``,
    KL(teacher ‖ student), or ``"reverse"``, KL(student ‖ teacher)."""
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction={direction!r}: use 'forward' or 'reverse'")
    student = torch.log_softmax(student_logits.float(), dim=-1)
    if teacher_ids is not None:
        student = torch.gather(student, -1, teacher_ids.to(student.device).long())
    teacher = teacher_log_probs.to(student.device).float()
    if student.shape != teacher.shape:
        raise ValueError(
            f"teacher_log_probs has shape {tuple(teacher.shape)}; expected {tuple(student.shape)}"
            " (the student's local tokens; top-k needs teacher_ids of the same shape)"
        )
    if direction == "forward":
        return (teacher.exp() * (teacher - student)).sum(-1)
    return (student.exp() * (student - teacher)).sum(-1)
