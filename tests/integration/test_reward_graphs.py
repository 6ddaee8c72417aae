"""What ``score_loss_backward`` keeps alive, and the two-pass form that keeps one micro-batch's
graph at a time (docs/rl.md, "Limits"; CPU, gloo, tiny GPT with a scalar head, dp2·cp2, dropout
off so that runs can be equal).

The saved activations are counted with autograd's saved-tensor hooks: the bytes of the storages
that the tensors saved for the backward keep alive, each storage once, the model's parameters
left out. ``score_loss_backward`` needs every micro-batch's output with its graph: before its
backward a rank holds the sum of what each micro-batch's forward saved (within 1 %). The
two-pass form (a forward without graphs for the scores, the loss's gradient per score, then per
micro-batch a forward and the backward of ``Σ coefficient · score`` over the scores it owns)
holds the largest micro-batch's only; its loss and every gradient equal test_rl_models'
single-process Bradley–Terry run (written without the adapter's helpers), and
``score_loss_backward``'s gradients. Some rank's micro-batch owns no score (asserted) and still
runs its CP group's backward.
"""

import contextlib

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402
from test_rl_models import (  # noqa: E402
    LENGTHS,
    OPTIONS,
    TIMEOUT_S,
    Run,
    assert_equal_runs,
    budget_of,
    forward,
    make_rollouts,
    reward_reference,
    setup_rank,
)

from megatron_dcp.adapters import (  # noqa: E402
    SCALAR_HEAD_WIDTH,
    DCPConfig,
    bradley_terry_loss,
    gather_scores,
    local_scores,
    score_loss_backward,
    split_batch,
)
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.testing.gpt import gather_full_tensors  # noqa: E402


class SavedBytes:
    """Bytes of the storages that tensors saved for backward keep alive (each storage once, the
    model's parameters left out: they are held anyway), now and at the most."""

    def __init__(self, model) -> None:
        self.weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
        self.users: dict = {}  # storage -> saved tensors on it
        self.held = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> "Held":
        return Held(self, tensor)

    @staticmethod
    def unpack(held: "Held") -> torch.Tensor:
        return held.tensor

    def add(self, storage) -> None:
        key = storage.data_ptr()
        if key in self.weights:
            return
        if self.users.get(key, 0) == 0:
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
        self.users[key] = self.users.get(key, 0) + 1

    def remove(self, storage) -> None:
        key = storage.data_ptr()
        if key in self.weights:
            return
        self.users[key] -= 1
        if self.users[key] == 0:
            self.held -= storage.nbytes()


class Held:
    """One saved tensor, counted while autograd keeps it."""

    def __init__(self, count: SavedBytes, tensor: torch.Tensor) -> None:
        self.count, self.tensor = count, tensor
        count.add(tensor.untyped_storage())

    def __del__(self) -> None:
        self.count.remove(self.tensor.untyped_storage())


@contextlib.contextmanager
def counted(count: SavedBytes):
    with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
        yield count


def two_pass_backward(model, split, groups, pairs, count: SavedBytes) -> tuple:
    """The loss of every score, one micro-batch's graph at a time; returns the loss and what
    each micro-batch's forward saved."""
    with torch.no_grad():
        outputs = [forward(model, mb) for mb in split.microbatches]
    scores = gather_scores(outputs, split, groups).requires_grad_(True)
    loss = bradley_terry_loss(scores, pairs)
    (coefficients,) = torch.autograd.grad(loss, scores)
    saved, owners = [], []
    for mb in split.microbatches:
        with counted(count):
            start = count.held
            ids, owned = local_scores(forward(model, mb), split, mb.index)
            saved.append(count.held - start)
            (coefficients[ids] * owned).sum().backward()  # every rank: its CP group's backward
        owners.append(len(ids))
        del ids, owned
    return float(loss), saved, owners


def reward_step(rank: int, world: int, rollouts, budget: int) -> Run:
    model = setup_rank(1, 2, OPTIONS, scalar=True)
    groups = create_dcp_groups()
    config = DCPConfig.for_model(model.config, budget, vocab_size=SCALAR_HEAD_WIDTH)
    split = split_batch(rollouts.samples, groups, config)
    one_pass = SavedBytes(model)
    with counted(one_pass):
        outputs = [forward(model, mb) for mb in split.microbatches]
        held_before_backward = one_pass.held
        loss = score_loss_backward(
            outputs, split, groups, lambda s: bradley_terry_loss(s, rollouts.pairs)
        )
    del outputs
    one_pass_grads = gather_full_tensors([model])
    for param in model.parameters():
        param.grad = None
    two_pass = SavedBytes(model)
    two_pass_loss, saved, owners = two_pass_backward(model, split, groups, rollouts.pairs, two_pass)
    grads = {"pairwise": gather_full_tensors([model]), "one pass": one_pass_grads}
    groups.destroy()
    memory = {"one pass": (held_before_backward, one_pass.peak), "two pass": two_pass.peak}
    losses = {"pairwise": two_pass_loss, "one pass": float(loss)}
    return Run(losses, {}, grads, None, (memory, saved, owners))


def test_two_passes_hold_one_graph_and_give_the_same_gradients():
    rollouts = make_rollouts(LENGTHS, seed=5)
    results = run_distributed(reward_step, 4, rollouts, budget_of(1), timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reward_reference, 1, rollouts, timeout_s=TIMEOUT_S)
    name = "pairwise"
    pairwise = Run({name: reference.losses[name]}, {}, {name: reference.grads[name]})
    assert_equal_runs(results, pairwise, len(LENGTHS))
    owners = [n for result in results for n in result.extra[2]]
    assert 0 in owners, owners  # a rank's micro-batch without a score still ran its backward
    for result in results:
        (held, one_peak), two_peak = result.extra[0].values()
        saved = result.extra[1]
        assert len(saved) > 1 and min(saved) > 0
        # the loss's and the score reads' own few saved bytes aside (under 1 %)
        assert held == pytest.approx(sum(saved), rel=0.01) and one_peak >= held, (held, saved)
        assert two_peak == pytest.approx(max(saved), rel=0.01), (two_peak, saved)
        assert two_peak < 0.99 * one_peak, (two_peak, one_peak)
        print("saved bytes per micro-batch", saved, "one pass", held, "two pass", two_peak)
        for name, grad in result.grads["one pass"].items():  # the same gradients as one pass
            torch.testing.assert_close(grad, result.grads["pairwise"][name], rtol=1e-5, atol=1e-7)
