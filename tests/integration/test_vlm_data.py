"""Vision-language data (``integration/data/{vlm_samples,multimodal,vlm_mock,vlm_datasets}.py``):
the combined-coordinates mapping against megatron's own ``LLaVAModel._preprocess_data`` (fixed
cases and a property), tokens per tile against megatron's count, tiling of real images (Pillow),
the JSONL format with its errors, the mock distribution and the flags' checks."""

import json
import types
from typing import List

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader

from megatron_dcp.integration.data.chat import ChatTokenizer, chat_tokenizer_from_dir
from megatron_dcp.integration.data.multimodal import (
    CLIP_MEAN,
    CLIP_STD,
    load_tiles,
    tile_grid,
    tokenize_with_images,
)
from megatron_dcp.integration.data.vlm_datasets import (
    VLMDataConfig,
    add_vlm_data_args,
    build_vlm_datasets,
    check_vlm_data_args,
)
from megatron_dcp.integration.data.vlm_mock import parse_discrete
from megatron_dcp.integration.data.vlm_samples import (
    IMAGE_TOKEN,
    encoder_patches,
    image_seq_length,
    make_vlm_sample,
)
from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.tools.conversation_corpus import write_sft_corpus

HIDDEN = 4


def llava(tokens, labels, loss_mask, tiles: List[int], seq: int, seed: int = 0):
    """LLaVA's own (final_embedding [L, h], final_labels [L], final_loss_mask [L]) for one sample,
    with random image and language embeddings (also returned)."""
    import_megatron_core()
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    stand_in = types.SimpleNamespace(
        add_decoder=True,
        pre_process=True,
        post_process=True,
        img_seq_len=seq,
        _language_is_pipeline_parallel=False,
        _language_max_sequence_length=10**9,
        context_parallel_lm=1,
        sound_token_index=-300,
        sound_model=None,
        vision_model=None,
    )
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(seq, sum(tiles), HIDDEN, generator=generator)
    if not tiles:  # LLaVA's forward passes a text-only batch no image embedding at all
        images = images.reshape(0, 0, HIDDEN)
    text = torch.randn(1, tokens.numel(), HIDDEN, generator=generator)
    embedding, final_labels, final_mask = LLaVAModel._preprocess_data(
        stand_in, images, text, tokens[None], loss_mask[None], labels[None], False, None,
        IMAGE_TOKEN, torch.tensor(tiles, dtype=torch.int32),
    )  # fmt: skip
    return embedding[:, 0], final_labels[0], final_mask[0], images, text[0]


def text_case(tokens: List[int], mask: List[float]):
    """tokens / next-token labels (the last one 9) / loss mask as tensors."""
    tokens_t = torch.tensor(tokens, dtype=torch.int64)
    labels = torch.tensor(tokens[1:] + [9], dtype=torch.int64)
    return tokens_t, labels, torch.tensor(mask, dtype=torch.float32)


def assert_same_as_llava(tokens, labels, mask, tiles, seq, seed=0):
    images = torch.randn(sum(tiles), 3, 2, 2)
    ours = make_vlm_sample(tokens, labels, mask, images, tiles, seq)
    embedding, final_labels, final_mask, encoded, text = llava(
        tokens, labels, mask, tiles, seq, seed
    )
    length = int(ours["length"])
    assert final_labels.shape == (length,) and ours["tokens"].shape == (length,)
    assert torch.equal(ours["loss_mask"], final_mask)
    on = final_mask > 0
    assert torch.equal(ours["labels"][on], final_labels[on])
    assert torch.equal(ours["labels"], final_labels.clamp(min=0))  # -100 / -200 become 0
    # Gather: image positions from the encoder outputs (tile-major), text from the text embedding.
    flat = encoded.permute(1, 0, 2).reshape(-1, HIDDEN)  # LLaVA's order: tile-major
    slot = ours["vision_slot"]
    rebuilt = torch.zeros(length, HIDDEN)
    rebuilt[slot > 0] = flat[slot[slot > 0] - 1]
    text_positions = torch.flatten(torch.nonzero(slot == 0))
    rebuilt[text_positions] = text[tokens != IMAGE_TOKEN]
    assert torch.equal(rebuilt, embedding)
    assert torch.equal(ours["tokens"][text_positions], tokens[tokens != IMAGE_TOKEN])
    assert bool((ours["tokens"][slot > 0] == 0).all())
    assert torch.equal(slot[slot > 0], torch.arange(1, sum(tiles) * seq + 1))
    assert int(ours["tiles"]) == sum(tiles) and torch.equal(ours["images"], images)


