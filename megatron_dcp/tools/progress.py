"""Progress of a long command, drawn by tqdm: how far it is, how long it has run and about how
long is left. On a terminal tqdm's bar is redrawn in place at most every half second; otherwise
(a log file, a pipe, CI) a plain line is printed for the first finished item, then at most every
``every_s`` seconds, and always for the last, so that a log shows the run advancing without
filling up.

The clock starts at the first finished item: the start-up before it (processes, imports, the
first item's set-up) counts neither as elapsed time nor in the rate, so the estimate of what is
left comes from the items since. Nothing is printed by the work itself: the command calls
:meth:`Progress.update` between its items (never from training's hot path), and no background
thread draws (tqdm's monitor thread is off)."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Optional, TextIO

from tqdm import tqdm

TERMINAL_EVERY_S = 0.5
PLAIN_EVERY_S = 30.0
PLAIN_WIDTH = 10_000  # a plain line is never cut (tqdm cuts its lines to the terminal's width)
TERMINAL_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}{postfix}]"
PLAIN_FORMAT = "{desc}: {n_fmt}/{total_fmt}{unit}, {elapsed} elapsed, {remaining} left{postfix}"
DCP_ITERATION = re.compile(r"\[DCP\] iteration\s+(\d+)")  # a training iteration's log line


class _Meter(tqdm):
    """tqdm that, off a terminal, prints each display as a line of its own (tqdm itself would
    rewrite one line with ``\\r``, which a log keeps as one endless line)."""

    monitor_interval = 0  # no monitor thread: only Progress.update draws

    def __init__(self, plain: bool, **kwargs) -> None:
        self.plain = plain  # before tqdm's __init__, which draws the first display
        super().__init__(**kwargs)

    def display(self, msg: Optional[str] = None, pos: Optional[int] = None) -> bool:
        if not self.plain:
            return super().display(msg, pos)
        if msg == "":  # tqdm clearing its line: nothing to clear in a log
            return False
        self.fp.write(f"{self if msg is None else msg}\n")
        self.fp.flush()
        return True


class Progress:
    """``label: done/total units, elapsed, left[, note]`` (see the module docstring)."""

    def __init__(
        self,
        label: str,
        total: int,
        units: str = "",
        stream: Optional[TextIO] = None,
        every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self.label, self.total, self.units = label, total, units
        self.stream, self.every_s = stream or sys.stdout, every_s
        self.meter: Optional[_Meter] = None  # made at the first finished item

    def update(self, done: int, note: str = "") -> None:
        """Report ``done`` of ``total`` (shown when due, and always the first and the last)."""
        if self.meter is None:
            self.meter, shown = self._start(done, note), True
        else:
            self.meter.set_postfix_str(note, refresh=False)
            shown = self.meter.update(done - self.meter.n)
        if done >= self.total:
            if not shown:
                self.meter.refresh()
            self.meter.close()

    def _start(self, done: int, note: str) -> _Meter:
        """tqdm's meter from ``done`` on (its rate counts the items after it), drawn at once."""
        plain = not drawable(self.stream)
        return _Meter(
            plain,
            total=self.total,
            initial=done,
            desc=self.label,
            unit=f" {self.units}" if self.units else "",
            postfix=note or None,
            file=self.stream,
            leave=not plain,  # a terminal keeps the finished bar; a log has its last line
            mininterval=self.every_s if plain else TERMINAL_EVERY_S,
            miniters=1,
            smoothing=0,  # the mean rate since the first item, not a moving average
            dynamic_ncols=not plain,
            ncols=PLAIN_WIDTH if plain else None,
            bar_format=PLAIN_FORMAT if plain else TERMINAL_FORMAT,
        )


def drawable(stream: TextIO) -> bool:
    """Whether tqdm can draw its bar on ``stream``: a terminal, unless it has no width (a
    pseudo-terminal opened without a size, as by ``script`` or a container run with ``-t``,
    where tqdm would draw nothing)."""
    if not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):  # no file descriptor to ask: tqdm draws at its own width
        return True


def plain_line(label: str, done: int, total: int, units: str, elapsed: float) -> str:
    """The plain line of a progress measured elsewhere (a shell loop that times its items):
    ``elapsed`` is the finished items' time, so the estimate of what is left is their mean."""
    unit = f" {units}" if units else ""
    return tqdm.format_meter(done, total, elapsed, prefix=label, unit=unit, bar_format=PLAIN_FORMAT)


def iteration_reader(
    progress: Progress, note: Callable[[int], str] = lambda iteration: ""
) -> Callable[[str], None]:
    """A reader of a training run's output, line by line (``training_runs.run_pretrain``'s
    ``on_line``), that reports each finished iteration: its ``[DCP]`` line, which rank 0 prints
    after the step. ``note(iteration)`` adds what the command knows of it (a batch, an arm)."""

    def read(line: str) -> None:
        match = DCP_ITERATION.search(line)
        if match:
            iteration = int(match.group(1))
            progress.update(iteration, note(iteration))

    return read
