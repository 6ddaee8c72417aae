"""The signatures and calls the docs show users match the code, so the docs cannot drift again.

Read from the Markdown (docs/*.md, README.md, tests/README.md), two forms:

- **Signatures**: a ```python block that is not valid Python lists signatures, one per entry
  starting in column 0 (``DCPConfig(max_seqlen_per_dp_cp_rank: int, ...)``, ``split_batch(...)
  -> SplitBatch``; rl.md's API block), and an inline span that is one signature with a ``*`` or
  ``**`` parameter (``run_distributed(fn, world_size, *args, ..., **kwargs)``). Each must name
  the code's parameters in the code's order, with the same kinds and the same defaults.
- **Calls**: every other ```python block and every inline code span (``split_batch(...,
  mtp_depth=D)``, ``DefaultDynamicCPScheduler(max_seqlen_per_dp_cp_rank=, cp_size=, ...)``).
  Each call of a megatron_dcp object must bind to its signature (keywords exist, no excess
  positional arguments; ``...`` stands for arguments left out).

Names resolve through the block's own imports, then ``megatron_dcp.adapters`` (rl.md's API
imports), ``megatron_dcp``, and dotted paths inside the package (``integration.forward_backward.X``); dev's
names that ``install_upstream_api()`` backs resolve to megatron_dcp's object. Names of other
libraries and names that resolve nowhere (methods such as ``as_batch()``) are not checked,
except in a signature block, where every entry must resolve.
"""

import ast
import importlib
import inspect
import re
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

REPO = Path(__file__).resolve().parents[2]
# Every page a user reads: docs/rl.md's API and docs/usage.md first among them.
DOCS = sorted(
    str(path.relative_to(REPO))
    for path in [*(REPO / "docs").glob("*.md"), REPO / "README.md", REPO / "tests" / "README.md"]
)
SEARCHED = ("megatron_dcp.adapters", "megatron_dcp")
# dev's names that megatron_dcp puts in place (docs/rl.md, "verl"), by where the code defines them.
BACKED = {
    "megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler": (
        "megatron_dcp.integration.megatron_dev_api.DefaultDynamicCPScheduler"
    ),
}
CALL_START = re.compile(r"(?<![\w.])([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)\(")
FENCE = re.compile(r"^```(\w*)\s*$")
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # may wrap lines, not paragraphs


@dataclass
class Snippet:
    where: str  # file:line
    text: str
    imports: Dict[str, str]  # local name -> dotted path, from the block's imports
    block: bool = False  # a ```python block (else an inline span)


