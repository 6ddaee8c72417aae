"""Multimodal conversation files (``--vlm-data PATH.jsonl``): one conversation a line, in the SFT
format of ``conversations`` plus the images its ``<image>`` markers stand for::

    {"messages": [{"role": "user", "content": "<image>\\nWhat is in the picture?"},
                  {"role": "assistant", "content": "A red square."}],
     "images": ["pictures/square.png"]}

Image paths are relative to the JSONL file's directory (or absolute). Each ``<image>`` in a
message's text is one placeholder; the k-th takes the k-th image. The conversation is rendered
with the chat template, and only the assistant's tokens are in the loss (as ``chat``/``sft``
do); the rendered text is split at each ``<image>`` and tokenized piece by piece, so that each
marker becomes one :data:`IMAGE_TOKEN`. Images are opened with Pillow, converted to RGB, tiled
(:func:`tile_grid`) and normalised with CLIP's mean and standard deviation.

Every problem is a ValueError naming the file and line (and the image): a missing or unreadable
image, markers and images of different counts, a sample longer than ``--seq-length`` (never
truncated through an image), video or other unsupported entries. Nothing is dropped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_dcp.integration.data.chat import ChatTokenizer
from megatron_dcp.integration.data.conversations import (
    Conversation,
    ConversationFile,
    conversations_of,
    open_conversation_files,
)
from megatron_dcp.integration.data.samples import Sample, megatron_split, pass_position
from megatron_dcp.integration.data.vlm_samples import (
    IMAGE_TOKEN,
    combined_length,
    make_vlm_sample,
)

VLM_DATA_FLAG = "--vlm-data"
MAX_TILES_FLAG = "--max-num-tiles"
IMAGE_MARKER = "<image>"
UNSUPPORTED_MARKERS = ("<video>", "<audio>")
UNSUPPORTED_KEYS = ("video", "videos", "audio", "audios", "sound", "sounds")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class MultimodalError(ValueError):
    """A record that cannot become a sample, with the file and line it is on."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{VLM_DATA_FLAG}: {path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True)
class ImageOptions:
    """How images become tiles and how long a sample may be."""

    img_h: int
    img_w: int
    max_num_tiles: int
    image_seq_length: int  # tokens per tile the language model sees
    seq_length: int


@dataclass(frozen=True)
class Record:
    """A checked record: its conversation and the paths of its images (resolved)."""

    conversation: Conversation
    images: Tuple[str, ...]


def check_record(record: Any, base: Path) -> Record:
    """The conversation and image paths of one parsed JSON record; ValueError (a reason without
    the file and line) when it is not a one-conversation record with one image per marker."""
    if isinstance(record, dict):
        for key in UNSUPPORTED_KEYS:
            if key in record:
                raise ValueError(f'"{key}" entries are not supported (images only); remove them')
        for number, message in enumerate(record.get("messages") or [], start=1):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                raise ValueError(
                    f"message {number}: content is a list of parts; write it as one string "
                    f"with an {IMAGE_MARKER} marker where each image goes"
                )
    conversations, reason = conversations_of(record, require_assistant=True)
    if reason:
        raise ValueError(reason)
    if len(conversations) != 1:
        raise ValueError(
            "a system message after the first message starts a second conversation; write one "
            "conversation a line"
        )
    images = record.get("images", [])
    if not isinstance(images, list) or not all(isinstance(path, str) for path in images):
        raise ValueError('"images" must be a list of image paths (strings)')
    text = "".join(message["content"] for message in conversations[0])
    for marker in UNSUPPORTED_MARKERS:
        if marker in text:
            raise ValueError(f"{marker} markers are not supported (images only)")
    markers = text.count(IMAGE_MARKER)
    if markers != len(images):
        raise ValueError(
            f"{markers} {IMAGE_MARKER} marker(s) in the messages but {len(images)} image(s) in "
            f'"images"; give one image per marker, in order'
        )
    return Record(conversations[0], tuple(str(base / path) for path in images))


