"""Where an engine rank finds its agent, from the environment the operator injects: no torch.

Apart from `session` so that an engine can resolve its socket (and ask the agent which GPU
it serves) before it has imported torch: that question and the GPU's context are made
while torch's import runs (`engine.startup`).
"""
from __future__ import annotations

import os

ENV_SOCKET, ENV_SOCKET_DIR, ENV_DEVICES = "WEIGHTCACHE_SOCKET", "WEIGHTCACHE_SOCKET_DIR", "WEIGHTCACHE_DEVICES"
ENV_ROLE, ENV_GROUP = "WEIGHTCACHE_ROLE", "WEIGHTCACHE_GROUP"
ENV_ENGINE = "WEIGHTCACHE_ENGINE_ID"  # one engine across its tensor-parallel ranks (off Kubernetes)
ENV_IDENTITY_TOKEN = "WEIGHTCACHE_IDENTITY_TOKEN"  # file of the pod's projected token (audience weightcache.io)
MAX_IDENTITY_TOKEN_BYTES = 8192
ENV_POD = {"namespace": "WEIGHTCACHE_POD_NAMESPACE", "name": "WEIGHTCACHE_POD_NAME", "uid": "WEIGHTCACHE_POD_UID"}


def socket_from_env(rank: int = 0) -> str:
    """The agent socket this engine rank should use, from the environment (see `attach`)."""
    if os.environ.get(ENV_SOCKET):
        return os.environ[ENV_SOCKET]
    directory = os.environ.get(ENV_SOCKET_DIR)
    if not directory:
        raise ValueError(f"attach needs socket= (or ${ENV_SOCKET}, or ${ENV_SOCKET_DIR} with ${ENV_DEVICES}) "
                         "in client and daemon mode")
    uuids = device_uuids()
    if rank >= len(uuids):
        raise ValueError(f"${ENV_DEVICES}={os.environ.get(ENV_DEVICES, '')!r} names {len(uuids)} device(s); "
                         f"rank {rank} needs one of its own")
    if "/" in uuids[rank] or uuids[rank].startswith("."):
        raise ValueError(f"${ENV_DEVICES}: {uuids[rank]!r} is not a device UUID")
    return os.path.join(directory, f"{uuids[rank]}.sock")


def device_uuids() -> list[str]:
    """The device UUIDs of `$WEIGHTCACHE_DEVICES`, one per rank."""
    return [d.strip() for d in os.environ.get(ENV_DEVICES, "").split(",") if d.strip()]


def pod_from_env() -> dict[str, str] | None:
    """This engine's pod (namespace, name, uid), when the operator injected it."""
    pod = {key: os.environ.get(env, "") for key, env in ENV_POD.items()}
    return pod if all(pod.values()) else None


def socket_to_prepare(rank: int | None = None) -> str | None:
    """The socket `attach` would use, where the environment names one for this rank; else None.

    A rank left unsaid with several devices in `$WEIGHTCACHE_DEVICES` names none: which GPU's
    agent is this process's is unknown, and preparing another GPU's would be wrong."""
    if rank is None and len(device_uuids()) > 1 and not os.environ.get(ENV_SOCKET):
        return None
    try:
        return socket_from_env(rank or 0)
    except ValueError:  # no agent named: the engine attaches with an explicit socket, or from disk
        return None


def identity_token_from_env() -> str | None:
    """The engine pod's projected service-account token, read from the file
    `$WEIGHTCACHE_IDENTITY_TOKEN` names (the operator mounts it), or None when that is unset:
    off Kubernetes no token is sent. Read at each attach: the kubelet rotates the file."""
    path = os.environ.get(ENV_IDENTITY_TOKEN)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_IDENTITY_TOKEN_BYTES + 1)
    except OSError as e:
        raise ValueError(f"${ENV_IDENTITY_TOKEN}={path}: cannot read the pod's identity token: "
                         f"{e.strerror or e}") from None
    token = raw.decode(errors="replace").strip()
    if not token or len(raw) > MAX_IDENTITY_TOKEN_BYTES:
        raise ValueError(f"${ENV_IDENTITY_TOKEN}={path}: not a service-account token (empty or over "
                         f"{MAX_IDENTITY_TOKEN_BYTES} bytes)")
    return token
