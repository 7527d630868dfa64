"""pytest plugin: the ``meshnode_daemons`` fixture (see :mod:`meshnode.testing`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshnode.testing import DaemonSet


@pytest.fixture
def meshnode_daemons() -> Iterator[DaemonSet]:
    """Start real ``meshnode run`` daemons; all are stopped when the test ends."""
    daemons = DaemonSet()
    try:
        yield daemons
    finally:
        daemons.close()
