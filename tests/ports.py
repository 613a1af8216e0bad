"""A free local port for a test's rendezvous (never a fixed one: tests run in parallel)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
