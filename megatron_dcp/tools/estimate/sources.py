"""The sequence lengths of the first global batches of the user's data, as training would read
them: exactly one source, each sample's length ``L`` at most ``--seq-length``.

- ``--data-path``, ``--sft-data``, ``--varlen-distribution``, ``--varlen-lengths-file``: the
  training entry point's own datasets (``integration.data.datasets.build_varlen_datasets``,
  as ``quickstart`` reads them): one document or conversation per sample, truncated, the
  documents of ``--split``'s train range in the seeded order of training (needs torch and
  megatron-core);
- ``--lengths FILE`` (``simulate --lengths``'s format): the samples in the file's order, cycled
  and truncated as ``--varlen-lengths-file`` is (no torch);
- ``--hf-dataset NAME --text-field F`` (``json``/``parquet`` with ``--data-files``): the rows in
  a seeded order, each text's tokens with ``--tokenizer-model``, else its whitespace-separated
  words (the output says which); needs the ``datasets`` package;
- vision-language data (megatron-core's LLaVA, ``pretrain_vlm``: any of its data or vision
  flags): the datasets ``pretrain_vlm`` trains on (``integration.data.vlm_datasets``:
  ``--vlm-data FILE.jsonl`` with ``--tokenizer-model DIR``, or mock samples with images, their
  text lengths from ``--varlen-*``), only the samples' layouts read (no pixel decoded): each
  sample's *combined* length (text plus image tokens, what the planner plans) and its encoder
  patches (tiles × patches per tile, class token included: what the ``vision`` term prices).
  The encoder's shape flags are required as the language model's are
  (``command_line.resolve_model``).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.tools.argument_types import positive_int
from megatron_dcp.tools.bench_train.run_flags import DEFAULTS
from megatron_dcp.tools.workloads import read_lengths

TRAINING_SOURCES = ("--data-path", "--sft-data", "--varlen-distribution", "--varlen-lengths-file")
SOURCES = ("--lengths", "--hf-dataset", *TRAINING_SOURCES)
CHAT_TOKENIZER = "HuggingFaceTokenizer"


@dataclass
class Samples:
    """The samples' lengths in training's order, where they came from, and what to know."""

    lengths: List[int]
    source: str
    notes: List[str] = field(default_factory=list)
    patches: Optional[List[int]] = None  # vision-language data: each sample's encoder patches
    tiles: Optional[List[int]] = None  # and its image tiles


def attribute(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def given_value(args: argparse.Namespace, flag: str) -> Any:
    value = getattr(args, attribute(flag), None)
    return " ".join(value) if isinstance(value, list) else value


def chosen_source(args: argparse.Namespace) -> str:
    """The one data-source flag given; ValueError for none or several."""
    given = [flag for flag in SOURCES if getattr(args, attribute(flag), None)]
    if not given:
        raise ValueError(
            "no data source: give one of --data-path PREFIX (a megatron indexed dataset), "
            "--sft-data FILE (conversations, with --tokenizer-model DIR), --hf-dataset NAME "
            "--text-field F, or --lengths FILE (one sequence length a line)."
        )
    if len(given) > 1:
        named = " and ".join(f"{flag}={given_value(args, flag)!r}" for flag in given)
        raise ValueError(f"{named}: give exactly one data source; remove the others.")
    return given[0]


def read_samples(args: argparse.Namespace, count: int) -> Samples:
    """The lengths of the first ``count`` samples of the chosen source."""
    flag = chosen_source(args)
    readers: Dict[str, Callable[[argparse.Namespace, int], Samples]] = {
        "--lengths": lengths_file_samples,
        "--hf-dataset": hf_samples,
    }
    reader = readers.get(flag, training_samples)
    return reader(args, count)


def truncated(lengths: List[int], seq_length: int) -> List[int]:
    return [min(length, seq_length) for length in lengths]


def truncation_note(raw: List[int], seq_length: int) -> List[str]:
    over = sum(1 for length in raw if length > seq_length)
    if not over:
        return []
    return [f"{over} of {len(raw)} samples are longer than --seq-length {seq_length}: "
            "truncated to it, as training does"]  # fmt: skip


def lengths_file_samples(args: argparse.Namespace, count: int) -> Samples:
    """``--lengths FILE``: sample ``i`` has the file's length ``i mod n`` (cycled)."""
    file = read_lengths(args.lengths)
    raw = [file[index % len(file)] for index in range(count)]
    source = f"--lengths {args.lengths} ({len(file)} lengths, in order, cycled)"
    notes = truncation_note(raw, args.seq_length)
    return Samples(truncated(raw, args.seq_length), source, notes)


