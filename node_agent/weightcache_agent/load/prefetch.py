"""Read a checkpoint's files into the page cache from process start, ahead of the fill, so the disk never idles.

An agent's cold load cannot fill before it has a plan and its arena (a CUDA context first
on a GPU; torch too, seconds more, where a cast needs it), but the disk can already work:
`Prefetch` reads the shard files in the order the fill will read them (file order, one
sequential stream, the way a plain `cat` reads them) into the page cache, from the moment
the agent has checked its flags (before it imports the rest of itself or starts CUDA), and
keeps reading until the last file is in, at most `lead` bytes ahead of the fill it
`follow`s (the page cache is not the arena: the lead bounds what is held twice). The
fill reads the same pages buffered (O_DIRECT would read every byte twice), each read only
once the read-ahead has passed its bytes (`wait_past`): first at memory speed, until it
catches up, then right behind the read-ahead. The disk sees the one sequential stream,
never a second one started by the fill's readers, so a cold load runs at the rate of one
sequential buffered read (on a virtual disk: 0.90-0.99 of a raw read, where the fill's own
direct reads, once it could start, made 0.81-0.87). Bytes cached already are skipped, not
copied. Needs no torch and no parsed header: the file list comes from the index or the
directory, as `checkpoint` makes it.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import Callable

from ..errors import CheckpointError
from .pagecache import cached_share
from .signature import INDEX_FILE, MAX_HEADER_BYTES, open_regular, shard_name_ok

log = logging.getLogger(__name__)

CHUNK = 64 << 20  # one request this large keeps the disk busier than several of 16 MiB (measured: 19.6 vs 24.6 s for 33 GiB)
MIN_LEAD = 1 << 30
# The longest a fill's read waits for the read-ahead to pass it; past it (the read-ahead stalled,
# or far behind) the fill reads the bytes itself.
WAIT_S = 1.0


def lead_for(paths: list[str], host_arena: bool) -> int:
    """How far ahead of the fill the prefetch may read: half the memory left once a host arena
    (the cpu backend's memfd, about the checkpoint's size) is counted, at least `MIN_LEAD`."""
    from ..arena.cpu import available_memory

    total = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
    return max(MIN_LEAD, (available_memory() - (total if host_arena else 0)) // 2)


def shard_paths(directory: str) -> list[str]:
    """The shard files in the order the fill reads them; [] when the directory cannot say."""
    try:
        index = os.path.join(directory, INDEX_FILE)
        if os.path.lexists(index):
            # Non-blocking, regular files in the directory only: this runs before the agent binds its
            # socket, and an index that is a FIFO must not hold it there.
            with open_regular(index, within=directory) as f:
                names = sorted(set(json.loads(f.read(MAX_HEADER_BYTES + 1))["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, CheckpointError):
        return []  # the load itself will say what is wrong with the checkpoint
    root = os.path.realpath(directory) + os.sep
    return [os.path.join(directory, n) for n in names if shard_name_ok(n)
            and os.path.realpath(os.path.join(directory, n)).startswith(root)]


class Prefetch:
    """A thread reading `paths` ahead of a fill whose progress `done()` reports (bytes read; none
    until the fill exists: `follow`)."""

    def __init__(self, paths: list[str], done: Callable[[], int] = lambda: 0, lead: int = MIN_LEAD):
        self.paths, self.done, self.lead = paths, done, lead
        self.read = 0
        self.seconds = 0.0
        self.began = self.finished = 0.0  # time.time() of its first request and of its last byte read
        self._order = {os.path.realpath(p): i for i, p in enumerate(paths)}
        self._at = (0, 0)  # (index of the file being read, bytes of it read)
        self._ended = False
        self._moved = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self._thread.start()

    def follow(self, done: Callable[[], int], lead: int | None = None) -> None:
        """Stay at most `lead` (default: as it is) bytes ahead of the fill whose bytes read `done()` says."""
        self.done = done
        if lead is not None:
            self.lead = lead

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait_past(self, path: str, end: int) -> None:
        """Return once the read-ahead has read `path` up to byte `end`, has ended, or `WAIT_S` passed.

        A fill reading buffered behind the read-ahead calls it before each read: its pages are
        then cached or already in flight, and the disk sees one sequential stream, never a
        second one starting at the fill's position.
        """
        index = self._order.get(os.path.realpath(path))
        if index is None:
            return
        with self._moved:
            self._moved.wait_for(lambda: self._ended or self._at >= (index, end), timeout=WAIT_S)

    def _advance(self, index: int, position: int) -> None:
        with self._moved:
            self._at = (index, position)
            self._moved.notify_all()

    def _run(self) -> None:
        if os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 0:  # born after the agent raised its own
            from .reading import at_normal_priority

            at_normal_priority()
        started = time.monotonic()
        self.began = time.time()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        try:
            for index, path in enumerate(self.paths):
                # Non-blocking open, regular files only: a FIFO or device in place of a shard is the
                # load's to refuse, never something to wait on here.
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return
                    os.set_blocking(fd, True)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    size, position = os.fstat(fd).st_size, 0
                    while not self._stop.is_set() and position < size:
                        if self.read - self.done() >= self.lead:
                            self._stop.wait(0.05)
                            continue
                        if cached_share(fd, position, CHUNK) >= 0.99:  # cached already: copying would only cost CPU
                            n = max(0, min(CHUNK, size - position))
                        else:
                            n = os.preadv(fd, [view], position)
                        if n == 0:
                            break
                        position += n
                        self.read += n
                        self.finished = time.time()
                        self._advance(index, position)
                finally:
                    os.close(fd)
                self._advance(index + 1, 0)
                if self._stop.is_set():
                    return
        except OSError as e:
            log.debug("prefetch stopped: %s", e)
        finally:
            self.seconds = time.monotonic() - started
            with self._moved:
                self._ended = True
                self._moved.notify_all()
