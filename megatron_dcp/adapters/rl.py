"""The RL/post-training adapter: DCP for engines where every rank holds the whole mini-batch.

One mini-batch, on every rank of the DP×CP domain::

    config = DCPConfig.for_model(model.config, budget, vocab_size=vocab)  # the model's cost model
    split = split_batch(samples, groups, config)            # plan + this rank's micro-batches
    for mb in split.microbatches:                           # CP size may differ per micro-batch
        out = model(..., packed_seq_params=mb.packed_seq_params)
        token_mean_loss(out, mb, split).backward()           # scale: see docs/rl.md
    log_probs = merge_outputs(local_log_probs, split, groups) # per sample, in order, every rank

``split`` (planning and packing), ``merge`` (gathering outputs) and ``loss`` (normalisation)
hold the code; this module is the public surface. Plans use ``config.cost_model``: the trained
model's shape on the backend's hardware profile unless a cost model (e.g. a calibrated profile,
``cost_fit.load_profile(path).cost``, or the one a training run refined) is passed as
``DCPConfig.for_model(..., cost_model=...)``.
"""

from megatron_dcp.adapters.distill import full_vocab_logits, kl_per_token, teacher_top_k
from megatron_dcp.adapters.heads import SCALAR_HEAD_WIDTH, ScalarHead, attach_scalar_head
from megatron_dcp.adapters.loss import (
    GradReduce,
    masked_mean_loss,
    split_loss_scale,
    token_mean_loss,
    token_mean_scale,
)
from megatron_dcp.adapters.merge import GroupPacking, group_packing, merge_outputs, reassemble
from megatron_dcp.adapters.scores import (
    bradley_terry_loss,
    gather_scores,
    last_token_marks,
    last_token_mask,
    local_scores,
    score_loss_backward,
    score_surrogate,
)
from megatron_dcp.adapters.split import (
    DCPConfig,
    RankMicroBatch,
    SplitBatch,
    global_num_tokens,
    plan_batch,
    shard_per_token,
    split_batch,
)
from megatron_dcp.adapters.value import clipped_value_loss, to_state_positions, values_of_tokens

__all__ = [
    "DCPConfig",
    "GradReduce",
    "GroupPacking",
    "RankMicroBatch",
    "SCALAR_HEAD_WIDTH",
    "ScalarHead",
    "SplitBatch",
    "attach_scalar_head",
    "bradley_terry_loss",
    "clipped_value_loss",
    "full_vocab_logits",
    "gather_scores",
    "global_num_tokens",
    "group_packing",
    "kl_per_token",
    "last_token_marks",
    "last_token_mask",
    "local_scores",
    "masked_mean_loss",
    "merge_outputs",
    "plan_batch",
    "reassemble",
    "score_loss_backward",
    "score_surrogate",
    "shard_per_token",
    "split_batch",
    "split_loss_scale",
    "teacher_top_k",
    "to_state_positions",
    "token_mean_loss",
    "token_mean_scale",
    "values_of_tokens",
]