def check_tokenizer(args: argparse.Namespace) -> None:
    """``--sft-data`` renders conversations with a saved HuggingFace tokenizer's chat template."""
    if args.tokenizer_type not in (None, CHAT_TOKENIZER):
        raise ValueError(
            f"--tokenizer-type={args.tokenizer_type}: estimate reads conversations with a saved "
            f"HuggingFace tokenizer; pass --tokenizer-type {CHAT_TOKENIZER} --tokenizer-model DIR."
        )
    if not args.tokenizer_model:
        raise ValueError(
            f"--sft-data={args.sft_data}: conversations are measured in the tokens of their chat "
            "template; add --tokenizer-model DIR (a saved HuggingFace tokenizer with a chat "
            f"template, as training's --tokenizer-type {CHAT_TOKENIZER} takes)."
        )


def training_samples(args: argparse.Namespace, count: int) -> Samples:
    """The training entry point's train dataset of ``count`` samples, as training builds it."""
    if args.sft_data:
        check_tokenizer(args)
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir
    from megatron_dcp.integration.data.datasets import build_varlen_datasets

    chat = chat_tokenizer_from_dir(args.tokenizer_model) if args.sft_data else None
    train, _, _ = build_varlen_datasets(
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        seed=args.seed,
        num_samples=[count, 0, 0],
        distribution=args.varlen_distribution,
        lengths_file=args.varlen_lengths_file,
        data_path=args.data_path,
        split=args.split,
        sft_data=args.sft_data,
        chat=chat,
    )
    flag = next(flag for flag in TRAINING_SOURCES if getattr(args, attribute(flag)))
    source = f"{flag} {given_value(args, flag)} (training's train split, seed {args.seed})"
    return Samples([train.sequence_length(index) for index in range(count)], source)


def hf_samples(args: argparse.Namespace, count: int) -> Samples:
    """``--hf-dataset``: the rows in a seeded order (passes repeat), each text's token count."""
    rows = load_hf_rows(args)
    count_tokens, unit = token_counter(args)
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    raw: List[int] = []
    for position in range(count * len(order)):  # empty texts are skipped
        if len(raw) == count or (position == len(order) and not raw):
            break
        tokens = count_tokens(str(rows[order[position % len(order)]][args.text_field]))
        if tokens > 0:
            raw.append(tokens)
    if not raw:
        raise ValueError(f"--text-field={args.text_field}: every text of the dataset is empty.")
    source = f"--hf-dataset {args.hf_dataset} ({len(rows)} rows, seed {args.seed}; {unit})"
    return Samples(truncated(raw, args.seq_length), source, truncation_note(raw, args.seq_length))


