"""The ``upstream`` group's verl entry for distillation: verl 0.9's top-k distillation loss under
dynamic CP.

verl 0.9.1 refuses distillation under dynamic CP (``_check_dcp_unsupported_features`` in
``verl/workers/engine/megatron/transformer_impl.py``: "Dynamic CP does not support
distillation"), and rightly so as it stands. Its language-model engine shards the student's
input, labels and logits on the micro-batch's dynamic CP group (``local_cp_size`` reaches
``gptmodel_forward_model_engine``), and gathers what the logits processor returns on that group
too; but the top-k loss the logits processor calls (``compute_forward_kl_topk`` in
``verl/trainer/distillation/megatron/losses.py``) shards the teacher's top-k log-probs and ids
with ``preprocess_thd_engine`` *without* ``local_cp_size``: on the static CP group. A rank of a
CP-1 group then pairs its whole sequences' logits with half of the teacher's rows (a shape
assertion, or wrong pairs where the lengths happen to agree), and a rank of a dynamic CP-2 group
whose static sibling is another rank takes the teacher chunk of the wrong CP rank.

The loss is never handed the CP size, but ``compute_topk_loss`` (``verl/trainer/distillation/
losses.py``), which dispatches to it, is handed the micro-batch, and the micro-batch carries
``local_cp_size`` (verl's ``DynamicCPScheduler``). So one entry replaces ``compute_topk_loss``:
under dynamic CP on Megatron it shards the teacher's tensors exactly as verl shards the student's
labels (``preprocess_thd_engine`` with the micro-batch's ``local_cp_size``, hence the dynamic
group's size and this rank's place in it; zigzag, the layout of every attention megatron-core
0.19 has) and then runs verl's own vocab-parallel KL; otherwise it is verl's own. Everything
after it was already right: the per-token losses are gathered on the dynamic group and
un-zigzagged per sequence by ``postprocess_thd_engine(local_cp_size=)``, and the token-mean over
the replicated batch's loss tokens is the actor's (docs/rl.md, "verl's distillation under DCP").
The refusal is then lifted by the one wrapper of verl's check (:mod:`.verl_refusals`), only
while this entry is applied (:func:`.verl_refusals.topk_loss_fixed`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Tuple

from megatron_dcp.integration.patches.table import Patch
from megatron_dcp.integration.patches.verl_refusals import (
    SHARDS_ON_GROUP,
    VERL_DISTILL,
    VERL_IMPORTED,
)

TOPK_LOSS = f"{VERL_DISTILL}:compute_topk_loss"
# What verl's vocab-parallel KL returns, in its order.
KL_OUTPUTS = (
    "distillation_losses",
    "student_mass",
    "teacher_mass",
    "overlap_count",
    "overlap_token_advantage",
)


def _teacher_on_group(tensor: Any, local_cp_size: int) -> Any:
    """This rank's rows of a nested teacher tensor ``[samples, len, k]``, cut as verl cuts the
    student's labels of a DCP micro-batch."""
    from verl.models.mcore.util import preprocess_thd_engine

    if not getattr(tensor, "is_nested", False):
        raise RuntimeError(
            "verl's teacher top-k tensors are not nested under dynamic CP: they must be "
            "[samples, len, k] as verl's left_right_2_no_padding makes them"
        )
    rows, *_ = preprocess_thd_engine(tensor, pre_process=True, local_cp_size=local_cp_size)
    return rows


def topk_loss_on_group(
    distillation_config: Any, data: Any, student_logits: Any, data_format: str, local_cp_size: int
) -> Dict[str, Any]:
    """verl's per-token top-k forward KL of one DCP micro-batch, the teacher's rows cut on the
    micro-batch's CP group: each output ``[1, local tokens]``, like the student's logits."""
    from verl.trainer.distillation.megatron import losses as megatron_losses

    if data_format != "thd":
        raise RuntimeError(
            "verl's top-k distillation under dynamic CP needs the THD format; set "
            f"use_remove_padding=True (got data_format={data_format!r})"
        )
    log_probs = _teacher_on_group(data["teacher_logprobs"], local_cp_size)
    ids = _teacher_on_group(data["teacher_ids"], local_cp_size)
    rows = tuple(student_logits.shape[:2])
    if tuple(log_probs.shape[:2]) != rows or tuple(ids.shape[:2]) != rows:
        raise RuntimeError(
            "the teacher's top-k rows do not match the student's logits on this rank under "
            f"dynamic CP: {tuple(log_probs.shape[:2])} and {rows}"
        )
    clamp = distillation_config.distillation_loss.log_prob_min_clamp
    kl = megatron_losses._VocabParallelKLDivergence  # verl's vocab-parallel top-k KL
    outputs = kl.apply(student_logits, log_probs, ids, clamp)
    return dict(zip(KL_OUTPUTS, outputs))


def _micro_batch_cp_size(data: Any) -> Any:
    """The dynamic CP size verl's scheduler put on a micro-batch; None without DCP."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key="local_cp_size", default=None)


def _topk_loss(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``compute_topk_loss``: its own without DCP or off Megatron; on a DCP micro-batch
    on Megatron, :func:`topk_loss_on_group`."""

    @functools.wraps(original)
    def compute_topk_loss(config, distillation_config, data, student_logits, data_format):
        local_cp_size = _micro_batch_cp_size(data)
        if config.strategy != "megatron" or local_cp_size is None:
            return original(config, distillation_config, data, student_logits, data_format)
        return topk_loss_on_group(
            distillation_config, data, student_logits, data_format, local_cp_size
        )

    setattr(compute_topk_loss, SHARDS_ON_GROUP, True)
    return compute_topk_loss


VERL_DISTILL_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "upstream_verl_distill_topk",
        "upstream",
        (TOPK_LOSS,),
        "verl 0.9's Megatron top-k distillation loss shards the teacher's top-k log-probs and "
        "ids without the micro-batch's local_cp_size, i.e. on the static CP group, while the "
        "student's logits are on the micro-batch's dynamic CP group.",
        _topk_loss,
        when=VERL_IMPORTED,
    ),
)
