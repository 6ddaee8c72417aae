"""The scalar head of value and reward models (CPU, gloo, tiny GPT).

- A head wider than 1: every reader of one number per token (``values_of_tokens``,
  ``clipped_value_loss``, ``local_scores``, ``gather_scores``, ``score_surrogate``,
  ``score_loss_backward``) refuses ``[..., W]`` with W ≠ 1, naming the width and the fix, where
  the readers used to keep column 0 of it; a width-1 axis reads as no axis.
- A critic from a language model's checkpoint (docs/rl.md, "A critic from a language model's
  checkpoint"): the tiny GPT saved with megatron's dist-checkpointing at TP 1, loaded at TP 2
  into a model built with other weights, then ``attach_scalar_head``: every trunk tensor equals
  the language model's (TP shards gathered), the head is a fresh ``ScalarHead`` ``[1, hidden]``
  equal to an N(0, 1/hidden) draw from the seed set before the call, the same on both TP ranks,
  and the model gives ``[1, T, 1]``. Attached before loading, the head silently becomes row 0
  of the language model's vocabulary projection (pinned: the order the doc warns about). The
  critic's own checkpoint loads back into a critic.
"""

import os
from types import SimpleNamespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402
from test_rl_models import forward_whole  # noqa: E402

from megatron_dcp.adapters import (  # noqa: E402
    DCPConfig,
    ScalarHead,
    attach_scalar_head,
    clipped_value_loss,
    gather_scores,
    local_scores,
    merge_outputs,
    score_loss_backward,
    score_surrogate,
    split_batch,
    values_of_tokens,
)
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
)

OPTIONS = TinyGPTOptions()
OTHER = TinyGPTOptions(seed=99)  # the critic's weights before the checkpoint is loaded
HEAD_SEED = 11
HEAD = "output_layer.weight"
TIMEOUT_S = 90
LENGTHS = [9, 20, 5]
ONE_RANK = SimpleNamespace(plan=SimpleNamespace(domain=SimpleNamespace(size=1)))


# ------------------------------------------------------------------------------------------------
# A head wider than 1
# ------------------------------------------------------------------------------------------------


def read_wide_outputs(rank: int, world: int) -> dict:
    """What each score and value reader does with a width-2 head's output, and with the same
    numbers at width 1 and with no head axis."""
    init_megatron(seed=OPTIONS.seed)
    groups = create_dcp_groups()
    split = split_batch(make_samples(LENGTHS), groups, DCPConfig(max_seqlen_per_dp_cp_rank=64))
    wide = [torch.randn(1, mb.packed.tokens.shape[1], 2) for mb in split.microbatches]
    ones = torch.ones(split.num_samples)
    readers = {
        "local_scores": lambda out: local_scores(out[0], split, 0),
        "gather_scores": lambda out: gather_scores(out, split, groups),
        "score_surrogate": lambda out: score_surrogate(out, split, ones),
        "score_loss_backward": lambda out: score_loss_backward(out, split, groups, torch.sum),
        "values_of_tokens": lambda out: values_of_tokens(merge_outputs(out, split, groups)),
    }
    refusals = {}
    for name, read in readers.items():
        with pytest.raises(ValueError) as error:
            read(wide)
        refusals[name] = str(error.value)
    narrow, flat = [out[..., :1] for out in wide], [out[..., 0] for out in wide]
    scores = [readers["gather_scores"](out) for out in (narrow, flat)]
    values = [readers["values_of_tokens"](out) for out in (narrow, flat)]
    same = {
        "gather_scores": torch.equal(*scores),
        "values_of_tokens": all(torch.equal(a, b) for a, b in zip(*values)),
    }
    groups.destroy()
    return {"refusals": refusals, "same": same}


def test_a_head_wider_than_one_is_refused_by_every_reader():
    (result,) = run_distributed(read_wide_outputs, 1, timeout_s=TIMEOUT_S)
    values = torch.randn(1, 6, 2)
    mask, zeros = torch.ones(1, 6), torch.zeros(1, 6)
    with pytest.raises(ValueError) as error:
        clipped_value_loss(values, zeros, zeros, mask, 6, ONE_RANK)
    result["refusals"]["clipped_value_loss"] = str(error.value)
    for name, message in result["refusals"].items():
        assert "per-token shape (2,)" in message, (name, message)
        assert "width 1" in message and "attach_scalar_head" in message, (name, message)
    assert all(result["same"].values()), result["same"]
    narrow = clipped_value_loss(values[..., :1], zeros, zeros, mask, 6, ONE_RANK)
    assert torch.equal(narrow, clipped_value_loss(values[..., 0], zeros, zeros, mask, 6, ONE_RANK))