def load_hf_rows(args: argparse.Namespace) -> Any:
    """The split of the Hugging Face dataset, checked for ``--text-field``."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"--hf-dataset={args.hf_dataset}: the Hugging Face datasets package is not "
            "installed; pip install datasets (or write the lengths to a file and pass --lengths)."
        ) from None
    if not args.text_field:
        raise ValueError(f"--hf-dataset={args.hf_dataset}: add --text-field F, the column of text.")
    files = {"data_files": args.data_files} if args.data_files else {}
    rows = datasets.load_dataset(args.hf_dataset, split=args.hf_split, **files)
    if args.text_field not in rows.column_names:
        raise ValueError(
            f"--text-field={args.text_field}: no such column in {args.hf_dataset}; its columns "
            f"are {', '.join(rows.column_names)}."
        )
    if len(rows) == 0:
        raise ValueError(f"--hf-dataset={args.hf_dataset}: split {args.hf_split!r} has no rows.")
    return rows


def token_counter(args: argparse.Namespace) -> "tuple[Callable[[str], int], str]":
    """Tokens of a text with ``--tokenizer-model``, else whitespace-separated words; and which."""
    if not args.tokenizer_model:
        return (lambda text: len(text.split())), (
            "no --tokenizer-model: tokens counted as whitespace-separated words, fewer than a "
            "subword tokenizer makes"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_model)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count, f"tokens of {args.tokenizer_model}"


# ----------------------------------------------------------------------------------------------
# Vision-language data

# pretrain_vlm's vision and data flags estimate reads: (type, help); default None (not given).
# The encoder's shape is required on vision-language data unless --model-preset gives it.
VISION_FLAGS: Dict[str, Tuple[Any, str]] = {
    "--vision-num-layers": (positive_int, "ViT layers (a vision flag turns on VLM data)"),
    "--vision-hidden-size": (positive_int, "ViT width"),
    "--vision-num-attention-heads": (positive_int, "ViT heads"),
    "--vision-ffn-hidden-size": (positive_int, "ViT MLP size (4 × width)"),
    "--vision-model-type": (str, "the encoder: clip, as pretrain_vlm builds"),
    "--img-h": (positive_int, "tile height in pixels"),
    "--img-w": (positive_int, "tile width in pixels"),
    "--patch-dim": (positive_int, "ViT patch size in pixels"),
}
VLM_DATA_FLAGS: Dict[str, Tuple[Any, str]] = {
    "--vlm-data": (str, "conversations with images (JSONL), with --tokenizer-model"),
    "--vlm-images-per-sample": (str, "mock images per sample, VALUE:WEIGHT,..."),
    "--vlm-tiles-per-image": (str, "mock tiles per image, VALUE:WEIGHT,..."),
    "--max-num-tiles": (positive_int, "most tiles an image is cut into (1)"),
}
CLASS_TOKEN_FLAG = "--disable-vision-class-token"
# Text sources a vision-language model does not read (pretrain_vlm refuses the first two).
TEXT_ONLY_SOURCES = ("--data-path", "--sft-data", "--lengths", "--hf-dataset")


def add_vlm_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "vision-language data and model (pretrain_vlm's flags; any one of them turns it on)"
    )
    for flag, (kind, text) in {**VLM_DATA_FLAGS, **VISION_FLAGS}.items():
        group.add_argument(flag, type=kind, default=None, help=text)
    group.add_argument(CLASS_TOKEN_FLAG, action="store_true", default=None,
                       help="the language model sees a tile's patches only")  # fmt: skip


def vlm_mode(args: argparse.Namespace) -> bool:
    """Whether a vision-language flag was given (data or model)."""
    flags = (*VLM_DATA_FLAGS, *VISION_FLAGS, CLASS_TOKEN_FLAG)
    return any(getattr(args, attribute(flag), None) is not None for flag in flags)


def prepare_vlm_args(args: argparse.Namespace) -> None:
    """Check the vision flags as pretrain_vlm does (``vlm_entry.check_vision_type``,
    ``check_vision_shape``; the encoder's shape is given or the preset's); refuse a text source
    next to them."""
    for flag in TEXT_ONLY_SOURCES:
        value = getattr(args, attribute(flag), None)
        if value:
            raise ValueError(
                f"{flag}={value!r} with vision-language flags: a vision-language model reads "
                "--vlm-data FILE.jsonl (or mock samples with images, their text lengths from "
                f"--varlen-distribution or --varlen-lengths-file); remove {flag} or the "
                "vision flags."
            )
    args.vision_model_type = args.vision_model_type or "clip"
    args.max_num_tiles = args.max_num_tiles or 1
    args.disable_vision_class_token = bool(args.disable_vision_class_token)
    args.num_channels = 3
    if not (args.vlm_data or args.varlen_distribution or args.varlen_lengths_file):
        args.varlen_distribution = DEFAULTS["--varlen-distribution"]  # bench-train's text
    from megatron_dcp.integration.training.vlm_entry import check_vision_shape, check_vision_type

    check_vision_type(args.vision_model_type)
    check_vision_shape(args)


def vlm_samples(args: argparse.Namespace, count: int) -> Samples:
    """The first ``count`` samples of pretrain_vlm's train dataset: combined lengths and
    encoder patches, in training's order (``--seed``)."""
    from megatron_dcp.integration.data.indexed import DEFAULT_SPLIT
    from megatron_dcp.integration.data.vlm_datasets import VLMDataConfig, build_vlm_datasets
    from megatron_dcp.integration.training.vlm_entry import vision_spec

    spec = vision_spec(args)
    chat = chat_of(args) if args.vlm_data else None
    config = VLMDataConfig(
        seq_length=args.seq_length, vocab_size=max(2, args.vocab_size), seed=args.seed,
        num_samples=(count, 0, 0), image_seq_length=spec.tokens_per_tile, img_h=args.img_h,
        img_w=args.img_w, max_num_tiles=args.max_num_tiles, vlm_data=args.vlm_data,
        images_per_sample=args.vlm_images_per_sample, tiles_per_image=args.vlm_tiles_per_image,
        split=args.split or DEFAULT_SPLIT, distribution=args.varlen_distribution,
        lengths_file=args.varlen_lengths_file,
    )  # fmt: skip
    train, _, _ = build_vlm_datasets(config, chat)
    tiles = [sample_tiles(train, index) for index in range(count)]
    lengths = [train.sequence_length(index) for index in range(count)]
    patches = [count_ * spec.patches_per_tile for count_ in tiles]
    return Samples(lengths, vlm_source(args, spec), [], patches, tiles)


