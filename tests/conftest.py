"""Shared test configuration: layer markers from the directory, and the hypothesis profiles.

Markers: every test under ``tests/<layer>/`` gets the marker ``<layer>`` (``unit``,
``distributed``, ``integration``, ``gpu``; registered in ``pyproject.toml``), so ``-m unit`` runs
one layer without a decorator in each file. See ``tests/README.md``.

Hypothesis: ``ci`` (the default) is derandomized, so every CI run tries the same examples and a
failure reproduces exactly; ``dev`` draws fresh random examples, five times as many, for local bug
hunting: ``HYPOTHESIS_PROFILE=dev python -m pytest tests/unit``. Tests scale their explicit
``max_examples`` by the profile's ``max_examples / 100``.

CUDA: the distributed harness forks its workers, and a process that has initialised CUDA cannot
hand it to forked children. ``torch.cuda.is_available()`` initialises it unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (then it asks NVML), so that is set for the whole session
before any test module runs its module-level ``is_available()`` check.

Coverage check: with ``MEGATRON_DCP_FORCE_STATIC_PLAN=1`` the DCP planner returns the static plan
for the whole session (``megatron_dcp.testing.force_static_plan``, installed here before any
test runs, so the harness's forked workers inherit it); every oracle test that claims a mix of
CP sizes must then fail. See tests/README.md, "Coverage".
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS_DIR = Path(__file__).resolve().parent
LAYERS = ("unit", "distributed", "integration", "gpu")

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

if os.environ.get("MEGATRON_DCP_FORCE_STATIC_PLAN", "") not in ("", "0"):
    # Imported only then: the module imports torch (megatron_dcp.testing), the unit layer none.
    from megatron_dcp.testing.force_static_plan import force_static_plans

    force_static_plans()

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=500,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def layer_of(path: Path) -> str | None:
    """The layer of a test file: the first directory below ``tests/`` when it names a layer."""
    try:
        parts = path.resolve().relative_to(TESTS_DIR).parts
    except ValueError:  # outside tests/ (e.g. functional_tests/, which marks its own)
        return None
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its layer. The hook sees every item of the session, not only those
    under this directory, hence the path check."""
    for item in items:
        layer = layer_of(Path(item.path))
        if layer is not None:
            item.add_marker(getattr(pytest.mark, layer))
