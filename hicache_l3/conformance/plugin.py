"""pytest plugin (entry point ``hicache_l3``): makes the conformance suite available to
any project. Subclass :class:`hicache_l3.conformance.ConnectorTests` in a test module,
give it a ``settings`` fixture and the backdoor methods, and pytest runs the suite."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers the suite uses."""
    config.addinivalue_line("markers", "conformance: a test of the shared connector suite")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