P = IMAGE_TOKEN


@pytest.mark.parametrize(
    "tokens, tiles",
    [
        ([4, 5, 6], []),  # text only
        ([4, P, 5, 6], [1]),  # the docstring's case
        ([P, 4, 5], [2]),  # at the start
        ([4, 5, P], [1]),  # at the end
        ([4, P, P, 5, P, 6, 7], [1, 3, 2]),  # consecutive and several
        ([P, P], [2, 1]),  # images only
    ],
)
def test_the_mapping_is_llavas(tokens, tiles):
    mask = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0][: len(tokens)]
    assert_same_as_llava(*text_case(tokens, mask), tiles, seq=3)


@st.composite
def samples(draw):
    length = draw(st.integers(1, 24))
    placeholders = draw(st.lists(st.booleans(), min_size=length, max_size=length))
    tokens = [P if image else draw(st.integers(1, 50)) for image in placeholders]
    tiles = [draw(st.integers(1, 3)) for _ in range(sum(placeholders))]
    mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=length, max_size=length))
    return tokens, tiles, mask, draw(st.integers(1, 5)), draw(st.integers(0, 2**16))


@settings(max_examples=max(1, 3 * settings().max_examples), deadline=None)
@given(case=samples())
def test_property_the_mapping_is_llavas(case):
    tokens, tiles, mask, seq, seed = case
    assert_same_as_llava(*text_case(tokens, mask), tiles, seq, seed)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tiles=[1, 1]), "2 image(s)"),
        (dict(tiles=[0]), "at least 1 tile"),
        (dict(images=torch.zeros(2, 3, 2, 2)), "sum(tiles_per_image) = 1"),
        (dict(labels=torch.zeros(2, dtype=torch.int64)), "1-D of one length"),
    ],
)
def test_a_sample_that_does_not_add_up_is_refused(change, message):
    tokens, labels, mask = text_case([4, P, 5], [1.0, 1.0, 1.0])
    fields = dict(labels=labels, images=torch.zeros(1, 3, 2, 2), tiles=[1]) | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_vlm_sample(tokens, fields["labels"], mask, fields["images"], fields["tiles"], 2)


@pytest.mark.parametrize("size, patch", [(336, 14), (224, 16), (30, 7)])
@pytest.mark.parametrize("drop", [True, False])
def test_tokens_per_tile_are_megatrons(size, patch, drop):
    import_megatron_core()
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings

    expected = get_num_image_embeddings(size, size + patch, patch, "clip", drop, 1, False)
    assert image_seq_length(size, size + patch, patch, 1, drop) == expected
    keep = get_num_image_embeddings(size, size + patch, patch, "clip", False, 1, False)
    assert encoder_patches(size, size + patch, patch) == keep


# --- images --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "width, height, most, grid",
    [
        (640, 480, 1, (1, 1)),
        (800, 400, 4, (1, 2)),  # wide: two tiles side by side
        (400, 800, 4, (2, 1)),
        (900, 900, 4, (2, 2)),  # square and large: the most tiles it fills
        (20, 20, 4, (1, 1)),  # square and small: one tile
        (1200, 400, 6, (1, 3)),
    ],
)
def test_the_tile_grid_follows_the_aspect_ratio(width, height, most, grid):
    assert tile_grid(width, height, 100, 100, most) == grid


