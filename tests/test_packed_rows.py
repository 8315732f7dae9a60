"""A manifest's rows, packed: the agent sends them so only when asked, they say what the JSON
columns say, and packed rows that are malformed -- from a broken or hostile agent -- are a
`ProtocolError` naming what was wrong, with every fd received closed, on both bind paths."""
from __future__ import annotations

import os
import socket
from array import array

import pytest
import torch

from agent_fixtures import FakeAgent, open_files, wait_for
from bind_fixtures import native, nothing_swapped  # noqa: F401 (native: a fixture)
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.arena.cpu import CpuArena
from weightcache_agent.client.rebind import bind_manifest
from weightcache_agent.errors import ProtocolError
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.load.layout import lay_out
from weightcache_agent.packed_rows import PackedRows
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=2))


def layout_columns(names: list[str]) -> dict[str, list]:
    return lay_out([(n, torch.float32, (2,), "weight") for n in names]).to_manifest()


def test_packing_keeps_every_row_and_name_exactly():
    names = ["a.weight", "décodeur.poids", "layers.0.\ud800", "x" * 300, "e"]
    columns = layout_columns(names)
    packed = PackedRows.from_columns(columns)
    assert packed.columns() == columns
    assert len(packed.data) == 16 * len(names) + sum(len(n.encode("utf-8", "surrogatepass")) for n in names)


def with_ends(packed: PackedRows, ends: list[int]) -> PackedRows:
    n = packed.count
    data = bytes(packed.data[:12 * n]) + array("I", ends).tobytes() + bytes(packed.data[16 * n:])
    return PackedRows(packed.forms, n, data)


def test_rows_whose_names_do_not_add_up_are_refused_by_both_paths(native):
    """Ends that step back, or run past the names; fewer bytes than the rows need; a form
    that is not in the list: a ValueError, and nothing bound."""
    names = ["embed.weight", "head.weight"]
    layout = lay_out([(n, torch.float32, (2,), "weight") for n in names])
    packed = PackedRows.from_columns(layout.to_manifest())
    base = torch.zeros(layout.size, dtype=torch.uint8)
    total = len(packed.data) - 32
    broken = [with_ends(packed, [12, 6]), with_ends(packed, [12, total + 1])]
    other_form = bytearray(packed.data)
    other_form[16:20] = array("I", [7]).tobytes()
    broken.append(PackedRows(packed.forms, 2, other_form))
    for rows in broken:
        with torch.device("meta"):
            m = torch.nn.Module()
            m.embed, m.head = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
        with pytest.raises((ValueError, IndexError)):
            bind_manifest(m, base, rows, native=native)
        assert nothing_swapped(m)
    with pytest.raises(ValueError, match="cannot hold"):
        PackedRows(packed.forms, len(packed.data) // 16 + 1, packed.data)


def test_the_agent_packs_rows_only_when_asked_and_both_say_the_same(model, tmp_path):
    """An engine of an earlier release asks for no packed rows and gets JSON columns."""
    with AgentProcess(model, str(tmp_path / "agent.sock")) as agent:
        replies = []
        for extra in ({}, {"manifest": "packed"}):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(agent.socket)
                s.settimeout(10)
                protocol.send_message(s, {"type": "attach", "role": "primary", "group": None, "pod": None,
                                          "request": engine_request(CacheSpec(model=model)), **extra})
                reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
                for fd in fds:
                    os.close(fd)
                rows = reply["tensors"]
                if "packed" in rows:
                    rows = PackedRows(rows["forms"], rows["count"], protocol.recv_payload(s, rows["packed"])).columns()
                replies.append(rows)
        assert "packed" not in replies[0] and replies[0] == replies[1]
        assert len(replies[0]["name"]) == len(open_checkpoint(model).tensors)


class HostileAgent(FakeAgent):
    """A real listener that answers every attach with a cpu manifest, the arena fd, and then
    whatever `payload(rows)` makes of the true packed rows of `model`."""

    def __init__(self, path: str, model: str, payload):
        tensors = open_checkpoint(model).tensors
        self.layout = lay_out([(n, r.dtype, r.shape, "weight") for n, r in tensors.items()])
        self.rows = PackedRows.from_columns(self.layout.to_manifest())
        self.arena = CpuArena(self.layout.size, name="hostile")
        self.payload = payload
        super().__init__(path, self._answer)

    def _answer(self, conn: socket.socket) -> None:
        protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES)
        header, tail = self.payload(self.rows)
        reply = {"type": "manifest", "role": "primary", "backend": "cpu", "fingerprint": "f" * 64, "fields": {},
                 "layout_hash": self.layout.layout_hash, "bytes": self.layout.nbytes,
                 "arenas": [{"index": 0, "size": self.layout.size, "backend": "cpu"}], "tensors": header}
        protocol.send_message(conn, reply, [self.arena.fd])
        conn.sendall(tail)
        conn.shutdown(socket.SHUT_WR)  # nothing more: a frame cut short ends here
        conn.recv(1)  # until the engine hangs up

    def close(self) -> None:
        super().close()
        self.arena.close()


def payload_frame(data: bytes, magic: bytes = protocol.PAYLOAD_MAGIC, length: int | None = None) -> bytes:
    return protocol.HEADER.pack(magic, protocol.PROTOCOL_VERSION, 0, len(data) if length is None else length) + data


@pytest.mark.parametrize("case,payload,message", [
    ("no payload frame", lambda r: (r.header(), payload_frame(bytes(r.data), magic=protocol.MAGIC)),
     "expected a binary frame"),
    ("a shorter one", lambda r: (r.header(), payload_frame(bytes(r.data), length=len(r.data) - 1)),
     "expected a binary frame"),
    ("cut short", lambda r: (r.header(), payload_frame(bytes(r.data))[:-5]), "connection closed inside a frame body"),
    ("too long to accept", lambda r: ({**r.header(), "packed": 1 << 40}, b""), "announced"),
    ("fewer bytes than rows", lambda r: ({**r.header(), "count": r.count * 50}, payload_frame(bytes(r.data))),
     "cannot hold"),
    ("names past the end", lambda r: (r.header(), payload_frame(bytes(with_ends(r, [10 ** 6] * r.count).data))),
     "malformed manifest"),
])
def test_malformed_packed_rows_are_a_protocol_error_and_leak_no_fd(model, tmp_path, case, payload, message):
    path = str(tmp_path / "hostile.sock")
    hostile = HostileAgent(path, model, payload)
    shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
    try:
        before = open_files(os.getpid())
        for _ in range(3):
            module = skeleton_module(shapes)
            with pytest.raises(ProtocolError, match=message):
                attach(module, CacheSpec(model=model), socket=path, timeout=5)
            assert nothing_swapped(module), case
        # The listener's thread closes its end once the engine hung up: only then is nothing left open.
        wait_for(lambda: not open_files(os.getpid()) - before, 5, "every fd closed")
    finally:
        hostile.close()
