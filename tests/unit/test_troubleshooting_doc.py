"""docs/troubleshooting.md lists every refusal the package can print, and only messages the code
prints: checked both ways, without torch (the rules: ``troubleshooting_code``,
``troubleshooting_page`` and ``troubleshooting_ast`` beside this file).

Code to page: every refusal of the modules of ``SOURCES`` has an entry holding its first words;
every module of the package that raises refusals is in ``SOURCES`` or in ``INTERNAL`` (with the
reason its raises are bugs); every message rendered by running the code that prints it
(``troubleshooting_renders``: argparse's errors of the ``megatron-dcp`` commands, the check's
FAIL line) matches an entry. Page to code: every entry's message matches one the code raises or
prints, or a rendered one; the entries whose messages need torch to render
(``TORCH_RENDERED``) are left to tests/integration/test_troubleshooting_rendered.py, which
checks the whole page. Each check is shown to fail: an entry removed, a stale entry planted, a
new refusal in a module without an entry, a module with refusals outside the lists.
"""

import ast

import pytest
from troubleshooting_code import (
    INTERNAL,
    PACKAGE,
    SOURCES,
    Template,
    escaped,
    package_modules,
    raises_refusals,
    refusal_classes,
    refusals,
    source_templates,
)
from troubleshooting_page import DOC, TORCH_RENDERED, missing, unlisted, unmatched
from troubleshooting_renders import rendered_without_torch


@pytest.fixture(scope="module")
def known():
    """Every message the doc may hold: the code's templates and the rendered messages."""
    return source_templates() + rendered_without_torch()


def test_every_module_of_the_sources_exists_and_raises_something():
    """A module moved or emptied of refusals is seen, not silently skipped."""
    counted = [relative for modules in SOURCES.values() for relative in modules]
    assert [relative for relative in counted if not (PACKAGE / relative).exists()] == []
    assert [relative for relative in counted if not list(refusals(relative))] == []


def test_every_internal_module_exists_and_raises_refusals():
    """INTERNAL holds no module that moved or no longer raises what it is listed for."""
    trees = package_modules()
    classes = refusal_classes(trees.values())
    stale = [m for m in INTERNAL if m not in trees or not raises_refusals(trees[m], classes)]
    assert stale == []


def test_no_module_raises_refusals_outside_the_sources():
    outside = escaped(package_modules())
    assert outside == [], (
        "add these modules to SOURCES (tests/unit/troubleshooting_code.py) and their refusals to "
        f"docs/troubleshooting.md, or to INTERNAL with the reason they are bugs: {outside}"
    )


def test_every_refusal_has_an_entry_in_the_troubleshooting_doc():
    absent = missing(DOC.read_text())
    assert absent == [], "add to docs/troubleshooting.md:\n" + "\n".join(absent)


def test_every_rendered_message_has_an_entry():
    absent = unlisted(DOC.read_text(), rendered_without_torch())
    assert absent == [], "add to docs/troubleshooting.md:\n" + "\n".join(absent)


def test_every_entry_is_a_message_the_code_prints(known):
    stale = unmatched(DOC.read_text(), known, deferred=TORCH_RENDERED)
    assert stale == [], "no such message in the code:\n" + "\n".join(stale)


def test_each_section_is_a_heading_of_the_doc():
    headings = {line.lstrip("#").strip() for line in DOC.read_text().splitlines()}
    assert [section for section in SOURCES if section not in headings] == []


@pytest.mark.parametrize(
    "removed", ["needs --disable-bias-linear", "check sets these itself", "plan is for"]
)
def test_an_entry_removed_from_the_doc_is_missed(removed):
    """The check can fail: the doc without the paragraphs holding ``removed`` misses an entry."""
    text = DOC.read_text()
    kept = [block for block in text.split("\n\n") if removed not in block.replace("\n", " ")]
    assert len(kept) < len(text.split("\n\n"))
    assert missing("\n\n".join(kept)) != []


