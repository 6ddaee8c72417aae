"""Fixtures shared by the integration tests (the CPU backend for one test, float64 as the default
dtype for one test), and the ``link_shaping`` marker: a test that shapes
links (``--link-rate``: network namespaces and tc) is skipped, with the reason, unless this is
root with the tools that ``--nodes`` (the marker's ``nodes``, default 1) needs on PATH."""

import os
import shutil

import pytest
import torch

from megatron_dcp.integration.patches import (
    cpu_backend_enabled,
    disable_cpu_backend,
    enable_cpu_backend,
)
from megatron_dcp.tools.link.preflight import required_tools


@pytest.fixture
def cpu_backend():
    """The CPU backend's shims for one test; removed afterwards unless they were already on."""
    was_enabled = cpu_backend_enabled()
    yield enable_cpu_backend()
    if not was_enabled:
        disable_cpu_backend()


@pytest.fixture
def float64():
    """float64 as the default dtype inside one test only (the default is process-wide); the
    reference-kernel tests use it for every test (``pytest.mark.usefixtures("float64")``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("link_shaping")
    if mark is None:
        return
    if os.geteuid() != 0:
        pytest.skip("--link-rate needs root (network namespaces)")
    tools = required_tools(mark.kwargs.get("nodes", 1))
    if any(shutil.which(tool) is None for tool in tools):
        pytest.skip(f"--link-rate needs {', '.join(tools)} on PATH")
