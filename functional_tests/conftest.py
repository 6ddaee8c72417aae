"""Functional tests are marked ``functional``: skip them locally with ``-m "not functional"``."""

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "functional: full training runs (minutes); -m 'not functional' skips them"
    )


def pytest_collection_modifyitems(items):
    for item in items:
        if "functional_tests" in str(item.fspath):
            item.add_marker(pytest.mark.functional)
