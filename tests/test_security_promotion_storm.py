"""A promotion storm is not an API-write storm: the serving label goes out once per group and
interval, for the promotion that lasted.

The API server is a real HTTPS server on loopback that counts PATCHes (and answers them as
the API server would); the agent is a real process pointed at it with `--label-pods on`. A
second uid holds two leases of one group and makes the agent promote one, then the other,
200 times as fast as it can, acknowledging each promotion.
"""
from __future__ import annotations

import http.server
import json
import math
import os
import socket
import ssl
import subprocess
import threading
import time

from abuse_fixtures import no_traceback, serves_correctly
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from security_fixtures import AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.serve.serving_label import MIN_WRITE_INTERVAL
from weightcache_agent.spec import CacheSpec

PROMOTIONS = 200


class CountingApi:
    """HTTPS on 127.0.0.1 with a self-signed certificate: PATCHes recorded, everything else 200."""

    def __init__(self, directory: str):
        self.cert, key = os.path.join(directory, "api.crt"), os.path.join(directory, "api.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", self.cert,
                        "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        self.patches: list[tuple[float, str, dict]] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PATCH(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.patches.append((time.monotonic(), self.path, body))
                self._reply(body)

            def do_GET(self) -> None:  # noqa: N802
                self._reply({"major": "1"})

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def storm(command: dict) -> dict:
    """In the attacker: two leases in one group; drop the primary, ack the standby's promotion,
    come back as a standby; repeat."""
    def lease(role: str, name: str) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(command["socket"])
        protocol.send_message(s, {"type": "attach", "role": role, "group": command["group"],
                                  "pod": {"namespace": "ns", "name": name, "uid": f"uid-{name}"},
                                  "request": command["request"]})
        reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        for fd in fds:
            os.close(fd)
        assert reply["type"] == "manifest", reply
        return s

    names = ["engine-a", "engine-b"]
    primary, standby = lease("primary", names[0]), lease("standby", names[1])
    started = time.monotonic()
    for _ in range(command["promotions"]):
        primary.close()
        message, _ = protocol.recv_message(standby, protocol.MAX_REQUEST_BYTES)
        assert message["type"] == "promote", message
        protocol.send_message(standby, {"type": "promoted", "group": command["group"]})
        names.reverse()
        primary, standby = standby, lease("standby", names[1])
    seconds = time.monotonic() - started
    storm.__dict__["held"] = [primary, standby]
    return {"seconds": seconds, "primary": names[0]}


@needs_root
def test_a_promotion_storm_writes_the_label_once_per_interval_and_ends_on_the_last_primary(model, disk, capsys):
    base = agent_dir()
    api = CountingApi(base)
    token = os.path.join(base, "sa-token")
    with open(token, "w") as f:
        f.write("agent-token")
    env = {"WEIGHTCACHE_KUBE_API": api.url, "WEIGHTCACHE_KUBE_TOKEN": token, "WEIGHTCACHE_KUBE_CA": api.cert}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        agent = open_agent(model, base, "agent", "--label-pods", "on", "--pod-identity", "off")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    child = None
    try:
        agent.wait_ready()
        child = AsAttacker(storm)
        result = child.ask(socket=agent.socket, group="ns/chat-0", promotions=PROMOTIONS,
                           request=engine_request(CacheSpec(model=model)))
        ended = time.monotonic()
        last = f"/api/v1/namespaces/ns/pods/{result['primary']}"
        # The promotion that lasted is written within one interval of the storm's end.
        wait_for(lambda: api.patches and api.patches[-1][1] == last, 5, "the last primary's label")
        time.sleep(3 * MIN_WRITE_INTERVAL)  # nothing more comes
        writes = len(api.patches)
        bound = 1 + math.ceil(result["seconds"] / MIN_WRITE_INTERVAL) + 1  # the first, one per interval, the last
        with capsys.disabled():
            print(f"\n{PROMOTIONS} promotions in {result['seconds']:.2f}s -> {writes} label PATCHes "
                  f"(bound {bound}); the last went to {result['primary']} "
                  f"{api.patches[-1][0] - ended:+.3f}s after the storm")
        assert writes <= bound, [p[1] for p in api.patches]
        assert api.patches[-1][1] == last
        assert api.patches[-1][2] == {"metadata": {"uid": f"uid-{result['primary']}",
                                                   "labels": {"weightcache.io/serving": "true"}}}
        # Writes of one group are at least an interval apart.
        times = [p[0] for p in api.patches]
        assert all(b - a >= MIN_WRITE_INTERVAL * 0.95 for a, b in zip(times, times[1:])), times
        serves_correctly(agent, disk, leases_left=2)
    finally:
        if child is not None:
            child.close()
        agent.stop()
        api.close()
    no_traceback(agent)