def vlm_source(args: argparse.Namespace, spec: Any) -> str:
    if args.vlm_data:
        data = f"--vlm-data {args.vlm_data}"
    else:
        images = args.vlm_images_per_sample or "0:0.25,1:0.5,2:0.25"
        text = args.varlen_lengths_file or args.varlen_distribution
        data = f"mock images {images}, tiles {args.vlm_tiles_per_image or '1'}, text {text}"
    return (
        f"{data} (pretrain_vlm's train split, seed {args.seed}; {args.img_h}×{args.img_w} tiles "
        f"of {spec.tokens_per_tile} tokens and {spec.patches_per_tile} encoder patches)"
    )


def chat_of(args: argparse.Namespace) -> Any:
    """``--vlm-data`` is rendered with a saved HuggingFace tokenizer's chat template."""
    if not args.tokenizer_model:
        raise ValueError(
            f"--vlm-data={args.vlm_data}: conversations are measured in the tokens of their chat "
            "template; add --tokenizer-model DIR (a saved HuggingFace tokenizer with a chat "
            "template, as pretrain_vlm's --tokenizer-type HuggingFaceTokenizer takes)."
        )
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir

    return chat_tokenizer_from_dir(args.tokenizer_model)


def sample_tiles(dataset: Any, index: int) -> int:
    """Sample ``index``'s tiles, without reading its pixels: a mock sample's drawn layout, or a
    ``--vlm-data`` record's measured tile count."""
    if hasattr(dataset, "layout"):
        return sum(dataset.layout(index)[1])
    return int(dataset.table.columns[dataset.row(index), 3])


def image_summary(tiles: Sequence[int], patches: Sequence[int], vision: float) -> str:
    """One header line: how many samples have images, their tiles and patches, the term."""
    with_images = sum(1 for count in tiles if count)
    return (
        f"images: {with_images} of {len(tiles)} samples have images ({sum(tiles)} tiles, "
        f"{sum(patches):,} encoder patches); vision term {vision * 1e6:.3g} µs a patch"
    )


def batch_patches(patches: Optional[Sequence[int]], size: int) -> List[List[int]]:
    """The patches in global batches of ``size`` (what ``batches_of`` does to the lengths)."""
    if patches is None:
        return []
    return [list(patches[i : i + size]) for i in range(0, len(patches) - size + 1, size)]
