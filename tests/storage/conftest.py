"""Fixtures of the object-storage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session's S3 server, for one test."""
    with FaultProxy("127.0.0.1", s3_server.port) as p:
        yield p