def quadrants(path, size=(40, 20), mode="RGB"):
    """A 40×20 image with four solid quadrants (wide: a 1×2 grid of 20×20 tiles)."""
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]
    image = Image.new("RGB", size)
    width, height = size
    for index, color in enumerate(colors):
        x, y = (index % 2) * width // 2, (index // 2) * height // 2
        image.paste(color, (x, y, x + width // 2, y + height // 2))
    image.convert(mode).save(path)
    return path


def test_tiles_are_cut_row_major_and_normalised(tmp_path):
    path = quadrants(tmp_path / "q.png", size=(80, 80))
    tiles = load_tiles(str(path), 20, 20, 4)  # square, 80×80 ≥ half of 4 tiles: a 2×2 grid
    assert tiles.shape == (4, 3, 20, 20) and tiles.dtype == torch.float32
    mean, std = torch.tensor(CLIP_MEAN), torch.tensor(CLIP_STD)
    for tile, color in zip(tiles, [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]):
        expected = (torch.tensor(color, dtype=torch.float32) - mean) / std
        assert torch.allclose(tile[:, 10, 10], expected, atol=1e-5)
    one = load_tiles(str(path), 20, 20, 1)
    assert one.shape == (1, 3, 20, 20)


def test_a_grey_or_transparent_image_is_read_as_rgb(tmp_path):
    for mode in ("L", "RGBA", "P"):
        path = quadrants(tmp_path / f"{mode}.png", mode=mode)
        assert load_tiles(str(path), 16, 16, 1).shape == (1, 3, 16, 16)


# --- the JSONL format ----------------------------------------------------------------------

USER = {"role": "user", "content": "<image>\nkaka lomi ne"}
ANSWER = {"role": "assistant", "content": "ruta vizo"}
SEQ = 4  # tokens per tile in the JSONL tests


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> ChatTokenizer:
    corpus = write_sft_corpus(tmp_path_factory.mktemp("vlm"), count=200, seed=3)
    return chat_tokenizer_from_dir(str(corpus["tokenizer"]))


def write_records(tmp_path, records, images=("a.png", "b.png")) -> str:
    """``records`` (dicts, or raw lines) as ``tmp_path/data.jsonl``; ``images`` written as
    small PNGs under ``tmp_path/pictures`` (a 40×20 and a 20×20)."""
    (tmp_path / "pictures").mkdir(exist_ok=True)
    for name, size in zip(images, [(40, 20), (20, 20)]):
        quadrants(tmp_path / "pictures" / name, size=size)
    path = tmp_path / "data.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def real(path, chat, seq_length=512, tiles=2, counts=(4, 0, 0), **extra):
    config = VLMDataConfig(
        seq_length=seq_length, vocab_size=0, seed=1, num_samples=counts, image_seq_length=SEQ,
        img_h=8, img_w=8, max_num_tiles=tiles, vlm_data=path, split="1", **extra,
    )  # fmt: skip
    return build_vlm_datasets(config, chat)


def test_a_jsonl_record_becomes_the_llava_sample(chat, tmp_path):
    second = {"role": "user", "content": "pesu <image> da"}
    record = {
        "messages": [USER, ANSWER, second, {"role": "assistant", "content": "fi kalo"}],
        "images": ["pictures/a.png", str(tmp_path / "pictures" / "b.png")],  # relative, absolute
    }
    train, _, _ = real(write_records(tmp_path, [record]), chat)
    item = train[0]
    conversation = record["messages"]
    ids, assistant = tokenize_with_images(chat, conversation)
    tokens, labels = torch.from_numpy(ids[:-1]), torch.from_numpy(ids[1:])
    # a.png is 40×20: a 1×2 grid; b.png 20×20 is one tile (max 2 tiles).
    images = torch.cat([load_tiles(str(tmp_path / "pictures" / f"{n}.png"), 8, 8, 2) for n in "ab"])
    expected = make_vlm_sample(
        tokens, labels, torch.as_tensor(assistant[1:], dtype=torch.float32), images, [2, 1], SEQ
    )
    assert item.keys() == expected.keys()
    for key in item:
        assert torch.equal(item[key], expected[key]), key
    assert int(item["tiles"]) == 3 and int((tokens == IMAGE_TOKEN).sum()) == 2
    assert int(item["length"]) == tokens.numel() + 3 * SEQ - 2 == train.sequence_length(0)
    in_loss = chat.tokenizer.decode(item["labels"][item["loss_mask"] > 0].tolist())
    assert in_loss == "ruta vizo<|im_end|>\nfi kalo<|im_end|>\n"
    # The text around each marker is tokenized as it is rendered, marker by marker.
    text = chat.tokenizer.decode([t for t in ids.tolist() if t != IMAGE_TOKEN])
    assert text == chat.render(conversation).replace("<image>", "")


def test_the_loader_gives_micro_batches_of_one(chat, tmp_path):
    records = [{"messages": [USER, ANSWER], "images": ["pictures/a.png"]}] * 3
    train, _, _ = real(write_records(tmp_path, records), chat, counts=(3, 0, 0))
    batch = next(iter(DataLoader(train, batch_size=1)))
    length = int(batch["length"][0])
    for key in ("tokens", "labels", "loss_mask", "vision_slot"):
        assert batch[key].shape == (1, length), key
    assert batch["images"].shape == (1, 2, 3, 8, 8) and batch["tiles"].tolist() == [2]


def assert_refused(path, chat, *needles, **flags):
    with pytest.raises(ValueError) as error:
        real(path, chat, **flags)
    for needle in needles:
        assert needle in str(error.value), (needle, str(error.value))


@pytest.mark.parametrize(
    "record, needles",
    [
        ({"messages": [USER, ANSWER], "images": ["pictures/gone.png"]}, ["gone.png", "no such"]),
        ({"messages": [USER, ANSWER], "images": ["pictures/bad.png"]}, ["bad.png", "cannot be"]),
        ({"messages": [USER, ANSWER], "images": []}, ["1 <image> marker(s)", "0 image(s)"]),
        ({"messages": [USER, ANSWER], "images": ["pictures/a.png"] * 2}, ["2 image(s)"]),
        ({"messages": [USER, ANSWER], "images": ["pictures/a.png"], "video": "v.mp4"}, ['"video"']),
        (
            {"messages": [{"role": "user", "content": "<video>x"}, ANSWER], "images": []},
            ["<video> markers are not supported"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}, ANSWER]},
            ["list of parts"],
        ),
        ({"messages": [USER, ANSWER], "images": [{"path": "a.png"}]}, ["list of image paths"]),
        ({"messages": [USER], "images": ["pictures/a.png"]}, ["no assistant turn"]),
        ("{not json", ["not valid JSON"]),
    ],
)
def test_a_bad_record_is_refused_with_its_file_and_line(chat, tmp_path, record, needles):
    good = {"messages": [USER, ANSWER], "images": ["pictures/a.png"]}
    path = write_records(tmp_path, [good, record])
    (tmp_path / "pictures" / "bad.png").write_bytes(b"not an image at all")
    assert_refused(path, chat, f"--vlm-data: {path}:2: ", *needles)


