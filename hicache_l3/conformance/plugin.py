"""pytest plugin (entry point ``hicache_l3``): makes the conformance suite available to any
project (subclass :class:`hicache_l3.conformance.ConnectorTests`). ``--engines=local|containers``
chooses how engine fixtures start their engines (:func:`engine_launcher`); in container mode
a failed test's report carries the running containers' logs, and every container is removed
at the end of the session.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from hicache_l3.common.logs import quiet_credential_loggers


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--engines``: how engine fixtures start their engines."""
    parser.addoption("--engines", choices=["local", "containers"], default="local",
                     help="start engines as local processes (default) or as containers "
                          "(needs DOCKER_HOST: scripts/dockerd.sh start DIR)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the suite's markers; keep botocore from logging credentials under caplog DEBUG."""
    quiet_credential_loggers()
    config.addinivalue_line("markers", "conformance: a test of the shared connector suite")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def engine_launcher(config: pytest.Config, name: str) -> Any:
    """The launcher class of engine ``name`` (``mooncake``, ``s3``, ...) in the session's
    ``--engines`` mode; call it with the engine's usual arguments."""
    from hicache_l3.engines.containers import engine_class

    return engine_class(name, str(config.getoption("engines", "local")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Add the running containers' logs to a failed test's report (container mode)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.config.getoption("engines", "local") == "containers":
        from hicache_l3.engines.containers import LIVE

        for managed in list(LIVE):
            report.sections.append((f"container {managed.name} logs", managed.tail()))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Container mode: list the containers this session started (all removed by now)."""
    if config.getoption("engines", "local") == "containers":
        from hicache_l3.engines.containers import STARTED

        terminalreporter.section(f"containers started: {len(STARTED)}")
        for name, image, short_id in STARTED:
            terminalreporter.write_line(f"{short_id} {name} {image}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Container mode: remove every container of this session still present."""
    if session.config.getoption("engines", "local") == "containers":
        from hicache_l3.engines.containers import remove_all

        remove_all()