def parenthesised(text: str, start: int) -> Optional[int]:
    """The index after the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index + 1
    return None


def blocks(path: str) -> Iterator[tuple]:
    """(first line number, language, text) of each fenced block, and (line, None, text) of the
    prose between them."""
    lines = (REPO / path).read_text().splitlines()
    language, start, body = None, 1, []
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence and language is None:
            yield start, None, "\n".join(body)
            language, start, body = fence.group(1) or "text", number + 1, []
        elif line.strip() == "```" and language is not None:
            yield start, language, "\n".join(body)
            language, start, body = None, number + 1, []
        else:
            body.append(line)
    yield start, language, "\n".join(body)


def block_imports(tree: ast.AST) -> Dict[str, str]:
    return {
        alias.asname or alias.name: f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def signature_entries(path: str, first: int, text: str) -> Iterator[Snippet]:
    """Entries of a signature block: from a column-0 ``name(`` to its closing parenthesis."""
    for match in CALL_START.finditer(text):
        line_start = text.rfind("\n", 0, match.start()) + 1
        if match.start() != line_start:
            continue
        end = parenthesised(text, match.end() - 1)
        assert end is not None, f"{path}:{first}: unclosed signature {match.group(1)}"
        where = f"{path}:{first + text.count(chr(10), 0, match.start())}"
        yield Snippet(where, text[match.start() : end], {})


def is_inline_signature(span: str) -> bool:
    """``name(a, b=1, *args, **kwargs)`` as a whole span, with a ``*`` or ``**`` parameter: the
    way prose shows a signature (a call of a megatron_dcp object would not spell out
    ``*args``)."""
    match = CALL_START.match(span)
    if not match or parenthesised(span, match.end() - 1) != len(span):
        return False
    try:
        call = ast.parse(span, mode="eval").body
        ast.parse(f"def _documented({span[match.end():-1]}): pass")
    except SyntaxError:
        return False
    return any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    )


def doc_snippets(path: str) -> tuple:
    """(signature entries, call snippets) of one document."""
    signatures: List[Snippet] = []
    calls: List[Snippet] = []
    for first, language, text in blocks(path):
        if language is None:
            for match in INLINE.finditer(text):
                where = f"{path}:{first + text.count(chr(10), 0, match.start())}"
                span = " ".join(match.group(1).split())
                shown = is_inline_signature(span) and resolve(span.split("(")[0], {})
                kind = signatures if shown else calls  # `fn(rank, *args)`: the user's fn
                kind.append(Snippet(where, span, {}))
        elif language == "python":
            try:
                tree = ast.parse(text)
            except SyntaxError:
                signatures += signature_entries(path, first, text)
            else:
                calls.append(Snippet(f"{path}:{first}", text, block_imports(tree), block=True))
    return signatures, calls


def resolve(name: str, imports: Dict[str, str]) -> Any:
    """The megatron_dcp object a documented name means, or None."""
    head, _, rest = name.partition(".")
    candidates = [BACKED.get(name, "")]
    if head in imports:
        candidates.append(".".join(filter(None, [imports[head], rest])))
    candidates += [f"{package}.{name}" for package in SEARCHED] + [name]
    for dotted in filter(None, candidates):
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute, None)
            if obj is not None:
                return obj if owned(obj) else None
            break
    return None


def owned(obj: Any) -> bool:
    return callable(obj) and getattr(obj, "__module__", "").startswith("megatron_dcp")


def dotted_name(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def calls_in(snippet: Snippet) -> Iterator[ast.Call]:
    """The calls of a Python block, or of each ``name(...)`` in an inline span; ``kw=`` with no
    value (a list of keywords) reads as ``kw=...``."""
    if snippet.block:
        yield from (n for n in ast.walk(ast.parse(snippet.text)) if isinstance(n, ast.Call))
        return
    text = re.sub(r"=\s*(?=[,)])", "=...", snippet.text)
    for match in CALL_START.finditer(text):
        end = parenthesised(text, match.end() - 1)
        try:
            tree = ast.parse(text[match.start() : end], mode="eval")
        except SyntaxError:
            continue
        yield from (n for n in ast.walk(tree) if isinstance(n, ast.Call))


def takes_any_keyword(signature: inspect.Signature) -> bool:
    """A ``**kwargs`` that uses what it takes (``**_`` ignores it: a keyword it absorbs is
    not a parameter)."""
    return any(p.kind is p.VAR_KEYWORD and p.name != "_" for p in signature.parameters.values())


def check_call(call: ast.Call, snippet: Snippet) -> Optional[str]:
    """Why the call does not bind to the documented object's signature (None: it binds)."""
    name = dotted_name(call.func)
    obj = resolve(name, snippet.imports) if name else None
    if obj is None:
        return None
    signature = inspect.signature(obj)
    elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args)
    positional = [object() for a in call.args if not isinstance(a, ast.Constant) or not elided]
    keywords = {k.arg: object() for k in call.keywords if k.arg is not None}
    unknown = sorted(set(keywords) - set(signature.parameters))
    if unknown and not takes_any_keyword(signature):
        return f"{snippet.where}: {name}{signature} has no parameter {', '.join(unknown)}"
    if (
        elided
        or any(k.arg is None for k in call.keywords)
        or any(isinstance(a, ast.Starred) for a in call.args)
    ):
        return None
    try:
        signature.bind_partial(*positional, **keywords)
    except TypeError as error:
        return f"{snippet.where}: {ast.unparse(call)} does not fit {name}{signature}: {error}"
    return None


