"""The mutants of ``scripts/mutation_check.py`` in vision-language training under DCP (the image
routing, the encoder's CP group, the image slots and the combined-length planning): one realistic
one-line mistake each, in the form of ``mutation_list.py``, which gathers them into ``MUTANTS``."""

from __future__ import annotations

from mutation_types import Mutant


VLM_ORACLE = "tests/integration/test_vlm_oracle.py::"
VLM_CP2 = (VLM_ORACLE + "test_vlm_dcp_step_equals_llava_alone[dp2cp2]",)
INTEGRATION = "megatron_dcp/integration/"

VLM_DATA = "tests/integration/test_vlm_data.py"

VLM_MUTANTS = (
    Mutant(
        "vlm-combined-length-counts-tiles",
        INTEGRATION + "data/vlm_samples.py",
        "widths[placeholder] = tiles * image_seq_length",
        "widths[placeholder] = tiles",
        (VLM_DATA,) + VLM_CP2,
        "the combined length counts a tile as one position, not its image tokens: the plan, "
        "the packs and the image slots are those of a shorter sequence",
    ),
    Mutant(
        "vlm-planner-blind-to-encoder-patches",
        INTEGRATION + "forward_backward.py",
        "return [count * self.vision.patches_per_tile for count in tiles.tiles]",
        "return None",
        (VLM_ORACLE + "test_each_tile_is_encoded_once_per_group",),
        "the planner is not given the samples' encoder patches: an image costs it nothing",
    ),
    Mutant(
        "vlm-tiles-routed-reversed",
        INTEGRATION + "vision_batches.py",
        "tile: {PIXELS: image.reshape(len(image), -1)[index].float()}",
        "tile: {PIXELS: image.reshape(len(image), -1)[-1 - index].float()}",
        VLM_CP2,
        "image routing: a sample's tiles sent in reverse order, so multi-tile images are "
        "embedded in the wrong positions",
    ),
    Mutant(
        "vlm-encoder-gathers-over-static-cp",
        INTEGRATION + "vlm_model.py",
        "padded, tensor_parallel_output_grad=True, group=share.group",
        "padded, tensor_parallel_output_grad=True, "
        "group=__import__('megatron.core.parallel_state').core.parallel_state"
        ".get_context_parallel_group()",
        VLM_CP2,
        "the encoder's CP group: the projected tiles gathered over the static CP group (as "
        "LLaVA's own CP path shards), not the micro-batch's group",
    ),
    Mutant(
        "vlm-slot-offset-in-tiles",
        INTEGRATION + "vision_batches.py",
        "offset += count * spec.tokens_per_tile",
        "offset += count",
        (VLM_ORACLE + "test_groups_packing_several_samples_with_images",),
        "image slots shifted by tiles instead of image tokens: a pack's later samples take the "
        "wrong image tokens",
    ),
)
