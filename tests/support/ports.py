"""A free TCP port on 127.0.0.1, for the servers, proxies and rendezvous the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; another process could still take it before its
    server binds, so :meth:`tests.support.s3server.S3Server.start` retries on "address in use")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
