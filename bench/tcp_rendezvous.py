"""A free `tcp://` rendezvous for a tensor-parallel engine group started on this host.

An engine group meets at `--dist-init tcp://HOST:PORT` and its ranks also link over PORT + 1,
so both ports must be free. The benchmarks and the tests that start TP groups pick their
address here (stdlib only: importable without torch).
"""
from __future__ import annotations

import socket


def rendezvous() -> str:
    """tcp://127.0.0.1:P with P and P+1 free (P+1 carries the rank link)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return f"tcp://127.0.0.1:{port}"
        except OSError:
            continue
