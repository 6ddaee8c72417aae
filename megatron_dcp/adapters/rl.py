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

from megatron_dcp.adapters.loss import (
    GradReduce,
    split_loss_scale,
    token_mean_loss,
    token_mean_scale,
)
from megatron_dcp.adapters.merge import GroupPacking, group_packing, merge_outputs, reassemble
from megatron_dcp.adapters.split import (
    DCPConfig,
    RankMicroBatch,
    SplitBatch,
    global_num_tokens,
    plan_batch,
    shard_per_token,
    split_batch,
)

__all__ = [
    "DCPConfig",
    "GradReduce",
    "GroupPacking",
    "RankMicroBatch",
    "SplitBatch",
    "global_num_tokens",
    "group_packing",
    "merge_outputs",
    "plan_batch",
    "reassemble",
    "shard_per_token",
    "split_batch",
    "split_loss_scale",
    "token_mean_loss",
    "token_mean_scale",
]
