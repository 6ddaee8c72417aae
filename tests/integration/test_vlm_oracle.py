"""Vision-language models under DCP, end to end on megatron-core (CPU, gloo): a DCP step of
megatron-core's LLaVA (CLIP ViT, MLP projector, GPT) equals LLaVA's own forward run on every
sample alone in one process (float64 exact values, float32 rounding measured: the tolerance
rule of ``testing.oracle``), for the loss, the token count and the gradients of the language
model, the projector and the vision encoder. Dropout is off: equality of runs needs it.

The batch mixes text-only samples, samples with one image (one and two tiles) and samples with
several images; the plans mix CP sizes (``assert_covers``); with
``MEGATRON_DCP_FORCE_STATIC_PLAN=1`` the DCP cases fail by name."""

from functools import partial

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402
from megatron_dcp.testing.vlm import (  # noqa: E402
    TinyVLMOptions,
    replace_language,
    vlm_reference,
    vlm_samples,
)
from megatron_dcp.testing.vlm_step import vlm_dcp_step  # noqa: E402

OPTIONS = TinyVLMOptions()
SP_OPTIONS = replace_language(OPTIONS, sequence_parallel=True)
# Text tokens and the tiles of each image per sample: text only, one image of one tile, one image
# of two tiles (megatron's num_image_tiles), two and three images; 4 image tokens per tile.
TEXTS = (20, 9, 30, 12, 60, 7, 25, 16)
IMAGES = ((), (1,), (2, 1), (), (1, 2), (), (3,), (1, 1, 1))
BUDGET = 24  # on N = 4: the 70-token sample needs all 4 ranks, 40-ish ones 2, the rest 1


@pytest.fixture(scope="module")
def samples():
    return vlm_samples(TEXTS, IMAGES, OPTIONS, seed=11)


@pytest.fixture(scope="module")
def reference(samples):
    return vlm_reference(samples, OPTIONS)


def run_step(samples, world, tp=1, cp=2, scheduler="default_dynamic_cp", budget=BUDGET, **kwargs):
    step = partial(vlm_dcp_step, tp=tp, cp=cp, scheduler=scheduler, budget=budget, **kwargs)
    return run_distributed(step, world, samples, timeout_s=240)


def assert_equals_reference(results, reference, layout, **claims):
    assert_covers([r.step for r in results], layout, **claims)
    for result in results:
        assert result.parts == ("CLIPViTModel", "MultimodalProjector", "GPTModel")
        assert_step_matches(result.step, reference)


def test_the_batch_mixes_text_single_and_multi_image_samples(samples):
    """What the other tests claim to cover: text-only samples, one image of one and of two
    tiles, several images; combined lengths longer than the text by the image tokens."""
    tiles = [int(s["images"].shape[0]) for s in samples]
    assert 0 in tiles and 1 in tiles and max(len(images) for images in IMAGES) >= 2
    assert any(len(images) == 1 and images[0] > 1 for images in IMAGES)
    for text, sample, count in zip(TEXTS, samples, tiles):
        placeholders = len(sample["image_tiles"])
        expected = text - placeholders + count * OPTIONS.tokens_per_tile
        assert int(sample["length"]) == expected


@pytest.mark.parametrize(
    "tp, cp, world, options",
    [(1, 2, 4, OPTIONS), (1, 1, 4, OPTIONS), (2, 2, 8, SP_OPTIONS)],
    ids=["dp2cp2", "dp4cp1", "tp2dp2cp2-sp"],
)
def test_vlm_dcp_step_equals_llava_alone(tp, cp, world, options, samples, reference):
    """DCP plans mixing CP sizes 1, 2 and 4 (the whole domain): loss, token count and every
    gradient (language model, projector, vision encoder) equal LLaVA's own forward."""
    results = run_step(samples, world, tp=tp, cp=cp, options=options)
    layout = Layout(tp=tp, pp=1, dp=world // (tp * cp), cp=cp)
    assert_equals_reference(results, reference, layout, mix_of={4})


def test_groups_packing_several_samples_with_images(samples, reference):
    """dp1·cp2 with budget 64: CP groups pack several samples with images, so the image slots
    of a pack's later samples follow the tokens of the images before them."""
    results = run_step(samples, 2, cp=2, budget=64)
    assert_equals_reference(results, reference, Layout(tp=1, pp=1, dp=1, cp=2))
    assert all(result.image_samples_per_group >= 2 for result in results)


def test_static_cp_equals_llava_alone(samples, reference):
    """The static-CP baseline (``dp_balanced``) through the same path: CP 2 only. Its budget
    must hold the longest sample on the static group."""
    step = partial(vlm_dcp_step, cp=2, scheduler="dp_balanced", budget=40)
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_equals_reference(results, reference, Layout(tp=1, pp=1, dp=2, cp=2), cp_sizes={2})


def test_lane_all_gather_routes_tiles_too(samples, reference):
    """The tiles follow the text's routing method: the lane all-gather as well."""
    results = run_step(samples, 4, routing="lane-all-gather")
    assert_equals_reference(results, reference, Layout(tp=1, pp=1, dp=2, cp=2))


def test_each_tile_is_encoded_once_per_group(samples):
    """The encoder work: every tile of the batch is encoded by exactly one rank of the domain
    (never on every rank of its group), and it is spread: no rank encodes them all. The planner
    planned the combined lengths and priced every sample's encoder patches."""
    results = run_step(samples, 4)
    patches = tuple(int(s["images"].shape[0]) * OPTIONS.spec.patches_per_tile for s in samples)
    for result in results:
        assert sum(result.encoder_tiles) == result.batch_tiles
        assert max(result.encoder_tiles) < result.batch_tiles
        assert result.plan_patches == patches
    tp_results = run_step(samples, 8, tp=2, options=SP_OPTIONS)
    for result in tp_results:  # per DP×CP position: the TP ranks of a position share its tiles
        assert sum(result.encoder_tiles) == result.batch_tiles
