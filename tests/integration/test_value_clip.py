"""PPO's clipped value loss (``adapters/value.py``) on both sides of the clip: v − v_old inside
ε, between ε and 2ε and beyond 2ε, above and below v_old, with returns above and below, against
the loss and its gradient written out per token, so that a clip of another width on either side
(e.g. an upper side at 2ε) changes the numbers."""

from types import SimpleNamespace

import pytest
import torch

from megatron_dcp.adapters.value import clipped_value_loss

EPS = 0.2
# v − v_old: inside ε, between ε and 2ε, beyond 2ε; above and below.
OFFSETS = (0.0, 0.1, -0.1, 0.3, -0.3, 0.5, -0.5)
RETURNS = (1.0, -1.0, 0.25, -0.25)
OLD = 0.4
ONE_RANK = SimpleNamespace(plan=SimpleNamespace(domain=SimpleNamespace(size=1)))


def expected(value: float, old: float, ret: float, eps: float) -> tuple:
    """(loss, d loss / d value) of ½ max((v − R)², (v_old + clip(v − v_old, ±ε) − R)²)."""
    delta = value - old
    inside = -eps < delta < eps
    clipped = old + min(max(delta, -eps), eps)
    plain, held = (value - ret) ** 2, (clipped - ret) ** 2
    if plain >= held:
        return 0.5 * plain, value - ret
    return 0.5 * held, (clipped - ret) if inside else 0.0


def grid():
    return [(OLD + offset, ret) for offset in OFFSETS for ret in RETURNS]


def test_the_grid_reaches_every_side_of_the_clip():
    """The clipped term decides somewhere in each band (ε < |Δ| < 2ε and |Δ| > 2ε, both signs)."""
    decided = set()
    for value, ret in grid():
        delta = round(value - OLD, 6)
        plain, held = expected(value, OLD, ret, EPS)[0], 0.5 * (value - ret) ** 2
        if plain > held:
            decided.add(delta)
    assert {0.3, -0.3, 0.5, -0.5} <= decided


@pytest.mark.parametrize("value, ret", grid())
def test_clipped_value_loss_per_token(value, ret):
    values = torch.tensor([[value]], dtype=torch.float64, requires_grad=True)
    old, returns = torch.tensor([[OLD]], dtype=torch.float64), torch.tensor([[ret]])
    mask = torch.ones(1, 1, dtype=torch.float64)
    loss = clipped_value_loss(values, old, returns.double(), mask, 1, ONE_RANK, EPS)
    loss.backward()
    want_loss, want_grad = expected(value, OLD, ret, EPS)
    assert float(loss) == pytest.approx(want_loss, abs=1e-6)
    assert float(values.grad) == pytest.approx(want_grad, abs=1e-6)


def test_clipped_value_loss_is_the_masked_mean_over_a_batch():
    """Every case of the grid in one tensor, half of them masked out, counted once each."""
    cases = grid()
    values = torch.tensor([[v for v, _ in cases]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[r for _, r in cases]], dtype=torch.float64)
    old = torch.full_like(returns, OLD)
    mask = torch.tensor([[float(i % 2) for i in range(len(cases))]], dtype=torch.float64)
    count = int(mask.sum())
    loss = clipped_value_loss(values, old, returns, mask, count, ONE_RANK, EPS)
    loss.backward()
    want = [expected(v, OLD, r, EPS) for v, r in cases]
    kept = [w for w, m in zip(want, mask[0].tolist()) if m]
    assert float(loss) == pytest.approx(sum(w[0] for w in kept) / count, abs=1e-6)
    grads = [w[1] * m / count for w, m in zip(want, mask[0].tolist())]
    assert values.grad[0].tolist() == pytest.approx(grads, abs=1e-6)
