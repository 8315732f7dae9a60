"""A checkpoint directory's file signature: one stat per file, no read, no torch.

What an engine sends with every attach and what a restarted agent checks its record of
a prepared cache against; it lives apart from `checkpoint` (which needs torch for its
dtypes) so that the agent's re-adoption path can check it without importing torch.
"""
from __future__ import annotations

import hashlib
import os

from ..errors import CheckpointError


def file_signature(directory: str) -> str:
    """Hash of (name, size, mtime, inode) of the directory's safetensors and JSON files.

    One stat per file, no read: what an engine sends so that an agent that loaded these very
    files can vouch for their content identity. Bind mounts keep size, mtime and inode, so a
    pod sees the signature the agent saw; a copy or an edit changes it, and then the content
    identity decides (`content_identity`).
    """
    try:
        entries = sorted((e.name, e.stat()) for e in os.scandir(directory)
                         if e.name.endswith((".safetensors", ".json")))
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot list: {e.strerror}") from None
    digest = hashlib.sha256()
    for name, st in entries:
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()[:16]
