"""pytest plugin (entry point ``hicache_l3``): makes the conformance suite available to
any project. Subclass :class:`hicache_l3.conformance.ConnectorTests` in a test module,
give it a ``settings`` fixture and the backdoor methods, and pytest runs the suite."""

from __future__ import annotations

import pytest

from hicache_l3.common.logs import quiet_credential_loggers


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers the suite uses; keep botocore from logging credentials when a
    test raises the root logger to DEBUG (caplog)."""
    quiet_credential_loggers()
    config.addinivalue_line("markers", "conformance: a test of the shared connector suite")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
