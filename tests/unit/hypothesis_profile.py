"""The one hypothesis profile of the property tests: derandomized, so a run is reproducible and a
failure in CI fails the same way on a laptop; no example database, no deadline (a busy 2-core
machine makes timing a lie), and few examples, so the property suites stay in seconds.

BATCHLINE_PROPERTY_SCALE=20 multiplies every test's examples for a deeper (still derandomized)
search on a quiet machine.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = "batchline-ci"
SCALE = max(1, int(os.environ.get("BATCHLINE_PROPERTY_SCALE", "1")))

settings.register_profile(
    PROFILE,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def bounded(max_examples: int) -> settings:
    """The profile with `max_examples` (times SCALE) examples per test."""
    return settings(settings.get_profile(PROFILE), max_examples=max_examples * SCALE)
