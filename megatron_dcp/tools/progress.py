"""Progress of a long command on its standard output: how far it is, how long it has run and
about how long is left. On a terminal one line is rewritten in place (``\\r``) at most every
half second; otherwise (a log file, a pipe, CI) a plain line is printed at most every
``every_s`` seconds, and always for the last item, so that a log shows the run advancing
without filling up. Nothing is printed by the work itself: the command calls :meth:`update`
between its items (never from training's hot path)."""

from __future__ import annotations

import re
import sys
import time
from typing import Callable, Optional, TextIO

TERMINAL_EVERY_S = 0.5
PLAIN_EVERY_S = 30.0
DCP_ITERATION = re.compile(r"\[DCP\] iteration\s+(\d+)")  # a training iteration's log line


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s`` or ``1 h 2 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


class Progress:
    """``label: done/total units, elapsed, ~left[, note]`` (see the module docstring)."""

    def __init__(
        self,
        label: str,
        total: int,
        units: str = "",
        stream: Optional[TextIO] = None,
        every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.units = label, total, units
        self.stream = stream or sys.stdout
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = TERMINAL_EVERY_S if self.terminal else every_s
        self.clock, self.started = clock, clock()
        self.shown_at: Optional[float] = None

    def line(self, done: int, note: str = "") -> str:
        elapsed = self.clock() - self.started
        text = f"{self.label}: {done}/{self.total}{' ' + self.units if self.units else ''}"
        text += f", {duration(elapsed)}"
        if 0 < done < self.total:
            text += f", ~{duration(elapsed * (self.total - done) / done)} left"
        return text + (f", {note}" if note else "")

    def update(self, done: int, note: str = "") -> None:
        """Report ``done`` of ``total`` (shown when due, and always at the last)."""
        now = self.clock()
        due = self.shown_at is None or now - self.shown_at >= self.every_s
        if not due and done < self.total:
            return
        self.shown_at = now
        if self.terminal:
            end = "\n" if done >= self.total else ""
            self.stream.write("\r\033[K" + self.line(done, note) + end)
        else:
            self.stream.write(self.line(done, note) + "\n")
        self.stream.flush()


def iteration_reader(
    progress: Progress, note: Callable[[int], str] = lambda iteration: ""
) -> Callable[[str], None]:
    """A reader of a training run's output, line by line (``launcher.run_pretrain``'s
    ``on_line``), that reports each finished iteration: its ``[DCP]`` line, which rank 0 prints
    after the step. ``note(iteration)`` adds what the command knows of it (a batch, an arm)."""

    def read(line: str) -> None:
        match = DCP_ITERATION.search(line)
        if match:
            iteration = int(match.group(1))
            progress.update(iteration, note(iteration))

    return read
