"""Whether an engine may have this cache: who it is, and whether it asks for these bytes.

Two questions an attach (and a rejoin, for the first) asks before a lease is made:
  who        `identify`: in a cluster the pod a lease names is proven by the engine pod's
             projected token (serve/pod_identity.py), never taken from the request, and a group
             is claimable only by pods of its namespace; off Kubernetes the pod is the client's word.
  what       `replaced_files` and `fields_for`: the checkpoint's files must still be the ones
             loaded, and the engine's spec must evaluate to this cache's fingerprint fields
             (load/fingerprint.py); the fields of each distinct request are kept, bounded.
Each answers with what to tell the client (`Refusal`) rather than sending it: the handlers
(serve/handlers.py) reply.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from .. import protocol
from ..load.fingerprint import fields_for_request, same_spec_fields
from ..load.signature import file_signature
from ..errors import WeightCacheError
from ..spec import CacheSpec
from .lease import pod_identity
from .pod_identity import IdentityRefused, PodVerifier, group_namespace
from .prepared_record import RecordedCache

log = logging.getLogger(__name__)

MAX_REMEMBERED_REQUESTS = 64  # engine fields kept per distinct request: a stream of odd requests must not grow it


@dataclass
class Refusal:
    """An error reply for the client, and the line for the log (said at most once a second)."""

    reply: dict[str, Any]
    warning: str


def identify(verifier: PodVerifier | None, message: dict[str, Any], group: str | None, pid: int | None,
             uid: int) -> tuple[dict[str, str] | None, bool] | Refusal:
    """The lease's pod and whether it is proven, or the refusal.

    Without a verifier (off Kubernetes) the pod is what the client says. With one, an attach
    or rejoin that names a pod or a group must present its pod's token: the pod the API
    server names replaces the client's fields, and a group is claimable only by pods of its
    namespace (`<namespace>/...`, as EngineSets name them).
    """
    claimed = pod_identity(message.get("pod"))
    token = message.get("identity_token")
    if verifier is None:
        return claimed, False
    if token is None:
        if claimed is None and group is None:
            return None, False  # no pod, no group: nothing that moves traffic
        refusal = ("this agent runs in a cluster: an engine that names a pod or a group must present its pod's "
                   "weightcache.io token ($WEIGHTCACHE_IDENTITY_TOKEN names the file)")
    else:
        try:
            identity = verifier.verify(token)
        except IdentityRefused as e:
            refusal = str(e)
        else:
            if group is None or group_namespace(group) == identity.namespace:
                return identity.pod(), True
            return Refusal(
                protocol.error_message("group_forbidden", f"pod {identity.namespace}/{identity.name} may only join "
                                                          f"groups of its namespace ({identity.namespace}/...)"),
                f"refused pid={pid} uid={uid} (pod {identity.namespace}/{identity.name}): group {group[:64]!r} is "
                "not of its namespace")
    return Refusal(protocol.error_message("identity_refused", refusal), f"refused pid={pid} uid={uid}: {refusal}")


class EngineCheck:
    """This cache's side of the fingerprint check; `cache()` answers the cache being served."""

    def __init__(self, spec: CacheSpec, cache: Callable[[], Any]):
        self.spec, self._cache = spec, cache
        # engine fields per distinct request: every engine of a deployment sends the same one
        self._engine_fields: dict[str, dict[str, Any]] = {}

    def replaced_files(self, cache: Any, request: dict[str, Any]) -> tuple[str, str] | None:
        """(signature loaded, signature now) when the engine's files are not the ones loaded and this
        agent's own model directory no longer holds them either; else None. Stats the agent's own
        model path only (never a path the client names), and only when the engine's signature differs."""
        loaded = cache.signature if isinstance(cache, RecordedCache) else cache.checkpoint.signature
        if not loaded or request.get("files") == loaded:
            return None
        try:
            now = file_signature(os.path.abspath(self.spec.model))
        except WeightCacheError:
            now = "unreadable"
        return None if now == loaded else (loaded, now)

    def fields_for(self, request: dict[str, Any]) -> dict[str, Any]:
        """The fingerprint fields the engine's request evaluates to (raises on a request it cannot)."""
        key = json.dumps(request, sort_keys=True)
        fields = self._engine_fields.get(key)
        if fields is None:
            cache = self._cache()
            if isinstance(cache, RecordedCache):
                signature, revision = cache.signature, cache.revision
            else:
                signature, revision = cache.checkpoint.signature, cache.checkpoint.revision
            fields = same_spec_fields(request, self.spec, cache.fields, signature, revision)
            if fields is None:  # another spec: derive its fields from the checkpoint itself
                fields = fields_for_request(request, self._checkpoint())
            if len(self._engine_fields) < MAX_REMEMBERED_REQUESTS:
                self._engine_fields[key] = fields
        return dict(fields)

    def _checkpoint(self) -> Any:
        """The parsed checkpoint; after a re-adoption from the record, parsed on first need."""
        cache = self._cache()
        if cache.checkpoint is None:
            from ..load.checkpoint import open_checkpoint

            cache.checkpoint = open_checkpoint(self.spec.model)
        return cache.checkpoint