def test_a_sample_longer_than_seq_length_is_refused_not_cut(chat, tmp_path):
    path = write_records(tmp_path, [{"messages": [USER, ANSWER], "images": ["pictures/a.png"]}])
    length = int(real(path, chat)[0][0]["length"])
    assert real(path, chat, seq_length=length)[0][0]["length"] == length
    assert_refused(path, chat, ":1: ", f"raise --seq-length to at least {length}",
                   "--max-num-tiles", seq_length=length - 1)  # fmt: skip


def test_a_missing_file_and_mock_flags_are_refused(chat, tmp_path):
    assert_refused(str(tmp_path / "none.jsonl"), chat, "--vlm-data=", "no such file")
    path = write_records(tmp_path, [{"messages": [USER, ANSWER], "images": ["pictures/a.png"]}])
    message = "--vlm-tiles-per-image='2' applies to mock data"
    assert_refused(path, chat, message, tiles_per_image="2")
    assert_refused(path, chat, "--num-channels 3", num_channels=1)


# --- mock data and the flags ---------------------------------------------------------------

IMAGES, TILES = "0:0.4,1:0.4,3:0.2", "1:0.5,2:0.3,4:0.2"


def mock(counts=(200, 0, 0), seq_length=1024, seq=16, **extra):
    fields = dict(images_per_sample=IMAGES, tiles_per_image=TILES, max_num_tiles=4) | extra
    config = VLMDataConfig(
        seq_length=seq_length, vocab_size=64, seed=3, num_samples=counts, image_seq_length=seq,
        img_h=8, img_w=8, distribution="uniform:min=1,max=2000", **fields,
    )  # fmt: skip
    return build_vlm_datasets(config)


def test_mock_samples_follow_the_flags_and_are_deterministic():
    data, again = mock()[0], mock()[0]
    runs, starts = [], 0
    for index in range(len(data)):
        item = data[index]
        assert all(torch.equal(item[key], again[index][key]) for key in item)
        length = int(item["length"])
        assert length == data.sequence_length(index) <= 1024
        assert item["images"].shape == (int(item["tiles"]), 3, 8, 8)
        slot = item["vision_slot"]
        first = torch.cat([torch.tensor([True]), slot[:-1] == 0])
        runs.append(int(((slot > 0) & first).sum()))  # consecutive images make one run
        starts += int(slot[0] > 0)
        assert bool((item["tokens"][slot == 0] >= 1).all()) and int(item["loss_mask"].sum()) >= 1
        assert int(item["tiles"]) * 16 == int((slot > 0).sum())
    # Text-only samples, samples with images, and samples that start with one all occur.
    assert 0 in runs and max(runs) >= 1 and starts > 0
    assert max(int(data[i]["tiles"]) for i in range(len(data))) > 3  # 3 images or 4 tiles


