"""Which pod an engine is, proven by Kubernetes itself: a projected service-account token.

Why: a lease names a pod, and that pod is what the agent labels serving when it promotes
it, so the name must not be the client's word. In a cluster the kubelet mounts into each
engine pod a token with weightcache's own audience (`weightcache.io`), bound to that
pod (the operator asks for it in the pod spec). The engine presents it at attach; the
agent asks the API server once (`TokenReview`, authentication.k8s.io/v1, with that
audience), which answers with the service account's namespace and, from
`userInfo.extra`, the pod's name, uid and node. That identity, not the fields the
client sent, goes on the lease. A token for another audience (the API server's own),
one that expired, one whose pod is gone, or none at all is refused.

How: one kept-alive HTTPS connection to the API server, authenticated with the agent's
own service-account token (the same files and variables as serve/serving_label.py).
Answers are cached by the token's SHA-256 until the token expires (at most
`CACHE_SECONDS`), refusals for `REFUSAL_SECONDS`: an engine's ranks and rejoins cost no
further call, and a client that repeats a bad token costs one call. When the agent cannot ask
(its own token refused, the API server unreachable) the engine is refused and nothing is
remembered: it gets in once the agent can ask again. Before any call a
token must look like a JWT for our audience that has not expired (read, not trusted):
garbage never reaches the API server. At most `MAX_CONCURRENT` reviews run at once.
"""
from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import WeightCacheError
from .serving_label import api_endpoint

log = logging.getLogger(__name__)

AUDIENCE = "weightcache.io"
MAX_TOKEN_CHARS = 8192
CACHE_SECONDS = 300.0  # a verified token is asked about again after this (its pod may be gone)
REFUSAL_SECONDS = 10.0
CACHE_ENTRIES = 1024
MAX_CONCURRENT = 2
EXTRA = "authentication.kubernetes.io/"
SA_PREFIX = "system:serviceaccount:"


class IdentityRefused(WeightCacheError):
    """The token proves no pod (forged, expired, wrong audience, another node) or cannot be checked."""


class ReviewUnavailable(IdentityRefused):
    """The agent cannot check tokens now (its own credentials refused, the API server unreachable):
    nothing is learnt about the token, so the refusal is not remembered for it."""


@dataclass(frozen=True)
class PodIdentity:
    namespace: str
    name: str
    uid: str
    node: str

    def pod(self) -> dict[str, str]:
        """The lease's `pod` fields."""
        return {"namespace": self.namespace, "name": self.name, "uid": self.uid}


def group_namespace(group: str) -> str | None:
    """The namespace a lease group belongs to: the text before its first '/' (EngineSets name
    their groups `<namespace>/<engineset>-<n>`); None for a group without one."""
    namespace, slash, rest = group.partition("/")
    return namespace if slash and namespace and rest else None


