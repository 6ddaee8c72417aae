"""Start-up errors of the training entry points as a user should see them: the cause, once, as
the last line the worker prints, and no traceback.

- A ``ValueError`` of the start-up checks (the DCP flags, ``DCPConfig``, the model settings of
  ``compat``) becomes ``error: <message>`` on stderr, printed by rank 0 only (every rank runs the
  same checks on the same flags; the others exit silently, after rank 0), and exit status 2
  (:func:`startup_checks`).
- Standard output is held back while the arguments are parsed and checked
  (:func:`held_stdout`): megatron prints its argument dump (~900 lines) while it validates the
  arguments, before the DCP checks can run. A refused run drops it; a run that passes shows it
  as before.
- An argparse error (a typo in a choice value or in a flag name) prints a usage of the DCP flags
  only, not megatron's 1,500 lines, then argparse's one-line error with "did you mean ...?" for a
  near miss (:class:`EntryParser`); ``--help`` lists every flag (megatron's too).
- Under torchrun the refusal's line is also torchrun's "Root Cause", the last block it prints
  (:func:`record_for_launcher`). torchrun gives each worker an error file
  (``TORCHELASTIC_ERROR_FILE``), which torch's ``errors.record`` fills with an uncaught
  exception's traceback; a refusal is an exit, not an exception, so ``record`` writes nothing and
  the summary said only "To enable traceback see: ...". Each node's first worker (``LOCAL_RANK``
  0: rank 0 on the first node) writes the line there itself, in ``record``'s format, as it
  refuses. torchrun's root cause is the failure with the earliest time (in seconds; a tie goes to
  the worker seen failing first): the time in the file, or for a worker without one the time
  torchrun saw it fail. The node's other workers are still in their grace period when the writer
  refuses, so the writer is the root cause, and a node whose summary lists its workers shows the
  same line. Without torchrun (no error file) nothing is written.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, NoReturn, Optional, Sequence, Tuple

STARTUP_EXIT_STATUS = 2  # argparse's status for a command-line error
# How long the other ranks outlive a refusal: rank 0, which prints it, exits first.
RANK0_GRACE_S = 20.0
# Where torchrun asks each worker to write its error (torch.distributed.elastic's ErrorHandler).
ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
INVALID_CHOICE = re.compile(r"invalid choice: (?P<value>'[^']*'|\"[^\"]*\")")
CHOICES = re.compile(r"\(choose from (?P<choices>.*)\)\s*$")


def launch_rank(variable: str = "RANK") -> int:
    """This process's rank as the launcher set it: torchrun's ``RANK`` (global) or ``LOCAL_RANK``
    (on its node); 0 without a launcher."""
    try:
        return int(os.environ.get(variable, "0"))
    except ValueError:
        return 0


def refuse(message: str) -> NoReturn:
    """Print ``error: message`` on rank 0, after whatever was printed before it, and exit with
    status 2 (no traceback)."""
    sys.stdout.flush()
    line = f"error: {message}"
    if launch_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    exit_refused(line)


def record_for_launcher(line: str) -> None:
    """On each node's first worker, ``line`` as this worker's error in the file torchrun reads
    (``TORCHELASTIC_ERROR_FILE``; the JSON that ``torch.distributed.elastic.multiprocessing.errors
    .record`` writes, without a call stack): torchrun's failure summary shows it as the root
    cause. Nothing without the variable (no torchrun); a file that cannot be written is skipped
    (the refusal is printed and exits with status 2 all the same)."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if not path or launch_rank("LOCAL_RANK") != 0:
        return
    error = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(error, file)
    except OSError:
        pass


def exit_refused(line: str, grace_s: Optional[float] = None) -> NoReturn:
    """Give torchrun ``line``, the refusal (:func:`record_for_launcher`), and exit with status 2.
    A rank other than 0 waits ``grace_s`` first (default :data:`RANK0_GRACE_S`): torchrun stops
    every rank once one has exited, and the rank that prints the cause must not be stopped before
    it has printed it."""
    record_for_launcher(line)
    if launch_rank() != 0:
        time.sleep(RANK0_GRACE_S if grace_s is None else grace_s)
    raise SystemExit(STARTUP_EXIT_STATUS)


@contextmanager
def startup_checks() -> Iterator[None]:
    """A ``ValueError`` raised inside becomes :func:`refuse` (its message, once, no traceback)."""
    try:
        yield
    except ValueError as error:
        refuse(str(error))


def _stdout_fd() -> Optional[int]:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # not backed by a file (an in-memory stream): nothing to hold


