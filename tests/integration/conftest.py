"""Fixtures shared by the integration tests."""

import pytest

from megatron_dcp.integration.patches import (
    cpu_backend_enabled,
    disable_cpu_backend,
    enable_cpu_backend,
)


@pytest.fixture
def cpu_backend():
    """The CPU backend's shims for one test; removed afterwards unless they were already on."""
    was_enabled = cpu_backend_enabled()
    yield enable_cpu_backend()
    if not was_enabled:
        disable_cpu_backend()
