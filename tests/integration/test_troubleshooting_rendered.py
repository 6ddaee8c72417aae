"""docs/troubleshooting.md's messages that only code needing torch or megatron renders, rendered by
running that code: the training entry point's argparse errors (megatron's parser with the DCP
flags, as ``python -m megatron_dcp.pretrain_gpt`` prints them), the mock data's length errors
worded with the flag, device_check's verdict line. Each must match an entry; and the whole page,
those entries included, must hold only messages the code prints (the unit test,
tests/unit/test_troubleshooting_doc.py, leaves the entries of these messages to this one)."""

import contextlib
import io
import sys
from pathlib import Path
from typing import List, Sequence

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.tools.launching.training_runs import flag_list

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "tests" / "unit"))  # the check's readers, shared with the unit test
sys.path.append(str(ROOT / "scripts"))

from troubleshooting_code import Template, source_templates  # noqa: E402
from troubleshooting_page import DOC, TORCH_RENDERED, unlisted, unmatched  # noqa: E402
from test_startup_errors import TINY  # noqa: E402
from troubleshooting_renders import rendered_without_torch  # noqa: E402

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

# TINY: a tiny model; each command line below is refused while its arguments are parsed.
TYPOS = (
    ("--max-seqlen-per-rank", "4096"),
    ("--sequence-packing-scheduler", "dynamic"),
    ("--sequence-packing-scheduler", "defualt_dynamic_cp"),
)


def entry_point_error(flags: Sequence[str]) -> str:
    """The last line ``python -m megatron_dcp.pretrain_gpt`` prints for TINY's flags and
    ``flags`` (argparse names the program after the module's file)."""
    from megatron_dcp import pretrain_gpt

    printed, argv = io.StringIO(), sys.argv
    sys.argv = [pretrain_gpt.__file__]
    try:
        with contextlib.redirect_stderr(printed), pytest.raises(SystemExit):
            pretrain_gpt.start([*flag_list(TINY), *flags], pretrain_gpt.check_args,
                               pretrain_gpt.gpt_config_from_args)  # fmt: skip
    finally:
        sys.argv = argv
    return printed.getvalue().strip().splitlines()[-1]


def length_errors() -> List[Template]:
    """The mock data's refusals of a length distribution and of a lengths file."""
    from megatron_dcp.integration.data.mock import lengths_from_file, parse_length_distribution

    found = []
    for read, value in ((parse_length_distribution, "foo:median=1024"),
                        (lengths_from_file, "/nonexistent/lengths.txt")):  # fmt: skip
        with pytest.raises(ValueError) as refused:
            read(value)
        found.append(Template(f"integration/data/mock.py {read.__name__}", str(refused.value)))
    return found


def device_check_verdict() -> Template:
    """The last line of ``scripts/device_check.sh`` on one GPU without Transformer Engine."""
    from device_results import Outcome, verdict_line

    line = verdict_line({
        "packages": Outcome(True, "packages ok"),
        "probe": Outcome(True, "probe ok"),
        "check": Outcome(False, "refused, nothing compared (--nproc=1: a DP×CP domain of one rank "
                         "has CP size 1 only, so DCP cannot mix CP sizes)"),
        "gpu_tests": Outcome(False, "nothing compared (0 passed 5 skipped)"),
    })  # fmt: skip
    return Template("scripts/device_results.py verdict_line", line)


@pytest.fixture(scope="module")
def rendered() -> List[Template]:
    """Every message of this module's renderers."""
    typos = [Template(f"pretrain_gpt {' '.join(f)}", entry_point_error(f)) for f in TYPOS]
    return typos + length_errors() + [device_check_verdict()]


def test_the_renderers_give_what_a_user_sees(rendered):
    texts = [message.text for message in rendered]
    assert texts[0].startswith("pretrain_gpt.py: error: unrecognized arguments: ")
    assert texts[2].endswith("did you mean 'default_dynamic_cp'?")
    assert texts[3].startswith("--varlen-distribution='foo:median=1024': unknown distribution")
    assert texts[4].startswith("--varlen-lengths-file='/nonexistent/lengths.txt': cannot read")
    assert texts[5].startswith("device_check: FAIL: check: refused")
    assert all(text.startswith(TORCH_RENDERED) for text in texts)


def test_every_message_rendered_here_has_an_entry(rendered):
    absent = unlisted(DOC.read_text(), rendered)
    assert absent == [], "add to docs/troubleshooting.md:\n" + "\n".join(absent)


def test_every_entry_of_the_doc_is_a_message_the_code_prints(rendered):
    known = source_templates() + rendered_without_torch() + rendered
    stale = unmatched(DOC.read_text(), known)
    assert stale == [], "no such message in the code:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "message",
    [
        "pretrain_gpt.py: error: unrecognized arguments: --max-seqlen-per-rank 4096; did you "
        "mean --max-seqlen-per-rank?",
        "pretrain_gpt.py: error: argument --sequence-packing-scheduler: invalid choice: "
        "'dynamic' (choose from 'dynamic_cp')",
        "--varlen-distribution='X' is not a length distribution",
        "device_check: FAIL (check)",
    ],
)
def test_a_stale_entry_of_a_rendered_message_is_reported(rendered, message):
    """The check can fail: such an entry, planted in a copy of the doc, is the one reported."""
    known = source_templates() + rendered_without_torch() + rendered
    planted = DOC.read_text().replace(
        "## Command-line typos\n", f"## Command-line typos\n\n- `{message}`. Fix: none.\n", 1
    )
    (found,) = unmatched(planted, known)
    assert found.endswith(f": {message}")
