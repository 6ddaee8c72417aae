"""Conversation files for supervised fine-tuning (``--sft-data PATH[,PATH...]``).

A file is JSONL (one JSON value a line) or one JSON array; each value is a *record* in megatron's
SFT format::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

As in megatron's SFT dataset, a record may hold several conversations back to back: each system
message after the first message starts a new one. Every conversation is checked here, and every
error names the file and the line where its record starts (:class:`ConversationError`).
Records are addressed by (file, index); JSONL records are re-read from their byte offset when a
sample needs them, so memory stays proportional to the number of records, not their text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

SFT_DATA_FLAG = "--sft-data"
LOSS_ON_PROMPT_FLAG = "--sft-loss-on-prompt"
SKIP_INVALID_FLAG = "--sft-skip-invalid"
ROLES = ("system", "user", "assistant", "tool")

Message = Dict[str, str]
Conversation = List[Message]


class ConversationError(ValueError):
    """A record that is not a valid conversation, with the file and line it starts on."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{SFT_DATA_FLAG}: {path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True)
class ConversationFile:
    """The records of one file: the line each starts on and, for JSONL, its byte offset (an
    array's records are held in ``values``)."""

    path: str
    lines: np.ndarray
    offsets: Optional[np.ndarray] = None
    values: Optional[List[Any]] = None
    blank_lines: int = 0

    def __len__(self) -> int:
        return int(self.lines.size)

    def record(self, index: int) -> Any:
        """The parsed JSON value of record ``index``."""
        if self.values is not None:
            return self.values[index]
        with open(self.path, "rb") as handle:
            handle.seek(int(self.offsets[index]))
            line = handle.readline()
        try:
            return json.loads(line.decode("utf-8").rstrip())
        except UnicodeDecodeError as error:
            raise self.error(index, f"not UTF-8 text (byte {error.start + 1})") from None
        except json.JSONDecodeError as error:
            raise self.error(index, f"not valid JSON ({json_error_place(error)})") from None

    def error(self, index: int, reason: str) -> ConversationError:
        return ConversationError(self.path, int(self.lines[index]), reason)


def json_error_place(error: json.JSONDecodeError) -> str:
    """The decoder's message and the column it stopped at, on the line the error is on (the
    line's trailing newline is not parsed, so an unfinished record ends on its own line)."""
    line_end = error.doc.find("\n", error.pos)
    at_end = not error.doc[error.pos : None if line_end < 0 else line_end].strip()
    return f"{error.msg}, column {error.colno}{' (the end of the line)' if at_end else ''}"


def split_paths(sft_data: Any) -> List[str]:
    """The file paths of ``--sft-data`` (comma-separated, or a list of such)."""
    items = [sft_data] if isinstance(sft_data, str) else list(sft_data)
    paths = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    if not paths:
        raise ValueError(f"{SFT_DATA_FLAG}={sft_data!r}: give one or more conversation files.")
    return paths


def open_conversation_files(paths: Sequence[str]) -> List[ConversationFile]:
    """Scan every file once: record offsets and lines (JSONL) or the parsed array (JSON)."""
    files = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(
                f"{SFT_DATA_FLAG}={path!r}: no such file; give JSONL or JSON files of "
                '{"messages": [{"role": ..., "content": ...}, ...]} records.'
            )
        files.append(_scan_array(path) if _is_json_array(path) else _scan_jsonl(path))
    return files


def _is_json_array(path: str) -> bool:
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(4096), b""):
            stripped = chunk.lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False


def _scan_jsonl(path: str) -> ConversationFile:
    lines, offsets, blank, offset = [], [], 0, 0
    with open(path, "rb") as handle:
        for number, text in enumerate(handle, start=1):
            if text.strip():
                lines.append(number)
                offsets.append(offset)
            else:
                blank += 1
            offset += len(text)
    return ConversationFile(
        path, np.asarray(lines, np.int64), np.asarray(offsets, np.int64), blank_lines=blank
    )


def _scan_array(path: str) -> ConversationFile:
    """Each element of the file's top-level JSON array, with the line it starts on."""
    text = Path(path).read_text(encoding="utf-8")
    decoder, values, lines = json.JSONDecoder(), [], []
    position, line, counted = _skip_space(text, text.index("[") + 1), 1, 0
    while position < len(text) and text[position] != "]":
        line += text.count("\n", counted, position)
        counted = position
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            reason = f"not valid JSON ({json_error_place(error)})"
            raise ConversationError(path, error.lineno, reason) from None
        values.append(value)
        lines.append(line)
        position = _skip_space(text, position)
        if position < len(text) and text[position] == ",":
            position = _skip_space(text, position + 1)
        elif position >= len(text) or text[position] != "]":
            raise ConversationError(path, line, "the JSON array is not closed after this element")
    return ConversationFile(path, np.asarray(lines, np.int64), values=values)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def conversations_of(record: Any, require_assistant: bool) -> Tuple[List[Conversation], str]:
    """The conversations of one record (split at system messages), or ``([], reason)`` when the
    record is not valid. ``require_assistant``: every conversation needs an assistant turn with
    content (the default masking trains on nothing else)."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return [], 'expected an object with a "messages" list'
    messages = record["messages"]
    if not messages:
        return [], 'empty conversation: "messages" is an empty list'
    for number, message in enumerate(messages, start=1):
        reason = _message_problem(message)
        if reason:
            return [], f"message {number}: {reason}"
    conversations = _split_at_system(messages)
    if require_assistant and not all(map(_has_assistant_turn, conversations)):
        return [], (
            "a conversation has no assistant turn with content, so the default loss mask "
            f"(assistant tokens only) leaves nothing to train on; add one, remove the record, "
            f"pass {LOSS_ON_PROMPT_FLAG} to train on every token, or {SKIP_INVALID_FLAG}"
        )
    return conversations, ""


def _message_problem(message: Any) -> str:
    if not isinstance(message, dict):
        return "not an object"
    if "role" not in message:
        return f'no "role" (one of {", ".join(ROLES)})'
    if message["role"] not in ROLES:
        return f'role {message["role"]!r} is not one of {", ".join(ROLES)}'
    if not isinstance(message.get("content"), str):
        return '"content" is missing or not a string'
    return ""


def _split_at_system(messages: List[Message]) -> List[Conversation]:
    conversations: List[Conversation] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def _has_assistant_turn(conversation: Conversation) -> bool:
    return any(m["role"] == "assistant" and m["content"] for m in conversation)
