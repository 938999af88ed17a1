"""The hypothesis settings every property test file shares."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def props(default_examples: int) -> settings:
    """Reproducible in CI (the examples depend only on the test's source); ZINF_PROPS_EXAMPLES=N
    for a longer hunt."""
    return settings(
        max_examples=int(os.environ.get("ZINF_PROPS_EXAMPLES", str(default_examples))),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
