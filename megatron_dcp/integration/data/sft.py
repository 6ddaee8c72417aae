"""SFT conversations as DCP samples (``--sft-data``): one conversation, one variable-length
sample, with only the assistant's tokens in the loss.

Building the datasets reads the files (``conversations``), then measures every conversation:
checks it, renders it with the chat template and counts its tokens (``chat``). That pass is
shared out over the ranks (rank r takes records r, r + W, ...) and the results are all-gathered,
so every rank holds the same :class:`ConversationTable` and one bad record stops every rank with
the same error. The table keeps only numbers; a sample re-reads and re-renders its conversation
when it is asked for, so memory does not grow with the text.

Sample ``i`` of a split is a pure function of (seed, split, i): the split's conversations
(contiguous ranges of the files' order, megatron's ``--split`` rounding) are read in a fresh
seeded permutation per pass, so a resumed run reads the next conversation the uninterrupted run
would have read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from megatron_dcp.integration.data.chat import ChatTokenizer
from megatron_dcp.integration.data.conversations import (
    SFT_DATA_FLAG,
    SKIP_INVALID_FLAG,
    Conversation,
    ConversationFile,
    conversations_of,
    open_conversation_files,
    split_paths,
)
from megatron_dcp.integration.data.indexed import check_split_range, split_document_ranges
from megatron_dcp.integration.data.samples import (
    Sample,
    first_rank,
    make_sample,
    megatron_split,
    pass_position,
    report_truncation,
)

_TABLES: Dict[Tuple[Any, ...], "ConversationTable"] = {}  # VPP builds the datasets per chunk


@dataclass(frozen=True)
class SFTOptions:
    """How conversations become samples: truncation, masking, and what to do with bad records."""

    seq_length: int
    loss_on_prompt: bool = False
    skip_invalid: bool = False


@dataclass(frozen=True)
class ConversationTable:
    """Every conversation of the files, in file order: its file, record and place in the record,
    its token count before truncation, how many of its labels are in the loss after truncation,
    and the invalid records skipped (``(file, record, reason)``, with ``--sft-skip-invalid``)."""

    files: List[ConversationFile]
    columns: np.ndarray  # [n, 5] int64: file, record, part, tokens, loss labels kept
    skipped: List[Tuple[int, int, str]]

    def __len__(self) -> int:
        return int(self.columns.shape[0])

    def conversation(self, index: int, options: SFTOptions) -> Conversation:
        file, record, part = (int(value) for value in self.columns[index, :3])
        parts, _ = conversations_of(self.files[file].record(record), not options.loss_on_prompt)
        return parts[part]

    def where(self, index: int) -> str:
        file, record = (int(value) for value in self.columns[index, :2])
        return f"{self.files[file].path}:{int(self.files[file].lines[record])}"


def encode(chat: ChatTokenizer, conversation: Conversation, options: SFTOptions) -> Sample:
    """The sample of one conversation: its tokens truncated to ``seq_length + 1``, next-token
    labels, and a loss mask on the labels the assistant wrote (every label with
    ``loss_on_prompt``). The last label is the conversation's own last token."""
    ids, assistant = chat.tokenize(conversation)
    kept = options.seq_length + 1
    sample = make_sample(torch.from_numpy(ids[:kept]))
    if not options.loss_on_prompt:
        sample["loss_mask"] = torch.as_tensor(assistant[1:kept], dtype=torch.float32)
    return sample


class SFTConversationDataset(Dataset):
    """``num_samples`` samples over the conversations ``[begin, end)`` of a table (passes repeat
    in a fresh seeded permutation each; in order when ``seed`` is None)."""

    def __init__(
        self,
        table: ConversationTable,
        chat: ChatTokenizer,
        options: SFTOptions,
        num_samples: int,
        seed: Optional[int],
        conversation_range: Tuple[int, int],
        split: str = "train",
    ) -> None:
        self.table, self.chat, self.options = table, chat, options
        self.num_samples, self.seed = num_samples, seed
        self.begin, self.end = conversation_range
        self.split_name, self.split = split, megatron_split(split)

    def __len__(self) -> int:
        return self.num_samples

    def conversation_index(self, index: int) -> int:
        """The table row of sample ``index``."""
        return self.begin + pass_position(index, self.num_samples, self.end - self.begin, self.seed)

    def sequence_length(self, index: int) -> int:
        tokens = int(self.table.columns[self.conversation_index(index), 3])
        return min(tokens, self.options.seq_length + 1) - 1

    def __getitem__(self, index: int) -> Sample:
        row = self.conversation_index(index)
        return encode(self.chat, self.table.conversation(row, self.options), self.options)


