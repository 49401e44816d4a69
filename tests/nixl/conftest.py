"""Fixtures shared by the NIXL tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Connectors a test opens (append them): closed when the test ends, passed or not."""
    conns: list[Any] = []
    yield conns
    for c in conns:
        c.close()
