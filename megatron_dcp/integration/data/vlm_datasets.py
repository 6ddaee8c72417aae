"""Vision-language datasets for the DCP entry points: the data flags, their checks and the three
splits, either the conversations and images of ``--vlm-data`` (``multimodal``) or mock samples
with images (``vlm_mock``). Every item is a :func:`~megatron_dcp.integration.data.vlm_samples.
make_vlm_sample` dict in combined coordinates; megatron's loader (micro-batch size 1, the DCP
runtime's) collates each field to ``[1, ...]``. See docs/vlm.md, "Data".

megatron's own ``--img-h``, ``--img-w``, ``--patch-dim`` and ``--num-channels`` give the tile
size; ``image_seq_length`` (the tokens per tile the language model sees, from the model's
settings, see :func:`~megatron_dcp.integration.data.vlm_samples.image_seq_length`) is the
caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from megatron_dcp.integration.data.chat import ChatTokenizer
from megatron_dcp.integration.data.conversations import SFT_DATA_FLAG, split_paths
from megatron_dcp.integration.data.datasets import (
    DEFAULT_DISTRIBUTION,
    SPLITS,
    check_prompt_fraction,
)
from megatron_dcp.integration.data.indexed import (
    DATA_PATH_FLAG,
    DEFAULT_SPLIT,
    check_split_range,
    split_document_ranges,
)
from megatron_dcp.integration.data.mock import (
    DISTRIBUTION_FLAG,
    LENGTHS_FILE_FLAG,
    PROMPT_FRACTION_FLAG,
    lengths_from_file,
    parse_length_distribution,
)
from megatron_dcp.integration.data.multimodal import (
    MAX_TILES_FLAG,
    VLM_DATA_FLAG,
    ImageOptions,
    MultimodalDataset,
    multimodal_table,
)
from megatron_dcp.integration.data.samples import first_rank
from megatron_dcp.integration.data.vlm_mock import (
    IMAGES_FLAG,
    TILES_FLAG,
    VLMMockDataset,
    VLMMockShape,
    check_shape,
    parse_discrete,
)

DEFAULT_IMAGES_PER_SAMPLE = "0:0.25,1:0.5,2:0.25"
DEFAULT_TILES_PER_IMAGE = "1"


@dataclass(frozen=True)
class VLMDataConfig:
    """Plain parameters of :func:`build_vlm_datasets` (the entry point fills them from args)."""

    seq_length: int
    vocab_size: int
    seed: int
    num_samples: Tuple[int, int, int]
    image_seq_length: int
    img_h: int = 224
    img_w: int = 224
    num_channels: int = 3
    max_num_tiles: int = 1
    vlm_data: Optional[str] = None
    images_per_sample: Optional[str] = None
    tiles_per_image: Optional[str] = None
    split: str = DEFAULT_SPLIT
    distribution: Optional[str] = None
    lengths_file: Optional[str] = None
    prompt_fraction: float = 0.0


def add_vlm_data_args(group: Any) -> None:
    """The vision-language data flags (megatron's ``--img-h``, ``--img-w``, ``--patch-dim``,
    ``--num-channels``, ``--seq-length``, ``--split`` and the ``--varlen-*`` mock flags are read
    too)."""
    group.add_argument(
        VLM_DATA_FLAG,
        default=None,
        metavar="PATH.jsonl[,PATH...]",
        help='Conversations with images, one JSONL record a line: {"messages": [...], '
        '"images": ["a.jpg", ...]} with an <image> marker per image (paths relative to the '
        "file); without it, mock samples with images (docs/vlm.md).",
    )
    group.add_argument(
        IMAGES_FLAG,
        default=None,
        metavar="SPEC",
        help="Mock data: images per sample, VALUE:WEIGHT pairs, e.g. '0:0.4,1:0.4,3:0.2' "
        f"(default '{DEFAULT_IMAGES_PER_SAMPLE}').",
    )
    group.add_argument(
        TILES_FLAG,
        default=None,
        metavar="SPEC",
        help="Mock data: tiles per image, VALUE:WEIGHT pairs with VALUE ≥ 1, e.g. '1:0.7,4:0.3' "
        f"(default '{DEFAULT_TILES_PER_IMAGE}'); at most {MAX_TILES_FLAG}.",
    )
    group.add_argument(
        MAX_TILES_FLAG,
        type=int,
        default=1,
        metavar="N",
        help="The most tiles an image is cut into (1: every image resized to one tile of "
        "--img-h × --img-w; more: the grid of at most N tiles closest to its aspect ratio).",
    )


def vlm_config_from_args(
    args: Any, image_seq_length: int, num_samples: Sequence[int]
) -> VLMDataConfig:
    """The :class:`VLMDataConfig` of parsed megatron arguments with :func:`add_vlm_data_args`."""
    counts = tuple(int(count) for count in num_samples) + (0, 0, 0)
    return VLMDataConfig(
        seq_length=args.seq_length,
        vocab_size=getattr(args, "padded_vocab_size", 0) or 0,
        seed=args.seed,
        num_samples=counts[:3],
        image_seq_length=image_seq_length,
        img_h=args.img_h,
        img_w=args.img_w,
        num_channels=args.num_channels,
        max_num_tiles=args.max_num_tiles,
        vlm_data=args.vlm_data,
        images_per_sample=getattr(args, "vlm_images_per_sample", None),
        tiles_per_image=getattr(args, "vlm_tiles_per_image", None),
        split=getattr(args, "split", None) or DEFAULT_SPLIT,
        distribution=getattr(args, "varlen_distribution", None),
        lengths_file=getattr(args, "varlen_lengths_file", None),
        prompt_fraction=getattr(args, "varlen_prompt_fraction", 0.0) or 0.0,
    )


def check_vlm_data_args(args: Any, image_seq_length: int) -> None:
    """The start-up checks of the vision-language data flags (no file is read): ValueError with
    the flag, the value and the fix. Other sources (``--sft-data``, ``--data-path``) are refused."""
    others = {SFT_DATA_FLAG: getattr(args, "sft_data", None)}
    others[DATA_PATH_FLAG] = getattr(args, "data_path", None)
    for flag, value in others.items():
        if value:
            raise ValueError(
                f"{flag}={value!r}: a vision-language model reads {VLM_DATA_FLAG} (or mock "
                f"samples with images without it); remove {flag}."
            )
    check_vlm_config(vlm_config_from_args(args, image_seq_length, (0, 0, 0)))


def check_vlm_config(config: VLMDataConfig) -> None:
    """ValueError for flags that cannot make vision-language samples (see docs/vlm.md)."""
    if config.max_num_tiles < 1:
        raise ValueError(f"{MAX_TILES_FLAG}={config.max_num_tiles}: give at least 1.")
    if config.image_seq_length < 1 or config.seq_length < 2:
        raise ValueError(
            f"--seq-length={config.seq_length} with {config.image_seq_length} tokens a tile: a "
            "sample needs one tile and one text token; raise --seq-length."
        )
    if config.vlm_data:
        _check_real(config)
        return
    if config.distribution and config.lengths_file:
        raise ValueError(
            f"{DISTRIBUTION_FLAG}={config.distribution!r} and {LENGTHS_FILE_FLAG}="
            f"{config.lengths_file!r}: give at most one source of text lengths; remove one."
        )
    check_prompt_fraction(config.prompt_fraction)
    _mock_shape(config)


def _check_real(config: VLMDataConfig) -> None:
    """``--vlm-data`` takes RGB images and no mock flag."""
    mock = {
        IMAGES_FLAG: config.images_per_sample,
        TILES_FLAG: config.tiles_per_image,
        DISTRIBUTION_FLAG: config.distribution,
        LENGTHS_FILE_FLAG: config.lengths_file,
        PROMPT_FRACTION_FLAG: config.prompt_fraction,
    }
    for flag, value in mock.items():
        if value:
            raise ValueError(
                f"{flag}={value!r} applies to mock data, not to {VLM_DATA_FLAG} (whose images, "
                f"lengths and loss mask are its own): remove {flag} or {VLM_DATA_FLAG}."
            )
    if config.num_channels != 3:
        raise ValueError(
            f"--num-channels={config.num_channels}: {VLM_DATA_FLAG} images are read as RGB; "
            "give --num-channels 3."
        )


def _mock_shape(config: VLMDataConfig) -> VLMMockShape:
    """The mock samples' shape, checked against ``--max-num-tiles`` and ``--seq-length``."""
    images = parse_discrete(config.images_per_sample or DEFAULT_IMAGES_PER_SAMPLE, IMAGES_FLAG)
    tiles = parse_discrete(config.tiles_per_image or DEFAULT_TILES_PER_IMAGE, TILES_FLAG, 1)
    if tiles.largest > config.max_num_tiles:
        raise ValueError(
            f"{TILES_FLAG}={tiles.spec!r} draws {tiles.largest} tiles but {MAX_TILES_FLAG} is "
            f"{config.max_num_tiles}; raise {MAX_TILES_FLAG} to {tiles.largest} or lower the "
            "tile counts."
        )
    shape = VLMMockShape(
        images, tiles, config.image_seq_length, config.seq_length, config.num_channels,
        config.img_h, config.img_w,
    )  # fmt: skip
    check_shape(shape)
    return shape


