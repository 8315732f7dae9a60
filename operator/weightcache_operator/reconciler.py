"""What the WeightCache and EngineSet reconcilers share: settings, the API client, one pass at a time.

kopf calls ``reconcile`` from several handlers of one object (create, resume, spec
change, timer); they may fire together, and their reads and writes must not
interleave, so a pass holds a lock kept in the object's memo. Until the login
handler has set the API client, a pass is a temporary error (kopf retries it
shortly) rather than a failure. Each subclass's ``_reconcile`` is the pass itself.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from .config import OperatorConfig
from .kube import KubeApi


class ObjectReconciler:
    """One instance per kind and operator run; the login handler sets ``api``."""

    def __init__(self, config: OperatorConfig, api: KubeApi | None = None) -> None:
        self.config = config
        self.api = api

    async def reconcile(self, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | kopf.Logger) -> None:
        lock = memo.setdefault("lock", asyncio.Lock())
        async with lock:
            if self.api is None:
                raise kopf.TemporaryError("API client not ready (login pending)", delay=1)
            await self._reconcile(body, memo, logger)

    async def _reconcile(self, body: kopf.Body, memo: kopf.Memo, logger: Any) -> None:
        raise NotImplementedError
