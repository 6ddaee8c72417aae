"""One mutant of ``scripts/mutation_check.py`` (the lists: ``mutation_list.py``)."""

from __future__ import annotations

from dataclasses import dataclass

PATCHES = "megatron_dcp/integration/patches/"  # the patch table's modules


@dataclass(frozen=True)
class Mutant:
    """``original``, an exact snippet of ``path`` found there once, becomes ``replacement``;
    ``tests`` are expected to fail on it; ``breaks`` says what the mistake breaks."""

    id: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    breaks: str