def build_vlm_datasets(
    config: VLMDataConfig, chat: Optional[ChatTokenizer] = None
) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
    """(train, valid, test) datasets of :func:`make_vlm_sample` items; None for a split of 0
    samples. ``config.vlm_data`` needs ``chat`` (the tokenizer with its chat template) and is
    divided into contiguous ``--split`` ranges, each read in a seeded permutation per pass;
    without it, mock samples with images."""
    check_vlm_config(config)
    if not config.vlm_data:
        return _mock_datasets(config)
    if chat is None:
        raise ValueError(f"{VLM_DATA_FLAG} needs a tokenizer with a chat template.")
    options = ImageOptions(
        config.img_h, config.img_w, config.max_num_tiles, config.image_seq_length,
        config.seq_length,
    )  # fmt: skip
    table = multimodal_table(split_paths(config.vlm_data), chat, options)
    _report(config, table.columns)
    ranges = split_document_ranges(config.split, len(table))
    source = f"the {len(table)} {VLM_DATA_FLAG} records"
    datasets = []
    for name, count, item_range in zip(SPLITS, config.num_samples, ranges):
        check_split_range(config.split, name, count, item_range, source, "records")
        dataset = MultimodalDataset(table, chat, options, count, config.seed, item_range, name)
        datasets.append(dataset if count > 0 else None)
    return tuple(datasets)


