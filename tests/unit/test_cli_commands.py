"""README.md and ``megatron-dcp --help`` name every subcommand the command line registers.

The subcommands are read from the parser itself (``tools.cli.main.build_parser``, which imports
neither torch nor megatron: tests/unit/test_architecture.py). README's list is its sentence "The
command-line tools (...):"; it must name each subcommand once and nothing else.
"""

import argparse
import re
from pathlib import Path
from typing import List

from megatron_dcp.tools.cli.main import DESCRIPTION, build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
README_LIST = re.compile(r"The command-line tools \((.*?)\):")
NAME = re.compile(r"`(?:megatron-dcp )?([a-z][a-z-]*)`")


def subcommands() -> List[str]:
    """The names of the subcommands ``megatron-dcp`` registers, in registration order."""
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def readme_list(text: str) -> List[str]:
    """The commands README's sentence "The command-line tools (...):" names, in its order."""
    match = README_LIST.search(" ".join(text.split()))
    assert match, "README.md no longer has the sentence 'The command-line tools (...):'"
    return NAME.findall(match.group(1))


def test_the_parser_registers_the_subcommands():
    assert len(subcommands()) >= 10 and "estimate" in subcommands()


def test_readme_lists_every_subcommand_once():
    listed = readme_list(README.read_text())
    assert sorted(listed) == sorted(subcommands()), (
        f"README.md lists {listed}; megatron-dcp registers {subcommands()}"
    )


def test_the_help_description_names_every_subcommand():
    """Each subcommand starts a line of ``megatron-dcp --help``'s description."""
    named = re.findall(r"^  ([a-z][a-z-]*)\s", DESCRIPTION, re.M)
    assert sorted(named) == sorted(subcommands())
    assert build_parser().description == DESCRIPTION


def test_a_missing_command_is_seen():
    """The check can fail: README's sentence without ``estimate`` lists one command too few."""
    text = README.read_text().replace("`estimate`, ", "")
    assert sorted(readme_list(text)) != sorted(subcommands())
