"""Groups of one micro-batch kept ordered by per-rank load (the local search reads both ends)."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable, List, Sequence, Tuple

from megatron_dcp.scheduling.draft import GroupDraft

Entry = Tuple[float, int, GroupDraft]


class LoadIndex:
    """A micro-batch's groups sorted by ``(load, block start)``; update around every change."""

    def __init__(self, groups: Iterable[GroupDraft]) -> None:
        self.groups: List[GroupDraft] = list(groups)
        self._entries: List[Entry] = sorted((g.load, g.block.start, g) for g in self.groups)

    @property
    def top(self) -> GroupDraft:
        return self._entries[-1][2]

    @property
    def max_load(self) -> float:
        return self._entries[-1][0]

    @property
    def second_load(self) -> float:
        return self._entries[-2][0] if len(self._entries) > 1 else 0.0

    @property
    def mean_load(self) -> float:
        return sum(g.load * g.size for g in self.groups) / sum(g.size for g in self.groups)

    def lightest(self, count: int) -> Sequence[GroupDraft]:
        return [entry[2] for entry in self._entries[:count]]

    def detach(self, *groups: GroupDraft) -> None:
        """Take groups out before their loads change; :meth:`attach` them afterwards."""
        for group in groups:
            del self._entries[bisect_left(self._entries, (group.load, group.block.start))]

    def attach(self, *groups: GroupDraft) -> None:
        for group in groups:
            insort(self._entries, (group.load, group.block.start, group))
