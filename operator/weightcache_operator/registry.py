"""The kopf registry: every handler of the operator, for both resources, and kopf's settings.

``build_registry`` wires the two reconciles (``controller.weightcache`` and
``controller.engineset``) to kopf's triggers on a fresh registry: resume, create, a
spec change and a timer each run the same level-based pass (``register_level_based``).
The login handler builds the one API client both reconciles share; ``cli`` and the
tests run the registry with ``build_settings``.

Finalizer: the only one is kopf's own (``weightcache.io/operator``), which kopf puts
on every object that has a timer or a deletion handler so that it can stop the object's
timer before the object goes; without it a timer would outlive its object (kopf stops timers only
on a deletion timestamp) and keep polling and re-creating children. It also holds the
deletion of a WeightCache that an EngineSet still names in ``spec.cacheRef``, as
Kubernetes holds a PersistentVolumeClaim a pod uses: the deletion handler finds the
EngineSets, posts a Warning Event ``InUse`` naming them and retries until none is left
(deleting the EngineSets, or pointing them elsewhere, lets it go). Otherwise the agents
would go while the EngineSet's pods keep routing to engines whose agent is gone. The
DaemonSet and ConfigMap go through owner-reference garbage collection. Consequence:
while no operator runs, deleting a WeightCache waits for the operator to come back (or
for someone to remove the finalizer); the chart's notes say to delete WeightCaches
before uninstalling the operator. An EngineSet's deletion handler removes its compile
caches from the nodes its engines ran on (``compile_cache_cleanup``) before it goes.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from .api.v1alpha1 import API_GROUP, API_VERSION, ENGINESET_KIND, ENGINESET_PLURAL, KIND, PLURAL
from .config import OperatorConfig
from .controller.engineset.reconciler import EngineSetReconciler
from .controller.weightcache.reconciler import Reconciler
from .kube import KubeApi, connection_info, load_client_configuration


class QuietTimerSuccesses(logging.Filter):
    """kopf logs "Timer 'poll' succeeded." at INFO on every tick: one line per object per poll
    interval that says nothing. Such lines become DEBUG (shown where debug logging is on); a poll
    that fails still logs its warning."""

    LINE = re.compile(r"Timer '[^']*' succeeded\.")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and isinstance(record.msg, str) and self.LINE.fullmatch(record.msg):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def build_settings(settings: kopf.OperatorSettings | None = None) -> kopf.OperatorSettings:
    """kopf settings for this operator (also used by the tests' KopfRunner), and its log's filter."""
    objects = logging.getLogger("kopf.objects")  # kopf's per-object log, handler outcomes included
    if not any(isinstance(f, QuietTimerSuccesses) for f in objects.filters):
        objects.addFilter(QuietTimerSuccesses())
    settings = settings or kopf.OperatorSettings()
    # kopf's own bookkeeping goes into annotations under our group, never into
    # .status (the CRD's structural schema would prune unknown status fields).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    # Our own Events are explicit (condition transitions, child writes); kopf's log
    # lines become Events only when they are warnings or errors.
    settings.posting.level = logging.WARNING
    # One replica (Deployment strategy Recreate): no peering objects, no RBAC for them.
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # A deletion that finds the poll timer mid-reconcile lets it finish, then looks again:
    # after a second, not kopf's default minute (the object would linger that long).
    settings.background.cancellation_polling = 1.0
    # Watches that silently stall behind load balancers are restarted.
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    return settings


def build_registry(
    config: OperatorConfig,
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
) -> tuple[kopf.OperatorRegistry, Reconciler]:
    """All handlers of the operator (WeightCache and EngineSet), on a fresh registry (no module-level state)."""
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler(config)
    engines = EngineSetReconciler(config)
    resource = (API_GROUP, API_VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, logger: Any, **_: Any) -> kopf.ConnectionInfo:
        cfg = load_client_configuration(kubeconfig, context)
        old, reconciler.api = reconciler.api, KubeApi(cfg)
        engines.api = reconciler.api
        if old is not None:
            old.close()
        logger.info(f"logged in to {cfg.host}")
        return connection_info(cfg, trust_env=settings.networking.trust_env)

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:
        if reconciler.api is not None:
            reconciler.api.close()

    register_level_based(registry, resource, reconciler.reconcile, config,
                         ("reconcile-resume", "reconcile-create", "reconcile-update", "poll"), KIND)

    @kopf.on.delete(*resource, registry=registry, id="held-while-in-use")
    async def held_while_in_use(body: kopf.Body, logger: Any, **_: Any) -> None:
        meta = body.get("metadata") or {}
        assert reconciler.api is not None
        try:
            users = await asyncio.to_thread(reconciler.api.enginesets_using, meta["namespace"], meta["name"])
        except ApiException as e:
            raise kopf.TemporaryError(f"cannot list EngineSets: API error {e.status}: {e.reason}", delay=5) from e
        if users:
            message = (f"deletion waits: EngineSet {', '.join(users[:5])} uses this WeightCache (spec.cacheRef); "
                       "delete it, or point it at another cache, and the deletion goes on")
            kopf.event(body, type="Warning", reason="InUse", message=message[:1024])
            raise kopf.TemporaryError(message, delay=config.poll_interval)
    register_level_based(registry, (API_GROUP, API_VERSION, ENGINESET_PLURAL), engines.reconcile, config,
                         ("engineset-resume", "engineset-create", "engineset-update", "engineset-poll"),
                         ENGINESET_KIND)

    @kopf.on.delete(API_GROUP, API_VERSION, ENGINESET_PLURAL, registry=registry, id="compile-cache-cleanup")
    def compile_cache_cleanup(body: kopf.Body, **_: Any) -> None:
        # sync: kopf runs it in its thread pool, where the API client's blocking calls belong
        try:
            assert reconciler.api is not None
            engines.compile_caches.on_delete(reconciler.api, body)
        except ApiException as e:
            raise kopf.TemporaryError(f"compile-cache cleanup: API error {e.status}: {e.reason}", delay=5) from e
    return registry, reconciler


def register_level_based(registry: kopf.OperatorRegistry, resource: tuple[str, str, str],
                         reconcile: Callable[..., Awaitable[None]], config: OperatorConfig,
                         ids: tuple[str, str, str, str], kind: str) -> None:
    """One level-based reconcile on every trigger: resume, create, a spec change, and a timer."""

    async def on_change(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        try:
            await reconcile(body, memo, logger)
        except ApiException as e:
            # Conflicts and transient API errors: retry soon from a fresh read.
            raise kopf.TemporaryError(f"API error {e.status}: {e.reason}", delay=5) from e

    resume, create, update, timer = ids
    kopf.on.resume(*resource, registry=registry, id=resume)(on_change)
    kopf.on.create(*resource, registry=registry, id=create)(on_change)
    kopf.on.update(*resource, registry=registry, id=update, field="spec")(on_change)

    async def poll(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        try:
            await reconcile(body, memo, logger)
        except ApiException as e:
            # The next tick retries; a timer error must not stop the timer.
            logger.warning(f"{kind} reconcile failed, retrying in {config.poll_interval}s: "
                           f"API error {e.status}: {e.reason}")

    kopf.timer(
        *resource, registry=registry, id=timer,
        interval=config.poll_interval,
        # create/resume reconcile right away; the first poll can wait a little.
        initial_delay=min(5.0, config.poll_interval),
    )(poll)