def test_mock_image_counts_follow_the_distribution():
    data = mock(counts=(400, 0, 0), tiles_per_image="1", seq=1)[0]
    tiles = np.asarray([int(data[i]["tiles"]) for i in range(len(data))])  # one tile an image
    shares = [float((tiles == n).mean()) for n in (0, 1, 3)]
    assert set(np.unique(tiles).tolist()) <= {0, 1, 3}
    assert np.allclose(shares, [0.4, 0.4, 0.2], atol=0.08), shares


def test_mock_text_is_shortened_to_fit_the_images():
    data = mock((100, 0, 0), seq_length=200, seq=40, images_per_sample="1", tiles_per_image="4")[0]
    for index in range(len(data)):
        item = data[index]
        assert int(item["length"]) <= 200 and int(item["tiles"]) == 4


def test_mock_prompt_fraction_masks_the_start():
    data = mock(counts=(30, 0, 0), prompt_fraction=0.5, images_per_sample="0")[0]
    plain = mock(counts=(30, 0, 0), images_per_sample="0")[0]
    for index in range(len(data)):
        mask, length = data[index]["loss_mask"], int(data[index]["length"])
        prompt = length // 2
        assert torch.equal(mask, torch.cat([torch.zeros(prompt), torch.ones(length - prompt)]))
        assert torch.equal(data[index]["tokens"], plain[index]["tokens"])


@pytest.mark.parametrize(
    "flags, needles",
    [
        (dict(images_per_sample="1:0.5,x:0.5"), ["--vlm-images-per-sample='1:0.5,x:0.5'"]),
        (dict(images_per_sample="1:-1"), ["WEIGHT > 0"]),
        (dict(images_per_sample="1:1,1:2"), ["distinct"]),
        (dict(tiles_per_image="0:1"), ["--vlm-tiles-per-image='0:1'", "≥ 1"]),
        (dict(tiles_per_image="8"), ["raise --max-num-tiles to 8"]),
        (dict(images_per_sample="3", seq_length=3 * 4 * 16), ["raise --seq-length to at least 193",
                                                              "--vlm-images-per-sample='3'"]),
        (dict(max_num_tiles=0), ["--max-num-tiles=0"]),
        (dict(prompt_fraction=1.0), ["--varlen-prompt-fraction=1.0"]),
        (dict(lengths_file="x.txt"), ["at most one source of text lengths"]),
    ],
)
def test_bad_mock_flags_are_refused(flags, needles):
    with pytest.raises(ValueError) as error:
        mock(**flags)
    for needle in needles:
        assert needle in str(error.value), (needle, str(error.value))


def test_the_flags_parse_and_their_start_up_checks_refuse_other_sources():
    import argparse

    parser = argparse.ArgumentParser()
    add_vlm_data_args(parser.add_argument_group("vlm"))
    args = parser.parse_args(["--vlm-images-per-sample", "0:1,2:1", "--max-num-tiles", "4"])
    assert (args.vlm_data, args.vlm_tiles_per_image, args.max_num_tiles) == (None, None, 4)
    args.seq_length, args.seed = 512, 1  # no vocabulary yet: start-up checks run before it
    args.img_h = args.img_w = 8
    args.num_channels, args.sft_data, args.data_path = 3, None, None
    check_vlm_data_args(args, 16)
    args.sft_data = "c.jsonl"
    with pytest.raises(ValueError, match="--sft-data='c.jsonl': a vision-language model"):
        check_vlm_data_args(args, 16)
    args.sft_data, args.vlm_images_per_sample = None, "40"
    with pytest.raises(ValueError, match="raise --seq-length to at least 641"):
        check_vlm_data_args(args, 16)


def test_discrete_spec_values_and_weights():
    spec = parse_discrete("0:0.4, 1:0.4,3:0.2", "--flag")
    assert (spec.values, spec.weights, spec.largest) == ((0, 1, 3), (0.4, 0.4, 0.2), 3)
    assert parse_discrete("2", "--flag").values == (2,)
