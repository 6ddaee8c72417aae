"""Messages the package prints with no literal for ``troubleshooting_code`` to read, rendered by
running the code that prints them, without torch or megatron: argparse's errors of the
``megatron-dcp`` commands (their real parsers, through ``megatron-dcp``'s ``main``; each
argument type's refusal, an unknown choice, an unknown flag) and ``megatron-dcp check``'s FAIL
verdict (``tools.check.verdict`` on findings that fail). The training entry points' argparse
errors, device_check's verdict and the mock data's length errors need torch:
tests/integration/test_troubleshooting_rendered.py renders them."""

import contextlib
import io
from typing import List, Sequence

from troubleshooting_code import Template

# megatron-dcp command lines argparse refuses: each argument type's refusals
# (tools/argument_types.py), a choice and a flag that do not exist.
REFUSED_COMMAND_LINES = (
    ("simulate", "--dp-size", "two"),
    ("simulate", "--dp-size", "0"),
    ("simulate", "--min-cp-size", "3"),
    ("simulate", "--max-seqlen-per-dp-cp-rank", "1001"),
    ("estimate", "--context-parallel-size", "3"),
    ("calibrate", "--output", "p.json", "--hold-out", "half"),
    ("calibrate", "--output", "p.json", "--hold-out", "1.5"),
    ("calibrate", "--output", "p.json", "--lengths", ","),
    ("simulate", "--scheduler", "dynamic"),
    ("simulate", "--dp-sise", "2"),
)


def argparse_error(argv: Sequence[str]) -> str:
    """The last line ``megatron-dcp argv`` prints before argparse exits with status 2."""
    from megatron_dcp.tools.cli.main import main

    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.suppress(SystemExit):
        status = main(list(argv))
        raise AssertionError(f"megatron-dcp {' '.join(argv)} was not refused ({status})")
    return printed.getvalue().strip().splitlines()[-1]


def command_line_errors() -> List[Template]:
    return [
        Template(f"megatron-dcp {' '.join(argv)}", argparse_error(argv))
        for argv in REFUSED_COMMAND_LINES
    ]


def check_verdicts() -> List[Template]:
    """The FAIL line of findings that fail: a gradient away from the reference (in the bf16
    stage), and a tolerance over the ceiling."""
    from megatron_dcp.tools.check.layout_runs import Layout, LayoutResult
    from megatron_dcp.tools.check.tolerance import CEILING, Difference, tolerance
    from megatron_dcp.tools.check.verdict import failures, verdict_line

    found = []
    for stage, difference in (
        ("bf16", Difference("batch 1 dcp rank1 w2", 0.5, 1e-7, 1.5 * tolerance(1e-7, 0.5), 1)),
        ("", Difference("batch 0 dcp rank0 b", 1.0, CEILING, 0.0, runs=1, eps=2.0**-7)),
    ):
        sizes = {"static": [[2], [2]], "static_reordered": [[2], [2]], "dcp": [[1], [1, 2]]}
        result = LayoutResult(Layout(1, 2), cp_sizes=sizes, stage=stage)
        result.tokens = {arm: [100, 120] for arm in sizes}
        result.loss = [Difference("batch 0 loss", 500.0, 1e-4, 2e-4)]
        result.gradients = [Difference("batch 0 rank0 w", 1.0, 1e-7, 3e-7)]
        result.reference = [Difference("batch 0 static rank0 w", 1.0, 1e-7, 2e-7, runs=1)]
        result.reference.append(difference)
        line = verdict_line([result], failures(result))
        found.append(Template(f"tools/check/verdict.py ({stage or 'fp32'})", line))
    return found


def rendered_without_torch() -> List[Template]:
    return command_line_errors() + check_verdicts()
