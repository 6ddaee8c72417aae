"""Functional tests are marked ``functional`` (registered in ``pyproject.toml``): skip them
locally with ``-m "not functional"``, run only them with ``-m functional``."""

from pathlib import Path

import pytest

FUNCTIONAL_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of this directory (the hook sees every item of the session)."""
    for item in items:
        if FUNCTIONAL_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.functional)
