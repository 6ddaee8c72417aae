"""Fixtures shared by the unit tests."""

from typing import Iterator, List

import pytest

from megatron_dcp.scheduling import SCHEDULERS


@pytest.fixture
def registered_names() -> Iterator[List[str]]:
    """Names registered by a test are removed afterwards, so the test can run again."""
    names: List[str] = []
    yield names
    for name in names:
        SCHEDULERS.pop(name, None)
