"""Who could swap a directory on a path for one of their own: the check the agent makes before it
binds a socket and an engine makes before it starts an agent in a directory.

Whoever may rename entries in a directory on the way to a socket can move the socket
directory aside and put one of their own, with an agent of their own, in its place. Both
sides walk the path the same way, as named and as resolved, and refuse it at the first
directory someone other than root or this process's uid could change that way.
"""
from __future__ import annotations

import os
import stat


def first_unsafe_directory(directory: str) -> tuple[str, os.stat_result] | None:
    """The first directory on `directory`'s path (itself included), followed as named and as
    resolved, that belongs to a uid other than root or this process's, or that group or others
    may write without the sticky bit; None when there is none. The walk stops at the first
    part that does not exist or is not a directory (the caller's own checks name those)."""
    me = os.geteuid()
    named = os.path.abspath(directory)
    for chain in (named, os.path.realpath(named)):
        path = "/"
        for part in [""] + [p for p in chain.split("/") if p]:
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                break
            if stat.S_ISLNK(st.st_mode):
                continue  # the link's directory was checked; its target is checked as resolved
            if not stat.S_ISDIR(st.st_mode):
                break
            if st.st_uid not in (0, me) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
                return path, st
    return None