class PodVerifier:
    """TokenReview through the API server, cached by token hash."""

    def __init__(self, api_url: str | None = None, *, audience: str = AUDIENCE, node: str | None = None,
                 token_path: str | os.PathLike[str] | None = None, ca_path: str | os.PathLike[str] | None = None,
                 timeout: float = 5.0) -> None:
        self.host, self.port, self.token_path, self._ctx = api_endpoint(
            api_url, token_path, ca_path, IdentityRefused, "no API server to verify pod tokens")
        self.audience, self.node, self.timeout = audience, node or None, timeout
        self._conn: http.client.HTTPSConnection | None = None
        self._conn_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._cache: OrderedDict[str, tuple[float, PodIdentity | str]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.reviews = 0  # TokenReviews sent: what the cache saves shows here

    def verify(self, token: object) -> PodIdentity:
        """The pod `token` proves, or `IdentityRefused` with one line saying why not."""
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
            raise IdentityRefused(f"identity_token must be a string of at most {MAX_TOKEN_CHARS} characters")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                return self._answer(hit[1])
        expires = self._precheck(token)
        try:
            with self._slots:
                answer: PodIdentity | str = self._review(token)
        except ReviewUnavailable:
            raise
        except IdentityRefused as e:
            answer = str(e)
        if isinstance(answer, PodIdentity) and self.node and answer.node != self.node:
            answer = f"the token belongs to a pod on node {answer.node!r}, not this agent's node {self.node!r}"
        until = now + (min(CACHE_SECONDS, max(0.0, expires - time.time())) if isinstance(answer, PodIdentity)
                       else REFUSAL_SECONDS)
        with self._cache_lock:
            self._cache[key] = (until, answer)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return self._answer(answer)

    @staticmethod
    def _answer(answer: PodIdentity | str) -> PodIdentity:
        if isinstance(answer, str):
            raise IdentityRefused(answer)
        return answer

    def _precheck(self, token: str) -> float:
        """The token's expiry, read unverified, or a refusal: nothing that cannot be a current
        token of our audience is sent to the API server."""
        parts = token.split(".")
        try:
            if len(parts) != 3:
                raise ValueError
            claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
            aud, exp = claims.get("aud"), claims.get("exp")
        except (ValueError, TypeError, AttributeError):
            raise IdentityRefused("identity_token is not a service-account token (a JWT)") from None
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if self.audience not in audiences:
            raise IdentityRefused(f"identity_token is not for audience {self.audience!r}: mount a projected "
                                  f"service-account token with that audience")
        if not isinstance(exp, (int, float)) or exp <= time.time():
            raise IdentityRefused("identity_token has expired")
        return float(exp)

    def _review(self, token: str) -> PodIdentity:
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                           "spec": {"token": token, "audiences": [self.audience]}}).encode()
        status, raw = self._post("/apis/authentication.k8s.io/v1/tokenreviews", body)
        self.reviews += 1
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {}
        if status == 403:
            log.error("cannot verify engine tokens: the API server refused a TokenReview (%s); bind the ClusterRole "
                      "weightcache-agent-tokenreview to this agent's service account", doc.get("message", ""))
            raise ReviewUnavailable("the agent may not verify tokens (see its log)")
        if status == 401:
            log.error("cannot verify engine tokens: the API server does not accept this agent's own service-account "
                      "token (%s): expired or revoked, and not refreshed in place", self.token_path)
            raise ReviewUnavailable("the API server refused the agent's own credentials (see its log)")
        if status >= 300:
            raise ReviewUnavailable(f"token review failed: HTTP {status}")
        review = doc.get("status") or {}
        user = review.get("user") or {}
        if not review.get("authenticated") or self.audience not in (review.get("audiences") or [self.audience]):
            raise IdentityRefused("the API server does not accept this token for audience "
                                  f"{self.audience!r} (forged, expired, or its pod is gone)")
        extra = user.get("extra") or {}

        def one(key: str) -> str:
            values = extra.get(EXTRA + key)
            return values[0] if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str) else ""

        username = user.get("username") or ""
        namespace = username[len(SA_PREFIX):].split(":", 1)[0] if username.startswith(SA_PREFIX) else ""
        identity = PodIdentity(namespace, one("pod-name"), one("pod-uid"), one("node-name"))
        if not all((identity.namespace, identity.name, identity.uid)):
            raise IdentityRefused("the token is a service account's but not bound to a pod: present the token the "
                                  "kubelet projects into the engine pod")
        return identity

    def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """One POST on the kept connection (a fresh one when it went away); (status, body)."""
        try:
            token = self.token_path.read_text().strip()  # the kubelet rotates it: read each time
        except OSError as e:
            raise ReviewUnavailable(f"the agent's service-account token {self.token_path}: {e.strerror or e}") from None
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                   "Accept": "application/json"}
        with self._conn_lock:
            for attempt in (0, 1):
                if self._conn is None:
                    self._conn = http.client.HTTPSConnection(self.host, self.port, context=self._ctx,
                                                             timeout=self.timeout)
                try:
                    self._conn.request("POST", path, body=body, headers=headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                except (http.client.HTTPException, OSError) as e:
                    self._conn.close()
                    self._conn = None
                    if attempt:
                        raise ReviewUnavailable(f"token review: API server unreachable ({e})") from None
                    continue
                if resp.will_close:
                    self._conn.close()
                    self._conn = None
                return resp.status, raw
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
