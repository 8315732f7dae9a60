"""The start-up read-ahead: reads shard files in the fill's order, no further than its lead,
stops once the fill has caught up, and never waits on a non-regular file."""
from __future__ import annotations

import json
import os
import threading
import time

from weightcache_agent.load.pagecache import cached_share
from weightcache_agent.load.prefetch import CHUNK, WAIT_S, Prefetch, shard_paths


def _shards(tmp_path, sizes):
    names = {}
    for i, size in enumerate(sizes):
        name = f"model-{i:05d}.safetensors"
        (tmp_path / name).write_bytes(os.urandom(size))
        names[f"t{i}"] = name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    return str(tmp_path)


def test_order_comes_from_the_index_and_foreign_names_are_dropped(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"x")
    (tmp_path / "a.safetensors").write_bytes(b"x")
    assert [os.path.basename(p) for p in shard_paths(str(tmp_path))] == ["a.safetensors", "b.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "b.safetensors", "y": "../etc/passwd", "z": "a.safetensors"}}))
    assert [os.path.basename(p) for p in shard_paths(str(tmp_path))] == ["a.safetensors", "b.safetensors"]
    assert shard_paths(str(tmp_path / "missing")) == []


def cached(path: str, length: int) -> float:
    """The share of the first `length` bytes of `path` in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_share(fd, 0, length)
    finally:
        os.close(fd)


def test_reads_ahead_within_its_lead_to_the_last_file_then_ends(tmp_path):
    model = _shards(tmp_path, [3 * CHUNK, 2 * CHUNK])
    paths = shard_paths(model)
    for path in paths:  # cold, so the read-ahead really reads
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    done = [0]
    prefetch = Prefetch(paths, lambda: done[0], lead=2 * CHUNK)
    deadline = time.monotonic() + 10
    while prefetch.read < 2 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert prefetch.read == 2 * CHUNK, "the read-ahead went past its lead"
    done[0] = CHUNK  # the fill moves: the lead moves with it
    while prefetch.read < 3 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetch.read == 3 * CHUNK
    assert cached(paths[0], 3 * CHUNK) > 0.9, "what was read ahead is not in the page cache"
    done[0] = 3 * CHUNK  # caught up: the read-ahead keeps going, right ahead of the fill, to the end
    prefetch._thread.join(10)
    assert not prefetch._thread.is_alive(), "the read-ahead did not end after the last file"
    assert prefetch.read == 5 * CHUNK
    assert cached(paths[1], 2 * CHUNK) > 0.9, "the last file was not read ahead"


def test_a_fifo_in_place_of_a_shard_is_not_waited_on(tmp_path):
    fifo = tmp_path / "model-00000.safetensors"
    os.mkfifo(fifo)
    prefetch = Prefetch([str(fifo)], lambda: 0)
    stopper = threading.Thread(target=prefetch.stop)
    stopper.start()
    stopper.join(5)
    assert not stopper.is_alive() and prefetch.read == 0


def test_a_read_behind_waits_for_the_read_ahead_to_pass_its_bytes(tmp_path):
    model = _shards(tmp_path, [3 * CHUNK, 2 * CHUNK])
    paths = shard_paths(model)
    done = [0]
    prefetch = Prefetch(paths, lambda: done[0], lead=2 * CHUNK)
    try:
        started = time.monotonic()
        prefetch.wait_past(paths[0], 2 * CHUNK)  # within the lead: passed soon
        assert time.monotonic() - started < WAIT_S and prefetch.read >= 2 * CHUNK
        started = time.monotonic()
        prefetch.wait_past(paths[1], CHUNK)  # beyond the lead: the read-ahead waits for the fill, so the fill
        assert time.monotonic() - started >= WAIT_S * 0.9  # waits no longer than WAIT_S, then reads itself
        assert prefetch.read == 2 * CHUNK
        prefetch.wait_past(str(tmp_path / "elsewhere.safetensors"), 1)  # not one of its files: no wait
        done[0] = 5 * CHUNK
        started = time.monotonic()
        prefetch.wait_past(paths[1], 2 * CHUNK)
        assert time.monotonic() - started < WAIT_S and prefetch.read == 5 * CHUNK
    finally:
        prefetch.stop()
    started = time.monotonic()
    prefetch.wait_past(paths[1], 10 * CHUNK)  # ended: never waits
    assert time.monotonic() - started < WAIT_S / 2  # not the WAIT_S a wait takes, whatever the machine's load


def test_the_agent_reads_ahead_from_its_flags_unless_whole_files_are_not_coming(tmp_path):
    """`weightcache agent --socket` starts the read-ahead right after its flags (before it imports the
    rest of itself or starts the GPU); not for a tensor-parallel rank, a replica that copies a peer,
    or beside a predecessor's state file (engines may hand the arena back: nothing to read)."""
    from weightcache_agent.serve.agent_main import build_parser, start_read_ahead
    from weightcache_agent.serve.sidecar import sidecar_path

    model = _shards(tmp_path, [3 << 20, 1 << 20])
    sock = str(tmp_path / "a.sock")

    def flags(*extra: str):
        return build_parser().parse_args(["--model", model, "--socket", sock, *extra])

    read_ahead = start_read_ahead(flags())
    try:
        assert read_ahead is not None
        read_ahead._thread.join(10)
        assert read_ahead.read == 4 << 20 and read_ahead.began <= read_ahead.finished
    finally:
        read_ahead.stop()
    assert start_read_ahead(flags("--tp-size", "2")) is None
    assert start_read_ahead(flags("--peer-socket", str(tmp_path / "b.sock"))) is None
    open(sidecar_path(sock, "state"), "w").close()
    assert start_read_ahead(flags()) is None
