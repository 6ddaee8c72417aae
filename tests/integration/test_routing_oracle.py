"""Both routing methods end to end (``--dcp-routing``): a DCP training step of the tiny GPT
through megatron's schedules, with the samples routed by the all-to-all over DP×CP or by the
all-gather inside each CP lane, equals the single-process no-CP run on the same samples (summed
loss, token count and every gradient; dropout off), on layouts whose plans mix CP sizes and
send samples across DP replicas."""

from functools import partial
from types import SimpleNamespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.runtime.routing import ROUTING_METHODS
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration import forward_backward  # noqa: E402
from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.testing import dcp_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    make_samples,
    single_process_reference,
)
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

# With budget 64 the 200-token sample needs 4 ranks, 120 and 71 need 2, the rest fit one: plans
# mix CP sizes, and groups larger than the static CP group take samples of other DP replicas.
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
OPTIONS = TinyGPTOptions(num_layers=2)


def routed_step(rank: int, world_size: int, samples, routing: str, cp: int, pp: int):
    """``dcp_training_step`` with ``DCPConfig.routing = routing`` (this forked rank only), and
    the routing functions the wrapper called, so the test knows which method ran."""
    calls = []

    def spy(function):
        def wrapped(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)

        return wrapped

    forward_backward.route_samples = spy(forward_backward.route_samples)
    forward_backward.route_by_lane_all_gather = spy(forward_backward.route_by_lane_all_gather)
    dcp_step.DCPConfig = SimpleNamespace(for_model=partial(DCPConfig.for_model, routing=routing))
    result = dcp_step.dcp_training_step(
        rank, world_size, samples, pp=pp, cp=cp, budget=64, options=OPTIONS
    )
    return result, calls


@pytest.mark.parametrize("routing", ROUTING_METHODS)
@pytest.mark.parametrize(
    "cp, pp, world", [(2, 1, 4), (1, 1, 4), (2, 2, 8)], ids=["dp2cp2", "dp4cp1", "pp2dp2cp2"]
)
def test_dcp_step_equals_single_process_with_either_routing(routing, cp, pp, world):
    samples = make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)
    expected = single_process_reference(samples, OPTIONS)
    results = run_distributed(
        partial(routed_step, routing=routing, cp=cp, pp=pp), world, samples, timeout_s=300
    )
    called = {"all-to-all": "route_samples", "lane-all-gather": "route_by_lane_all_gather"}
    layout = Layout(pp=pp, dp=world // (pp * cp), cp=cp)
    assert_covers([result for result, _ in results], layout)  # a plan mixing CP sizes
    for result, calls in results:
        assert_step_matches(result, expected)
        assert calls == [called[routing]]
        assert max(result.cp_sizes) > cp  # some group spans DP replicas


def test_auto_routes_with_the_all_to_all_on_gloo():
    samples = make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)
    expected = single_process_reference(samples, OPTIONS)
    step = partial(routed_step, routing="auto", cp=2, pp=1)
    results = run_distributed(step, 4, samples, timeout_s=300)
    assert_covers([result for result, _ in results], Layout(dp=2, cp=2))
    for result, calls in results:
        assert_step_matches(result, expected)
        assert calls == ["route_samples"]