def build_sft_datasets(
    sft_data: Any,
    chat: ChatTokenizer,
    options: SFTOptions,
    seed: int,
    num_samples: Sequence[int],
    split: str,
) -> Tuple[Optional[SFTConversationDataset], ...]:
    """(train, valid, test) datasets of the ``--sft-data`` conversations; None for 0 samples."""
    table = conversation_table(split_paths(sft_data), chat, options)
    ranges = split_document_ranges(split, len(table))
    source = f"the {len(table)} {SFT_DATA_FLAG} conversations"
    datasets = []
    for name, count, item_range in zip(("train", "valid", "test"), num_samples, ranges):
        check_split_range(split, name, count, item_range, source, "conversations")
        dataset = SFTConversationDataset(table, chat, options, count, seed, item_range, name)
        datasets.append(dataset if count > 0 else None)
    return tuple(datasets)


def conversation_table(
    paths: Sequence[str], chat: ChatTokenizer, options: SFTOptions
) -> ConversationTable:
    """Measure every conversation once (shared out over the ranks) and log what was found."""
    key = (tuple(paths), id(chat.tokenizer), chat.template, options)
    if key not in _TABLES:
        files = open_conversation_files(paths)
        records = np.asarray([(f, r) for f, file in enumerate(files) for r in range(len(file))])
        rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        mine = measure(files, records.reshape(-1, 2)[rank::world], chat, options)
        table = _merged(files, _gathered(mine), options)
        _report(table, options)
        _TABLES[key] = table
    return _TABLES[key]


def measure(
    files: List[ConversationFile], records: np.ndarray, chat: ChatTokenizer, options: SFTOptions
) -> Tuple[List[Tuple[int, ...]], List[Tuple[int, int, str]]]:
    """``(rows, problems)`` of the given ``(file, record)`` pairs: a row (file, record, part,
    tokens, loss labels kept after truncation) per conversation, a problem (file, record,
    reason) per invalid record."""
    rows, problems = [], []
    for file, record in records.tolist():
        try:
            counts = _record_counts(files[file].record(record), chat, options)
        except ValueError as error:
            problems.append((file, record, getattr(error, "reason", str(error))))
            continue
        rows.extend((file, record, part, *count) for part, count in enumerate(counts))
    return rows, problems


def _record_counts(record: Any, chat: ChatTokenizer, options: SFTOptions) -> List[Tuple[int, int]]:
    """(tokens, loss labels kept after truncation) of each conversation of a record."""
    conversations, reason = conversations_of(record, not options.loss_on_prompt)
    if reason:
        raise ValueError(reason)
    counts = []
    for conversation in conversations:
        ids, assistant = chat.tokenize(conversation)
        if ids.size < 2:
            raise ValueError(f"renders to {ids.size} token(s): a sample needs 2 (one label)")
        kept = min(ids.size, options.seq_length + 1) - 1
        loss = kept if options.loss_on_prompt else int(assistant[1 : kept + 1].sum())
        counts.append((ids.size, loss))
    return counts


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gathered(mine: Any) -> List[Any]:
    if not _distributed():
        return [mine]
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def _merged(files: List[ConversationFile], parts: List[Any], options: SFTOptions) -> Any:
    """The table of every rank's rows, in file order; the first problem raised unless skipped."""
    rows = [row for part_rows, _ in parts for row in part_rows]
    problems = sorted(problem for _, part_problems in parts for problem in part_problems)
    if problems and not options.skip_invalid:
        file, record, reason = problems[0]
        more = f" ({len(problems) - 1} more invalid records)" if len(problems) > 1 else ""
        raise files[file].error(record, reason + more + f"; {SKIP_INVALID_FLAG} skips them")
    columns = np.asarray(sorted(rows), dtype=np.int64).reshape(-1, 5)
    if columns.shape[0] == 0:
        raise ValueError(
            f"{SFT_DATA_FLAG}={','.join(f.path for f in files)!r}: no conversation to train on."
        )
    return ConversationTable(files, columns, problems)


def _report(table: ConversationTable, options: SFTOptions) -> None:
    """Log (rank 0) what was read and skipped; truncation goes through ``report_truncation``."""
    files = table.files
    source = f"{SFT_DATA_FLAG}={','.join(file.path for file in files)}"
    report_truncation(source, table.columns[:, 3] - 1, options.seq_length)
    if not first_rank():
        return
    blank = sum(file.blank_lines for file in files)
    silent = int((table.columns[:, 4] == 0).sum())
    message = (
        f"{source}: {len(table):,} conversations from {sum(map(len, files)):,} records "
        f"({blank:,} blank lines skipped, {len(table.skipped):,} invalid records skipped"
    )
    if table.skipped:
        file, record, reason = table.skipped[0]
        message += f"; the first: {files[file].path}:{int(files[file].lines[record])}: {reason}"
    masking = "every token" if options.loss_on_prompt else "the assistant's tokens"
    message += f"); loss on {masking}; {silent:,} conversations have no loss token left"
    print(message, flush=True)