# ------------------------------------------------------------------------------------------------
# A critic from a language model's checkpoint
# ------------------------------------------------------------------------------------------------


def in_process_write_results() -> None:
    """megatron's torch_dist writer hands its write results over through a multiprocessing
    manager, which the harness's (daemonic) workers may not start; the save runs synchronously
    in this process, so a thread queue does the manager's job."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def full_weights(model) -> dict:
    """Every parameter in full (TP shards gathered), by its single-process name."""
    return gather_full_tensors([model], select=lambda p: p.detach().clone(), reduce_dp_cp=False)


def save_lm(rank: int, world: int, path: str) -> dict:
    from megatron.core import dist_checkpointing

    init_megatron(seed=OPTIONS.seed)
    (lm,) = build_tiny_gpt(options=OPTIONS)
    in_process_write_results()
    dist_checkpointing.save(lm.sharded_state_dict(), path)
    return full_weights(lm)


def load_into(model, path: str) -> None:
    """The documented load: megatron's dist-checkpointing into the model's own state dict."""
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


def critic_from_lm(rank: int, world: int, lm_path: str, critic_path: str, tp: int) -> dict:
    """The language model's checkpoint into a model of other weights, then the head; also the
    head attached first, and the critic's own checkpoint into another critic."""
    from megatron.core import dist_checkpointing

    init_megatron(tp=tp, seed=OPTIONS.seed)
    in_process_write_results()
    (critic,) = build_tiny_gpt(tp=tp, options=OTHER)
    before = full_weights(critic)
    load_into(critic, lm_path)
    torch.manual_seed(HEAD_SEED)
    attach_scalar_head(critic)
    output = forward_whole(critic, make_samples([13], seed=2)[0])
    (head_first,) = build_tiny_gpt(tp=tp, options=OTHER)
    attach_scalar_head(head_first)
    load_into(head_first, lm_path)
    dist_checkpointing.save(critic.sharded_state_dict(), critic_path)
    (again,) = build_tiny_gpt(tp=tp, options=OTHER)
    attach_scalar_head(again)
    load_into(again, critic_path)
    return {
        "before": before,
        "critic": full_weights(critic),
        "is_scalar_head": isinstance(critic.output_layer, ScalarHead),
        "output_shape": tuple(output.shape),
        "head_first": full_weights(head_first)[HEAD],
        "reloaded": full_weights(again),
    }


def test_a_critic_starts_from_a_language_models_checkpoint(tmp_path):
    lm_path, critic_path = str(tmp_path / "lm"), str(tmp_path / "critic")
    for path in (lm_path, critic_path):
        os.makedirs(path)
    (lm,) = run_distributed(save_lm, 1, lm_path, timeout_s=TIMEOUT_S)
    results = run_distributed(critic_from_lm, 2, lm_path, critic_path, 2, timeout_s=TIMEOUT_S)
    hidden = OPTIONS.hidden_size
    draw = torch.randn(1, hidden, generator=torch.Generator().manual_seed(HEAD_SEED))
    for result in results:
        critic, trunk = result["critic"], [name for name in lm if name != HEAD]
        assert critic.keys() == lm.keys()
        assert any(not torch.equal(result["before"][name], lm[name]) for name in trunk)
        for name in trunk:
            assert torch.equal(critic[name], lm[name]), name
        assert result["is_scalar_head"] and result["output_shape"] == (1, 13, 1)
        assert critic[HEAD].shape == (1, hidden) and critic[HEAD].dtype == torch.float32
        torch.testing.assert_close(critic[HEAD], draw * hidden**-0.5, rtol=1e-6, atol=1e-7)
        assert not (lm[HEAD] == critic[HEAD]).all(-1).any()  # no row of the projection
        assert torch.equal(critic[HEAD], results[0]["critic"][HEAD])  # one head on every rank
        assert torch.equal(result["head_first"], lm[HEAD][:1])  # attached first: token 0's row
        for name, tensor in critic.items():
            assert torch.equal(result["reloaded"][name], tensor), name
