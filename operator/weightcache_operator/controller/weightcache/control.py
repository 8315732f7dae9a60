"""The operator's hand on the agents: planned switchovers, over the agents' HTTP, behind a token.

A rolling upgrade hands each group's primary role to a new standby with `POST /switchover`
on the agent pod of the group's node. The agent accepts it only with its control token,
a file from the Secret `<cache>-agent-control` that its DaemonSet mounts. The token is
derived, not stored: HMAC-SHA256 of `<namespace>/<cache>` under the operator's own key
(a file the chart gives the operator), so the operator only ever *creates* that Secret --
it needs no right to read or change Secrets -- and, restarted, computes the same token.
Without a key, rollouts cannot switch and say so in a condition.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import urllib.error
import urllib.request
from typing import Any

from .manifests import CONTROL_FILE, agent_labels, control_secret_name

MAX_REPLY_BYTES = 1 << 20
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # pod IPs never go through a proxy


class SwitchoverError(Exception):
    """The agent did not switch the group: its answer, in one line."""


def control_token(key: bytes, namespace: str, cache: str) -> str:
    return hmac.new(key, f"{namespace}/{cache}".encode(), hashlib.sha256).hexdigest()


def status_token(key: bytes | None, namespace: str, cache: str) -> str | None:
    """What the operator shows an agent's ``/status`` so that the leases name their pods (None: no key)."""
    return control_token(key, namespace, cache) if key is not None else None


def render_control_secret(key: bytes, namespace: str, cache: str) -> dict[str, Any]:
    token = control_token(key, namespace, cache)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": control_secret_name(cache), "namespace": namespace, "labels": agent_labels(cache)},
        "type": "Opaque",
        "data": {CONTROL_FILE: base64.b64encode(token.encode()).decode()},
    }


def post_switchover(base_url: str, token: str, group: str, to_pod: str | None, timeout: float) -> dict[str, Any]:
    """Ask the agent at `base_url` to hand `group` to `to_pod`; its reply, or SwitchoverError."""
    request = urllib.request.Request(
        f"{base_url}/switchover", data=json.dumps({"group": group, "toPod": to_pod}).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return json.loads(response.read(MAX_REPLY_BYTES))
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read(MAX_REPLY_BYTES))
            why = body.get("message") or body.get("error") or e.reason
        except ValueError:
            why = e.reason
        raise SwitchoverError(f"agent at {base_url} answered {e.code}: {why}") from None
    except (OSError, ValueError) as e:
        raise SwitchoverError(f"agent at {base_url}: {e}") from None