STALE = [
    # What the code said once, or never: the wording of each differs from what it prints now.
    "--varlen-distribution X is not a length distribution",
    "--use-kitchen ...: kitchen's modules need a GPU",
    "--qk-l2-norm with --heterogeneous-layers-config-path: megatron-core 0.19.2 builds "
    "heterogeneous layers without it",
    "--link-rate needs root (it creates network namespaces and tc qdiscs)",
    "error: argument --sequence-packing-scheduler: invalid choice: 'dynamic' (choose from ...)",
    "megatron-dcp estimate: error: argument --nproc: invalid positive_int value: 'x'",
    "megatron-dcp simulate: error: argument --dp-size: two is not an integer",
    "megatron-dcp check: FAIL ...",
    "--mtp-num-layers N on the CPU backend: multi-token prediction in a hybrid model ... is not "
    "built",
]


@pytest.mark.parametrize("message", STALE)
def test_a_stale_entry_is_reported(known, message):
    """The check can fail: an entry whose message the code does not print, planted in a copy of
    the doc, is the one reported."""
    planted = DOC.read_text().replace(
        "## Planning a batch\n", f"## Planning a batch\n\n- `{message}`. Fix: none.\n", 1
    )
    (found,) = unmatched(planted, known, deferred=TORCH_RENDERED)
    assert found.endswith(f": {message}")


def test_an_entry_that_starts_with_no_message_is_reported(known):
    planted = DOC.read_text().replace(
        "## Planning a batch\n", "## Planning a batch\n\n- Vision-language models: see vlm.md.\n"
    )
    (found,) = unmatched(planted, known, deferred=TORCH_RENDERED)
    assert "no message: Vision-language models" in found


NEW_MODULE = '''
from megatron_dcp.integration.config import DCP_FLAG

def check(value, spec):
    if value:
        raise ValueError(f"--frobnicate={value}: a brand-new refusal; drop it.")
    raise _error(spec, "the second new refusal")

def _error(spec, problem):
    return ValueError(f"{DCP_FLAG} with --frobnicate={spec!r}: {problem}.")
'''


def test_a_new_refusal_without_an_entry_is_reported():
    """The check can fail: a module of the sources that raises messages the doc does not list
    (one of them through a message builder) has both reported, with the module and line."""
    found = missing(DOC.read_text(), {"tools/cli/frobnicate.py": NEW_MODULE})
    assert found == [
        "megatron_dcp/tools/cli/frobnicate.py:6: --frobnicate … a brand-new refusal",
        "megatron_dcp/tools/cli/frobnicate.py:7: --dynamic-context-parallel … with --frobnicate",
    ]


def test_a_rendered_message_without_an_entry_is_reported():
    rendered = Template("megatron-dcp simulate --nope", "megatron-dcp simulate: error: argument "
                        "--nope: a brand-new argparse error")  # fmt: skip
    assert unlisted(DOC.read_text(), [rendered]) == [f"{rendered.where}: {rendered.text}"]


REFUSING_MODULES = {
    "value_error": "def f(x):\n    raise ValueError(f'--x={x}: refused')\n",
    "parser_error": "def f(p):\n    p.error('--x: refused')\n",
    "system_exit": "def f():\n    raise SystemExit('tool: refused')\n",
    "subclass": "from megatron_dcp.tools.bench_train.run import DigestMismatch\n"
    "def f():\n    raise DigestMismatch('arms differ')\n",
    "builder": "def f(x):\n    raise _error(x)\n"
    "def _error(x):\n    return ValueError(f'{x}: refused')\n",
}


@pytest.mark.parametrize("source", REFUSING_MODULES.values(), ids=REFUSING_MODULES)
def test_a_module_outside_the_sources_that_refuses_is_reported(source):
    """The check can fail: a new module that raises a ValueError (a subclass of another module,
    one made by a builder), calls ``parser.error`` or exits with a message is reported."""
    bench_run = "tools/bench_train/run.py"  # a source: it defines DigestMismatch(ValueError)
    trees = {bench_run: ast.parse((PACKAGE / bench_run).read_text())}
    trees["tools/new_tool.py"] = ast.parse(source)
    assert escaped(trees) == ["tools/new_tool.py"]


def test_a_module_that_raises_only_bugs_is_not_a_source():
    trees = {"tools/new_tool.py": ast.parse("def f():\n    raise RuntimeError('a bug')\n")}
    assert escaped(trees) == []