def documented_parameters(entry: Snippet) -> tuple:
    """(name, parameters as (name, kind, default or inspect._empty)) of a signature entry."""
    name, _, rest = entry.text.partition("(")
    tree = ast.parse(f"def _documented({rest[:-1]}): pass").body[0].args
    defaults = [inspect.Parameter.empty] * (len(tree.args) - len(tree.defaults)) + tree.defaults
    parameters = [(a.arg, "positional or keyword", d) for a, d in zip(tree.args, defaults)]
    if tree.vararg:
        parameters.append((tree.vararg.arg, "var positional", inspect.Parameter.empty))
    parameters += [
        (a.arg, "keyword only", d if d is not None else inspect.Parameter.empty)
        for a, d in zip(tree.kwonlyargs, tree.kw_defaults)
    ]
    if tree.kwarg:
        parameters.append((tree.kwarg.arg, "var keyword", inspect.Parameter.empty))
    return name.strip(), parameters


def code_parameters(obj: Any) -> List[tuple]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional or keyword",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional or keyword",
        inspect.Parameter.VAR_POSITIONAL: "var positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword only",
        inspect.Parameter.VAR_KEYWORD: "var keyword",
    }
    return [(p.name, kinds[p.kind], p.default) for p in inspect.signature(obj).parameters.values()]


def listed(parameters: List[tuple]) -> str:
    stars = {"var positional": "*", "var keyword": "**"}
    return "(" + ", ".join(stars.get(kind, "") + n for n, kind, _ in parameters) + ")"


def shown_default(documented: Any) -> str:
    return "none" if documented is inspect.Parameter.empty else ast.unparse(documented)


def default_matches(documented: Any, actual: Any) -> bool:
    if documented is inspect.Parameter.empty or actual is inspect.Parameter.empty:
        return documented is actual
    try:
        return ast.literal_eval(documented) == actual
    except ValueError:  # not a literal (a name): only its presence is checked
        return True


def check_signature(entry: Snippet) -> List[str]:
    name, documented = documented_parameters(entry)
    obj = resolve(name, {})
    if obj is None:
        return [f"{entry.where}: {name} is not a megatron_dcp object"]
    actual = code_parameters(obj)
    if [(n, kind) for n, kind, _ in documented] != [(n, kind) for n, kind, _ in actual]:
        shown, code = listed(documented), listed(actual)
        return [f"{entry.where}: {name}{shown} in the doc, {code} in the code"]
    return [
        f"{entry.where}: {name}({n}) default {shown_default(d)} in the doc, "
        f"{'none' if a is inspect.Parameter.empty else repr(a)} in the code"
        for (n, _, d), (_, _, a) in zip(documented, actual)
        if not default_matches(d, a)
    ]


@pytest.mark.parametrize("path", DOCS)
def test_documented_signatures_match_the_code(path):
    signatures, _ = doc_snippets(path)
    problems = [problem for entry in signatures for problem in check_signature(entry)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS)
def test_documented_calls_bind_to_the_code(path):
    _, snippets = doc_snippets(path)
    problems = [
        problem
        for snippet in snippets
        for call in calls_in(snippet)
        if (problem := check_call(call, snippet))
    ]
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_rl_md_shows():
    """The parser finds rl.md's API block and the calls it must check (not a vacuous pass)."""
    signatures, snippets = doc_snippets("docs/rl.md")
    names = {documented_parameters(entry)[0] for entry in signatures}
    assert {"DCPConfig", "DCPConfig.for_model", "split_batch", "token_mean_loss"} <= names
    checked = {
        dotted_name(call.func)
        for snippet in snippets
        for call in calls_in(snippet)
        if resolve(dotted_name(call.func) or "", snippet.imports) is not None
    }
    assert {
        "split_batch",
        "create_dcp_groups",
        "megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler",
    } <= checked


def test_dcp_config_fields_are_its_signature():
    """rl.md documents DCPConfig by its constructor; a dataclass's fields are its parameters."""
    from megatron_dcp.adapters import DCPConfig

    assert is_dataclass(DCPConfig)
    assert [f.name for f in fields(DCPConfig)] == list(inspect.signature(DCPConfig).parameters)
