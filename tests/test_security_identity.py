"""Engines prove which pod they are: projected tokens checked by a real API server's TokenReview.

The agent runs as a local process pointed at the test control plane with the token of an
agent pod on node-1 (as the kubelet mounts it) and the chart's RBAC. Engine pods exist as
API objects; their tokens are minted as the kubelet would project them (audience
`weightcache.io`, bound to the pod). A second uid (the attacker) presents no token, a
forged one, one for the API server's audience, one of another namespace's pod, and one of
a pod on another node; each is refused, and whatever pod fields it claims never reach a
lease. A well-behaved engine of another uid attaches through `attach()` with its token
file and reads the checkpoint's bytes, its lease naming the pod the API server vouched for.
"""
from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from abuse_fixtures import no_traceback, right_bytes
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from k8s_lab import Lab, agent_identity, pods_path
from security_fixtures import ATTACKER, AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.testing.synthetic import skeleton_module

AUDIENCE = "weightcache.io"


@dataclass
class Scene:
    lab: Lab
    a: str  # the agent's and the good engine's namespace
    b: str  # another namespace
    uids: dict[str, str]  # pod name -> uid
    tokens: dict[str, str]  # pod name -> weightcache.io token
    api_token: str  # chat-0-0's token for the API server's own audience


def engine_pod(name: str, node: str) -> dict:
    return {"metadata": {"name": name, "labels": {"weightcache.io/engineset": "chat"}},
            "spec": {"nodeName": node, "serviceAccountName": "engine", "automountServiceAccountToken": False,
                     "containers": [{"name": "engine", "image": "engine:1"}]}}


def mint(lab: Lab, ns: str, pod: str, audience: str = AUDIENCE) -> str:
    return lab.kubectl("-n", ns, "create", "token", "engine", "--audience", audience, "--duration=3600s",
                       "--bound-object-kind", "Pod", "--bound-object-name", pod).strip()


@pytest.fixture(scope="module")
def scene(k8s_chart: Lab) -> Iterator[Scene]:
    lab = k8s_chart
    a, b = lab.namespace("ida"), lab.namespace("idb")
    uids, tokens = {}, {}
    for ns, name, node in ((a, "chat-0-0", "node-1"), (a, "chat-0-1", "node-1"), (b, "other-0-0", "node-1"),
                           (a, "far-0-0", "node-2")):
        lab.service_account(ns, "engine")
        uids[name] = lab.api.create(pods_path(ns), engine_pod(name, node))["metadata"]["uid"]
        tokens[name] = mint(lab, ns, name)
    yield Scene(lab, a, b, uids, tokens, api_token=lab.bound_token(a, "engine", "chat-0-0"))
    lab.delete_namespace(a)
    lab.delete_namespace(b)