@contextmanager
def held_stdout() -> Iterator[None]:
    """Hold back standard output (its file descriptor: ``print``, megatron's logging handler,
    native code) until the block ends. Released as it was printed unless the block is refused
    (a ``ValueError``, a command-line error): then it is dropped, and the refusal is the first
    and only thing shown."""
    fd = _stdout_fd()
    if fd is None:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    release = True
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        except BaseException as error:
            release = not is_refusal(error)
            raise
        finally:
            sys.stdout.flush()
            os.dup2(saved, fd)
            os.close(saved)
            if release:
                held.seek(0)
                with os.fdopen(os.dup(fd), "wb") as out:
                    shutil.copyfileobj(held, out)


def is_refusal(error: BaseException) -> bool:
    """A start-up refusal: a ``ValueError``, or an exit with an error status (argparse's)."""
    if isinstance(error, SystemExit):
        return error.code not in (0, None)
    return isinstance(error, ValueError)


class EntryParser:
    """megatron's parser (with the DCP flags) as an ``extra_args_provider`` returns it: reads
    ``argv`` (default: the command line) and answers a command-line error with ``usage`` (a
    callable; the DCP flags' usage) and argparse's one line plus "did you mean" for a near miss,
    on rank 0, exit status 2. ``check`` sees the parsed arguments before megatron validates
    them (its ValueError is a start-up refusal): for settings megatron's validation cannot reach
    on this machine (on CPU, ``--moe-grouped-gemm`` queries the CUDA device)."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        argv: Optional[Sequence[str]] = None,
        usage: Optional[Callable[[], str]] = None,
        check: Optional[Callable[[argparse.Namespace], Any]] = None,
    ) -> None:
        self.parser = parser
        self.argv = None if argv is None else list(argv)
        self.usage = usage or parser.format_usage
        self.check = check
        parser.exit_on_error = False  # argument errors come back here, before any usage
        parser.formatter_class = LiteralPercentHelpFormatter

    def parse_args(self) -> argparse.Namespace:
        args, unknown = self.parse_known_args()
        if unknown:
            self.fail(f"unrecognized arguments: {' '.join(unknown)}", self.near_flags(unknown))
        if self.check is not None:
            self.check(args)
        return args

    def parse_known_args(self) -> Tuple[argparse.Namespace, List[str]]:
        try:
            return self.parser.parse_known_args(self.argv)
        except argparse.ArgumentError as error:
            self.fail(str(error), near_choice(error.message))

    def fail(self, message: str, suggestion: Optional[str]) -> NoReturn:
        """The usage, then ``prog: error: message; did you mean X?`` (the last line)."""
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        error = f"{self.parser.prog}: error: {message}{hint}"
        if launch_rank() == 0:
            usage = self.usage().rstrip("\n")
            print(f"{usage}\n{error}", file=sys.stderr, flush=True)
        exit_refused(error)

    def near_flags(self, unknown: Sequence[str]) -> Optional[str]:
        """The known flag nearest to the first unknown one that resembles a flag, if near."""
        known = list(getattr(self.parser, "_option_string_actions", {}))
        for word in unknown:
            near = nearest(word.split("=", 1)[0], known) if word.startswith("--") else None
            if near:
                return near
        return None


def nearest(typed: str, options: Sequence[str]) -> Optional[str]:
    """The one option ``typed`` begins (``cpu`` -> ``cpu-gloo``), else the closest one by
    difflib's ratio (at least 0.6: a typo, not another word), else None."""
    starting = [option for option in options if option.lower().startswith(typed.lower())]
    if typed and len(starting) == 1:
        return starting[0]
    near = difflib.get_close_matches(typed, list(options), n=1)
    return near[0] if near else None


class LiteralPercentHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but a help text that is not a valid %-format (megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda`` says "10%") is shown as written: ``--help``
    no longer fails on it."""

    def _expand_help(self, action: argparse.Action) -> str:
        try:
            return super()._expand_help(action)
        except (ValueError, TypeError, KeyError):
            return str(action.help)


def near_choice(message: str) -> Optional[str]:
    """For argparse's "invalid choice: 'x' (choose from 'a', 'b')": the choice nearest to x
    (quoted), or None when none is near (or the message is another error)."""
    value, choices = INVALID_CHOICE.search(message), CHOICES.search(message)
    if value is None or choices is None:
        return None
    try:
        typed = ast.literal_eval(value.group("value"))
        options = ast.literal_eval(f"[{choices.group('choices')}]")
    except (SyntaxError, ValueError):
        return None
    near = nearest(str(typed), [str(option) for option in options])
    return repr(near) if near else None


def short_usage(prog: str, add_flags: Callable[[argparse.ArgumentParser], Any]) -> str:
    """The usage of the flags ``add_flags`` adds only, and where megatron's are listed."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    add_flags(parser)
    return parser.format_usage() + f"(the DCP flags; megatron's flags: {prog} --help)\n"
