"""How docs/troubleshooting.md's check reads a message from the code (``troubleshooting_ast``)
and matches a message of the doc against it (``troubleshooting_page``), on small sources: the
values a name or call may hold become alternatives, each a message of its own; a hole stands for
one word of the doc, never none and never the doc message's first word inside a message."""

import pytest
from troubleshooting_code import Template, messages, template_text
from troubleshooting_page import unmatched

from troubleshooting_ast import expanded


def texts(source: str) -> list:
    """Every message a module source raises, each combination of alternatives one text."""
    found = [template_text(one) for _, message in messages(source) for one in expanded(message)]
    return sorted(text.replace("\x00", "<hole>") for text in found)


def test_a_name_holds_each_value_the_function_gives_it():
    source = '''
TABLE = {"a": "first reason", "b": "second reason"}

def check(kind, on_cpu):
    where = "on the CPU" if on_cpu else "on a GPU"
    reason = TABLE.get(kind)
    raise ValueError(f"--kind={kind} {where}: {reason}")
'''
    assert texts(source) == [
        "--kind=<hole> on a GPU: first reason",
        "--kind=<hole> on a GPU: second reason",
        "--kind=<hole> on the CPU: first reason",
        "--kind=<hole> on the CPU: second reason",
    ]


def test_loops_calls_and_builders_are_read_through():
    """A name's values are read through a ``for`` loop over a literal tuple, a tuple a module
    function returns and a builder's parameters; two names' values combine freely (a wider
    set of messages than the code makes, never a narrower one)."""
    source = '''
def where_and_fix(on_cpu):
    if on_cpu:
        return "on CPU", "use a GPU"
    return "here", "use TE"

def check(args, on_cpu):
    where, fix = where_and_fix(on_cpu)
    for flag, value in (("--a", args.a), ("--b", args.b)):
        if value:
            raise _error(flag, f"{where}; {fix}")

def _error(flag, problem):
    return ValueError(f"{flag}: {problem}.")
'''
    found = texts(source)
    assert {"--a: here; use TE.", "--a: on CPU; use a GPU.", "--b: on CPU; use a GPU."} < set(found)
    assert len(found) == 8  # the two names' values combine freely ("--a: here; use a GPU.")


def test_a_schedulingerror_template_takes_its_keyword_values():
    source = '''
def f(sample_id, n):
    which = f"sample {sample_id} has" if sample_id is not None else "a sequence has"
    raise SchedulingError("{budget}={value}: {which} {n} tokens", which=which, value=n, n=n)
'''
    assert texts(source) == [
        "<hole>=<hole>: a sequence has <hole> tokens",
        "<hole>=<hole>: sample <hole> has <hole> tokens",
    ]


CODE = [Template("m.py:1", "--qk-l2-norm \x00 with --heterogeneous: it is dropped")]


@pytest.mark.parametrize(
    "message,matches",
    [
        ("--qk-l2-norm True with --heterogeneous: it is dropped", True),  # a value for the hole
        ("--qk-l2-norm X with --heterogeneous", True),  # a placeholder for it
        ("with --heterogeneous: it is dropped", True),  # a stretch of the message
        ("--qk-l2-norm with --heterogeneous: it is dropped", False),  # no value for the hole
        ("--qk-l2-norm is on with --heterogeneous", False),  # a hole holds one word
        ("True with --heterogeneous: it is dropped", False),  # starts inside the hole
        ("--qk-l2-norm N with --heterogeneous: it is kept", False),
    ],
)
def test_a_message_of_the_doc_matches_a_stretch_of_one_of_the_code(message, matches):
    assert (unmatched(f"- `{message}`. Fix: none.\n", CODE) == []) is matches


def test_a_template_of_holes_does_not_match_any_message_of_as_many_words():
    """Half of the doc message's words (flags aside) must be written in the template."""
    holes = [Template("m.py:1", "\x00 \x00 \x00 GFLOP/s")]
    assert unmatched("- `megatron-dcp check: FAIL ...`. Fix: none.\n", holes) != []
