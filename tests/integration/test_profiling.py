"""``bench-train --profile``'s attribution (``tools.bench_train.profiling``) on a toy model: every
event's own time goes to the innermost ``dcp::`` range, a backward op to the region of the forward
op that made its autograd node, nested ranges are not counted twice, and model submodules are
named by their qualified names."""

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core

import_megatron_core()

from megatron_dcp.tools.bench_train.profiling import (  # noqa: E402
    PREFIX,
    module_region,
    profiled,
)


class Attention(torch.nn.Module):
    """Stands in for a core attention whose K/V exchange opens its own range."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function(PREFIX + "K/V exchange"):
            keys = torch.cat([x, x]).tanh()
        return torch.softmax(x @ keys.T, dim=-1) @ keys


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU())
        self.core_attention = Attention()
        self.output_layer = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(x)
        return self.output_layer(self.core_attention(hidden))


def profile_toy() -> dict:
    torch.manual_seed(0)
    model, figures = Toy(), {}
    with profiled([model], figures):
        for _ in range(2):
            with torch.profiler.record_function(PREFIX + "forward step"):
                loss = model(torch.randn(128, 64)).square().sum()
            with torch.profiler.record_function(PREFIX + "backward step"):
                loss.backward()
    return figures


def test_forward_and_backward_time_go_to_the_regions_that_made_them():
    main = profile_toy()["main"]
    for region in ("MLP", "core attention", "K/V exchange", "output layer"):
        assert main.get(f"{region}/forward", 0) > 0, region
        assert main.get(f"{region}/backward", 0) > 0, region
    assert main.get("schedule and step host work/forward", 0) > 0  # the loss, in no region


def test_nested_ranges_are_counted_once():
    figures = profile_toy()
    assert sum(figures["main"].values()) <= figures["wall_s"] * 1.02
    assert figures["background"] == {} or sum(figures["background"].values()) < figures["wall_s"]


@pytest.mark.parametrize(
    "name,region",
    [
        ("decoder.layers.1.self_attention.core_attention", "core attention"),
        ("decoder.layers.0.self_attention.linear_qkv", "QKV/out projections"),
        ("decoder.layers.0.mlp", "MLP"),
        ("decoder.layers.0.mlp.linear_fc1", None),  # inside the MLP's range already
        ("decoder.final_layernorm", "norms"),
        ("embedding", "embedding"),
        ("output_layer", "output layer"),
    ],
)
def test_model_submodules_are_named_by_their_qualified_names(name, region):
    assert module_region(name) == region
