"""Shared test configuration: hypothesis profiles.

``ci`` (the default) is derandomized, so every CI run tries the same examples and a failure
reproduces exactly; ``dev`` draws fresh random examples, five times as many, for local bug hunting:
``HYPOTHESIS_PROFILE=dev python -m pytest tests/unit``. Tests scale their explicit
``max_examples`` by the profile's ``max_examples / 100``.
"""

import os

from hypothesis import HealthCheck, settings

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
