"""docs/troubleshooting.md's side of its check against the code (the code's side:
``troubleshooting_code``).

Code to page: one paragraph of the doc (a list item or a heading; backticks and line breaks
ignored) holds every key's pieces in order (:func:`missing`), and each rendered message matches a
message of the doc (:func:`unlisted`).

Page to code: every list item of the doc starts with the message it explains, in backticks, and
may chain more (`` `a`, `b` ``, `` `a` and `b` ``, ...). In a message, ``...`` / ``…``, a
``<word>`` and the capitals of :data:`PLACEHOLDER` (``N``, ``X``, ``PATH``, ...) stand for any
text. Each message must match a stretch of a message the code produces (:func:`unmatched`), a
template of the code's scan or a rendered message: its other characters are the template's,
or a hole's value, one word (never none: a doc that drops a value the code prints is stale);
it does not start inside a hole (a value of the middle of a message is not the doc's first
word); and at least half of its words (:func:`words`) are written in the template.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from troubleshooting_code import HOLE_MARK, PACKAGE, REPO, SOURCES, Template, refusals

DOC = REPO / "docs" / "troubleshooting.md"
# What stands for any text in a message of the doc.
PLACEHOLDER = re.compile(
    r"\.\.\.|…|<[a-z][a-z ]*>|\b(?:[A-Z]|PATH|FILES?|PREFIX|SPEC|ITEM|VALUE|WEIGHT|RATE|DIR)\b"
)
WORD = re.compile(r"[A-Za-z][A-Za-z0-9_]{2,}")
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")
# Rendered messages that need torch or megatron (tests/integration/
# test_troubleshooting_rendered.py renders them and checks the whole doc): the unit test leaves
# the doc's messages that start so to it.
TORCH_RENDERED = (
    "pretrain_gpt.py: error:",
    "device_check:",
    "--varlen-distribution='",
    "--varlen-lengths-file='",
)


def paragraphs(text: str) -> List[str]:
    """The doc's paragraphs: a heading, a list item or a block of lines; backticks dropped and
    white space collapsed."""
    blocks: List[List[str]] = [[]]
    for line in text.splitlines():
        starts = line.startswith(("#", "- ", "* ")) or not line.strip()
        if starts and blocks[-1]:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    return [" ".join(" ".join(block).replace("`", "").split()) for block in blocks if block]


def listed(parts: Sequence[str], blocks: Sequence[str]) -> bool:
    pattern = re.compile(".*?".join(re.escape(" ".join(part.split())) for part in parts))
    return any(pattern.search(block) for block in blocks)


def missing(doc_text: str, sources: Optional[Dict[str, str]] = None) -> List[str]:
    """Every refusal of :data:`SOURCES` (or of ``sources``: module -> its source) that no
    paragraph of the doc holds."""
    blocks = paragraphs(doc_text)
    absent = []
    if sources is None:
        sources = {m: (PACKAGE / m).read_text() for ms in SOURCES.values() for m in ms}
    for relative, source in sources.items():
        for line, parts in refusals(relative, source):
            if not listed(parts, blocks):
                absent.append(f"megatron_dcp/{relative}:{line}: {' … '.join(parts)}")
    return absent


@dataclass(frozen=True)
class Entry:
    """A list item of the doc: where it is and the messages it starts with."""

    line: int  # of the doc
    heading: str
    messages: Tuple[str, ...]
    text: str


ITEM = re.compile(r"^\s*[-*] (.*)")
FIRST = re.compile(r"`([^`]*)`")
CHAINED = re.compile(r"(?:, and|,|;| and| or)\s*`([^`]*)`")


def entry_messages(text: str) -> Tuple[str, ...]:
    """The backticked messages ``text`` starts with: the first, and those chained to it by a
    comma, a semicolon, "and" or "or" (one word in backticks is a name, not a message)."""
    first = FIRST.match(text)
    if first is None or " " not in first.group(1).strip():
        return ()
    found, rest = [first.group(1)], text[first.end():]
    while (chained := CHAINED.match(rest)) is not None:
        if " " in chained.group(1).strip():
            found.append(chained.group(1))
        rest = rest[chained.end():]
    return tuple(found)


def entries(doc_text: str) -> List[Entry]:
    """Every list item of the doc (its indented lines joined) with its messages."""
    found: List[Tuple[int, str, List[str]]] = []
    heading, item = "", None
    for number, line in enumerate(doc_text.splitlines(), 1):
        start = ITEM.match(line)
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if start is not None:
            item = (number, heading, [start.group(1)])
            found.append(item)
        elif item is not None and line.startswith(" ") and line.strip():
            item[2].append(line)
        else:
            item = None
    out = []
    for number, heading, lines in found:
        text = " ".join(" ".join(lines).split())
        out.append(Entry(number, heading, entry_messages(text), text))
    return out


def character(c: str) -> str:
    """The pattern of one character of a doc's message: itself, or (not a space) part of a
    hole's value: the hole's mark, consumed by the value's first character and still the last
    one consumed for the next ones."""
    if c == " ":
        return " "
    return f"(?:{re.escape(c)}|{HOLE_MARK}|(?<={HOLE_MARK}))"


def pattern_of(message: str) -> "re.Pattern[str]":
    """A message of the doc as a regular expression over a template's text: its placeholders
    match any text, its other characters themselves, or a hole that stands for a value of one
    word. It starts where the template starts, or at text of the template, not inside a hole
    (a value of the middle of a message cannot stand for the doc's first word)."""
    text = " ".join(message.split())
    parts = ["".join(map(character, fragment)) for fragment in PLACEHOLDER.split(text)]
    start = f"(?:^|(?<!{HOLE_MARK})(?=[^{HOLE_MARK}]))"
    return re.compile(start + ".*?".join(parts), re.DOTALL)


def words(text: str) -> Set[str]:
    """The words of three letters or more of ``text``, a doc's message without its
    placeholders and flags (a flag may be a value) or a template's text without its holes."""
    text = FLAG.sub(" ", PLACEHOLDER.sub(" ", text).replace(HOLE_MARK, " "))
    return set(WORD.findall(text))


class Matcher:
    """Whether a doc's message matches a template: the pattern (:func:`pattern_of`), and at
    least half of the message's words (:func:`words`) written in the template, so that a
    template made mostly of holes does not match any message of as many words."""

    def __init__(self, message: str) -> None:
        self.pattern = pattern_of(message)
        self.words = words(message)

    def __call__(self, template: Template, template_words: Set[str]) -> bool:
        if 2 * len(self.words & template_words) < len(self.words):
            return False
        return self.pattern.search(template.text) is not None


def unmatched(
    doc_text: str, known: Sequence[Template], deferred: Sequence[str] = ()
) -> List[str]:
    """Every message of the doc that matches none of ``known`` (templates and rendered
    messages), and every list item that starts with no message; the messages that start with
    one of ``deferred`` are left out."""
    found = []
    known_words = [words(template.text) for template in known]
    for entry in entries(doc_text):
        if not entry.messages:
            found.append(f"docs/troubleshooting.md:{entry.line}: no message: {entry.text[:60]}")
        for message in entry.messages:
            if message.startswith(tuple(deferred)):
                continue
            matches = Matcher(message)
            if not any(map(matches, known, known_words)):
                found.append(f"docs/troubleshooting.md:{entry.line}: {message}")
    return found


def unlisted(doc_text: str, rendered: Sequence[Template]) -> List[str]:
    """Every rendered message that no message of the doc matches."""
    matchers = [Matcher(m) for entry in entries(doc_text) for m in entry.messages]
    return [
        f"{message.where}: {message.text}"
        for message in rendered
        if not any(matches(message, words(message.text)) for matches in matchers)
    ]