def _mock_datasets(config: VLMDataConfig) -> Tuple[Optional[VLMMockDataset], ...]:
    """(train, valid, test) mock datasets with images (the vocabulary is known by now)."""
    shape = _mock_shape(config)
    if config.vocab_size < 2:
        raise ValueError(
            f"vocab size {config.vocab_size}: mock data needs at least 2 tokens; set "
            "--vocab-size (or the tokenizer) to a larger vocabulary."
        )
    if config.lengths_file:
        lengths = lengths_from_file(config.lengths_file)
    else:
        lengths = parse_length_distribution(config.distribution or DEFAULT_DISTRIBUTION)
    return tuple(
        (
            VLMMockDataset(
                count, lengths, config.vocab_size, config.seed, shape, name, config.prompt_fraction
            )
            if count > 0
            else None
        )
        for name, count in zip(SPLITS, config.num_samples)
    )


def _report(config: VLMDataConfig, columns: np.ndarray) -> None:
    """Log (rank 0) how many records, tiles and tokens ``--vlm-data`` holds."""
    if first_rank():
        print(
            f"{VLM_DATA_FLAG}={config.vlm_data}: {columns.shape[0]:,} records, "
            f"{int(columns[:, 3].sum()):,} tiles, combined lengths "
            f"{int(columns[:, 2].min()):,} to {int(columns[:, 2].max()):,} tokens",
            flush=True,
        )