def tile_grid(
    width: int, height: int, img_h: int, img_w: int, max_num_tiles: int
) -> Tuple[int, int]:
    """``(rows, cols)`` with rows · cols ≤ ``max_num_tiles`` whose shape (cols · img_w wide,
    rows · img_h high) is closest to the image's aspect ratio, on a log scale. Among equally
    close grids: the one with the most tiles that the image's pixels fill at least half of,
    else the fewest tiles."""
    if max_num_tiles <= 1:
        return 1, 1
    aspect = math.log(width / height)
    grids = [
        (rows, cols)
        for rows in range(1, max_num_tiles + 1)
        for cols in range(1, max_num_tiles // rows + 1)
    ]
    distance = {grid: abs(math.log(grid[1] * img_w / (grid[0] * img_h)) - aspect) for grid in grids}
    best = min(distance.values())
    closest = sorted((g for g in grids if distance[g] - best < 1e-9), key=lambda g: g[0] * g[1])
    filled = [g for g in closest if width * height >= 0.5 * g[0] * g[1] * img_h * img_w]
    return filled[-1] if filled else closest[0]


def load_tiles(path: str, img_h: int, img_w: int, max_num_tiles: int) -> torch.Tensor:
    """float32 [tiles, 3, img_h, img_w]: the image as RGB, resized to its :func:`tile_grid`,
    cut into tiles row-major and normalised with CLIP's mean and std. OSError and Pillow's
    errors (a missing or unreadable file) pass through."""
    from PIL import Image

    with Image.open(path) as opened:
        image = opened.convert("RGB")
    rows, cols = tile_grid(image.width, image.height, img_h, img_w, max_num_tiles)
    image = image.resize((cols * img_w, rows * img_h), Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32) / 255.0  # [rows·h, cols·w, 3]
    pixels = (pixels - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    tiles = pixels.reshape(rows, img_h, cols, img_w, 3).transpose(0, 2, 4, 1, 3)
    return torch.from_numpy(np.ascontiguousarray(tiles.reshape(rows * cols, 3, img_h, img_w)))


def image_tile_count(path: str, options: ImageOptions) -> int:
    """The tiles of one image, from its header (no pixels decoded)."""
    from PIL import Image

    with Image.open(path) as opened:
        width, height = opened.size
    rows, cols = tile_grid(width, height, options.img_h, options.img_w, options.max_num_tiles)
    return rows * cols


def tokenize_with_images(chat: ChatTokenizer, conversation: Conversation) -> Tuple[np.ndarray, ...]:
    """``(ids, assistant)`` as :meth:`ChatTokenizer.tokenize` gives them, but with the rendered
    text split at each ``<image>`` and that marker as one :data:`IMAGE_TOKEN` (never the
    assistant's)."""
    text = chat.render(conversation)
    spans = chat.assistant_spans(conversation, text)
    pieces = text.split(IMAGE_MARKER)
    ids: List[int] = []
    starts: List[int] = []
    offset = 0
    for number, piece in enumerate(pieces):
        if number:
            ids.append(IMAGE_TOKEN)
            starts.append(-1)
            offset += len(IMAGE_MARKER)
        encoded = chat.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        ids.extend(encoded["input_ids"])
        starts.extend(offset + start for start, _ in encoded["offset_mapping"])
        offset += len(piece)
    ids_array, starts_array = np.asarray(ids, np.int64), np.asarray(starts, np.int64)
    assistant = np.zeros(ids_array.size, dtype=bool)
    for begin, end in spans:
        inside = np.flatnonzero((starts_array >= begin) & (starts_array < end))
        assistant[inside[chat.assistant_prefix_len :]] = True
    return ids_array, assistant


def text_sample(chat: ChatTokenizer, record: Record) -> Tuple[torch.Tensor, ...]:
    """``(tokens, labels, loss_mask)`` of a record in text coordinates (placeholders as
    :data:`IMAGE_TOKEN`, next-token labels, the assistant's labels in the loss)."""
    ids, assistant = tokenize_with_images(chat, record.conversation)
    markers = int((ids == IMAGE_TOKEN).sum())
    if markers != len(record.images):
        raise ValueError(
            f"the chat template renders {markers} {IMAGE_MARKER} marker(s), the messages hold "
            f"{len(record.images)}; use a template that writes each message's content unchanged"
        )
    if ids.size < 2 or ids[-1] == IMAGE_TOKEN:
        raise ValueError("the rendered conversation needs a text token after its last image")
    tokens, labels = torch.from_numpy(ids[:-1].copy()), torch.from_numpy(ids[1:].copy())
    return tokens, labels, torch.as_tensor(assistant[1:], dtype=torch.float32)


def measure_record(chat: ChatTokenizer, record: Record, options: ImageOptions) -> Tuple[int, int]:
    """``(combined length, total tiles)`` of a record, refusing one over ``--seq-length``."""
    tokens, _, _ = text_sample(chat, record)
    tiles = [_image(path, image_tile_count, options) for path in record.images]
    length = combined_length(tokens.numel(), tiles, options.image_seq_length)
    if length > options.seq_length:
        raise ValueError(
            f"{length} tokens ({tokens.numel() - len(tiles)} text, {sum(tiles)} tile(s) of "
            f"{options.image_seq_length}) exceed --seq-length {options.seq_length}; samples are "
            f"never cut through an image: raise --seq-length to at least {length}, lower "
            f"{MAX_TILES_FLAG}, or shorten the conversation"
        )
    return length, sum(tiles)


def encode_record(chat: ChatTokenizer, record: Record, options: ImageOptions) -> Sample:
    """The :func:`make_vlm_sample` of a record (its images read and tiled)."""
    tokens, labels, loss_mask = text_sample(chat, record)
    tiles = [_image(path, load_tiles, options) for path in record.images]
    images = torch.cat(tiles) if tiles else torch.zeros(0, 3, options.img_h, options.img_w)
    counts = [tile.shape[0] for tile in tiles]
    return make_vlm_sample(tokens, labels, loss_mask, images, counts, options.image_seq_length)


def _image(path: str, read: Any, options: ImageOptions) -> Any:
    """``read`` applied to an image; its failures as a ValueError naming the image."""
    from PIL import UnidentifiedImageError

    if not Path(path).is_file():
        raise ValueError(f"image {path!r}: no such file (paths are relative to the JSONL file)")
    try:
        if read is image_tile_count:
            return read(path, options)
        return read(path, options.img_h, options.img_w, options.max_num_tiles)
    except (OSError, UnidentifiedImageError, ValueError) as error:
        raise ValueError(f"image {path!r}: cannot be read as an image ({error})") from None


@dataclass(frozen=True)
class MultimodalTable:
    """Every record of the ``--vlm-data`` files, in file order: its file and record index, its
    combined length and its tiles (``columns``, int64 [n, 4])."""

    files: List[ConversationFile]
    columns: np.ndarray

    def __len__(self) -> int:
        return int(self.columns.shape[0])

    def record(self, index: int) -> Record:
        """The checked record of row ``index`` (re-read from its file)."""
        file, number = (int(value) for value in self.columns[index, :2])
        return read_record(self.files[file], number)


def read_record(file: ConversationFile, number: int) -> Record:
    """Record ``number`` of a file, parsed and checked; :class:`MultimodalError` when not valid."""
    line = int(file.lines[number])
    try:
        record = file.record(number)
    except ValueError as error:
        raise MultimodalError(file.path, line, getattr(error, "reason", str(error))) from None
    try:
        return check_record(record, Path(file.path).parent)
    except ValueError as error:
        raise MultimodalError(file.path, line, str(error)) from None


def multimodal_table(
    paths: Sequence[str], chat: ChatTokenizer, options: ImageOptions
) -> MultimodalTable:
    """Read, check and measure every record (image headers only, no pixels): the first problem
    stops with its file and line."""
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(
                f"{VLM_DATA_FLAG}={path!r}: no such file; give a JSONL file of "
                '{"messages": [...], "images": [...]} records (docs/vlm.md).'
            )
    files = open_conversation_files(paths)
    rows = []
    for index, file in enumerate(files):
        for number in range(len(file)):
            record = read_record(file, number)
            try:
                length, tiles = measure_record(chat, record, options)
            except ValueError as error:
                raise MultimodalError(file.path, int(file.lines[number]), str(error)) from None
            rows.append((index, number, length, tiles))
    if not rows:
        raise ValueError(f"{VLM_DATA_FLAG}={','.join(paths)!r}: no record to train on.")
    return MultimodalTable(files, np.asarray(rows, dtype=np.int64).reshape(-1, 4))


class MultimodalDataset(Dataset):
    """``num_samples`` samples over the records ``[begin, end)`` of a table (passes repeat in a
    fresh seeded permutation each; in order when ``seed`` is None); items are
    :func:`make_vlm_sample` dicts."""

    def __init__(
        self,
        table: MultimodalTable,
        chat: ChatTokenizer,
        options: ImageOptions,
        num_samples: int,
        seed: Optional[int],
        record_range: Tuple[int, int],
        split: str = "train",
    ) -> None:
        self.table, self.chat, self.options = table, chat, options
        self.num_samples, self.seed = num_samples, seed
        self.begin, self.end = record_range
        self.split_name, self.split = split, megatron_split(split)

    def __len__(self) -> int:
        return self.num_samples

    def row(self, index: int) -> int:
        """The table row of sample ``index``."""
        return self.begin + pass_position(index, self.num_samples, self.end - self.begin, self.seed)

    def sequence_length(self, index: int) -> int:
        """The combined length L of sample ``index``, without reading its images."""
        return int(self.table.columns[self.row(index), 2])

    def __getitem__(self, index: int) -> Sample:
        row = self.row(index)
        file, number = (int(value) for value in self.table.columns[row, :2])
        try:
            return encode_record(self.chat, self.table.record(row), self.options)
        except MultimodalError:
            raise
        except ValueError as error:  # an image changed or vanished since the table was built
            path = self.table.files[file].path
            raise MultimodalError(path, int(self.table.files[file].lines[number]), str(error))