@pytest.fixture(scope="module")
def agent(scene: Scene, model: str):
    """An agent in the cluster's eyes: the API server's address, an agent pod's token on node-1."""
    base = agent_dir()
    identity = agent_identity(scene.lab, scene.a, "node-1", token_dir=_readable_dir(base, "agent-token"))
    env = {"WEIGHTCACHE_KUBE_API": scene.lab.server, "WEIGHTCACHE_KUBE_TOKEN": str(identity.token_path),
           "WEIGHTCACHE_KUBE_CA": str(scene.lab.ca_path), "NODE_NAME": "node-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = open_agent(model, base, "agent", "--pod-identity", "on", "--label-pods", "off")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    proc.token_path = identity.token_path  # what the kubelet would refresh in place
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _readable_dir(base: str, name: str) -> Path:
    path = Path(base) / name
    path.mkdir(mode=0o755)
    return path


def attacker(command: dict) -> dict:
    """In the attacker: send one attach (or rejoin) as given; a lease it gets is held."""
    held = attacker.__dict__.setdefault("held", [])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(command["socket"])
    protocol.send_message(s, command["message"])
    reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    if reply["type"] in ("manifest", "rejoined"):
        held.append(s)
    else:
        s.close()
    return {"type": reply["type"], "code": reply.get("code"), "message": reply.get("message", "")}


def forged(token: str, **changes: object) -> str:
    """The token with its claims changed and its signature kept (so no longer matching)."""
    head, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["kubernetes.io"]["pod"].update(changes)
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{body}.{signature}"


def leases(agent) -> list[dict]:
    return agent.status()["clients"]


@needs_root
def test_only_a_pod_the_api_server_vouches_for_gets_a_lease(scene: Scene, agent, model, disk, monkeypatch,
                                                            tmp_path) -> None:
    request = engine_request(CacheSpec(model=model))
    victim = {"namespace": scene.a, "name": "chat-0-0", "uid": scene.uids["chat-0-0"]}
    group = f"{scene.a}/chat-0"

    def attach_message(token: str | None, *, pod: dict | None = victim, grp: str | None = group) -> dict:
        message = {"type": "attach", "role": "auto", "group": grp, "pod": pod, "request": request}
        if token is not None:
            message["identity_token"] = token
        return message

    child = AsAttacker(attacker)
    try:
        def ask(message: dict) -> dict:
            return child.ask(socket=agent.socket, message=message)

        # No token: a claimed pod or a group is refused, and so is a rejoin that names them.
        refused = ask(attach_message(None))
        assert refused["code"] == "identity_refused" and "WEIGHTCACHE_IDENTITY_TOKEN" in refused["message"]
        assert ask(attach_message(None, pod=None))["code"] == "identity_refused"  # a group alone
        assert ask({"type": "rejoin", "role": "standby", "group": group, "pod": victim, "token": "x"})["code"] == \
            "identity_refused"
        # A forged token (claims changed, signature kept), the API server's audience, garbage, another node.
        for token, why in ((forged(scene.tokens["chat-0-1"], name="chat-0-0", uid=scene.uids["chat-0-0"]),
                            "does not accept this token"),
                           (scene.api_token, "not for audience 'weightcache.io'"),
                           ("not-a-token", "not a service-account token"),
                           (scene.tokens["far-0-0"], "on node 'node-2'")):
            refused = ask(attach_message(token))
            assert refused["code"] == "identity_refused" and why in refused["message"], refused
        # A real pod of namespace B cannot join a group of namespace A, whatever it claims.
        refused = ask(attach_message(scene.tokens["other-0-0"]))
        assert refused["code"] == "group_forbidden" and f"groups of its namespace ({scene.b}/...)" in \
            refused["message"], refused
        assert leases(agent) == []
        # Its own token, claiming to be another pod: the lease names the pod the token proves.
        got = ask(attach_message(scene.tokens["other-0-0"], grp=f"{scene.b}/other-0"))
        assert got["type"] == "manifest", got
        (lease,) = leases(agent)
        assert lease["uid"] == ATTACKER and lease["verified"] is True
        assert lease["pod"] == {"namespace": scene.b, "name": "other-0-0", "uid": scene.uids["other-0-0"]}

        # A well-behaved engine of another uid (root), through attach() and its token file.
        token_file = tmp_path / "token"
        token_file.write_text(scene.tokens["chat-0-0"] + "\n")
        monkeypatch.setenv("WEIGHTCACHE_IDENTITY_TOKEN", str(token_file))
        for key, value in (("NAMESPACE", scene.b), ("NAME", "other-0-0"), ("UID", "claimed-uid")):
            monkeypatch.setenv(f"WEIGHTCACHE_POD_{key}", value)  # what it says is replaced by what is proven
        reviews = agent.status()["identity_reviews"]
        module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
        with attach(module, CacheSpec(model=model), socket=agent.socket, group=group, role="auto", timeout=30) as att:
            assert att.source == "agent" and att.role == "primary"
            params = dict(module.named_parameters())
            assert all((params[n].cpu() == disk[n]).all() for n in disk)
            mine = [c for c in leases(agent) if c["group"] == group]
            assert [(c["pod"], c["verified"], c["uid"]) for c in mine] == [(victim, True, 0)]
            # A second rank of the same pod (same token) costs no second TokenReview.
            module2 = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
            with attach(module2, CacheSpec(model=model), socket=agent.socket, group=group, role="standby",
                        timeout=30) as second:
                assert second.role == "standby"
            assert agent.status()["identity_reviews"] == reviews + 1
        # An attach that names neither pod nor group needs no token (nothing it could move).
        monkeypatch.delenv("WEIGHTCACHE_IDENTITY_TOKEN")
        for key in ("NAMESPACE", "NAME", "UID"):
            monkeypatch.delenv(f"WEIGHTCACHE_POD_{key}")
        right_bytes(agent, disk)

        # The agent's own token refused by the API server: the engine is told so, the agent says why in
        # one ERROR, and once its token is good again the same engine is let in (nothing remembered).
        good = agent.token_path.read_text()
        agent.token_path.write_text("revoked")
        mine = attach_message(scene.tokens["chat-0-1"], pod={"namespace": scene.a, "name": "chat-0-1",
                                                             "uid": scene.uids["chat-0-1"]})
        refused = ask(mine)
        assert refused["code"] == "identity_refused" and "agent's own credentials" in refused["message"], refused
        assert f"does not accept this agent's own service-account token ({agent.token_path})" in agent.log()
        agent.token_path.write_text(good)
        assert ask(mine)["type"] == "manifest"
    finally:
        child.close()
    no_traceback(agent)
