"""The hidden files an agent keeps beside its socket, named in one place (no imports: the agent's
start asks whether a predecessor's state file is there before it imports the agent itself)."""
from __future__ import annotations

import os


def sidecar_path(socket_path: str, kind: str) -> str:
    """The hidden file beside a socket: `.NAME.lock` (one agent per socket), `.NAME.state` (for re-adoption)."""
    return os.path.join(os.path.dirname(socket_path), f".{os.path.basename(socket_path)}.{kind}")
