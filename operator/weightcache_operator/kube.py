"""The few Kubernetes API calls the operator makes besides kopf's own, and the login.

kopf watches WeightCaches and EngineSets, patches their status and posts Events with
its own client. The children (DaemonSet, ConfigMap, the agents' ServiceAccount and
RoleBinding; an EngineSet's pods, ResourceClaims and Service) and the agent pods are
read and written here with the official ``kubernetes`` client, called from a thread
(it is synchronous).
Objects travel as plain dicts (``_preload_content=False``): no model classes, so what
we render is exactly what is sent.

Writes follow the API server's semantics, not an emulator's: create-or-patch (a 409
on create means someone else created it: read it and patch), JSON merge patches that
carry ``metadata.resourceVersion`` (a concurrent writer gets a 409, and the next
reconcile starts over from a fresh read), and keys the desired object no longer has
set to null explicitly (a merge patch would otherwise keep them).

Login: both kopf and this client use one ``kubernetes.client.Configuration``, loaded
in-cluster (service account) or from the kubeconfig named by ``--kubeconfig`` or
``$KUBECONFIG`` *at call time* (the client library's own default binds $KUBECONFIG
when it is imported, which is too early for tests and for flags).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from .api.v1alpha1 import API_GROUP, API_VERSION, ENGINESET_PLURAL, PLURAL

MERGE_PATCH = "application/merge-patch+json"

# Namespaced kinds handled by the generic calls below: (API class, method suffix).
# Every one of them has read_/create_/patch_/delete_/list_namespaced_<suffix>.
_KINDS = {
    "Pod": ("core", "pod"),
    "Secret": ("core", "secret"),
    "Service": ("core", "service"),
    "ServiceAccount": ("core", "service_account"),
    "RoleBinding": ("rbac", "role_binding"),
    "ResourceClaim": ("resource", "resource_claim"),
}


def load_client_configuration(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster credentials when running in a pod (and no kubeconfig was named), else a kubeconfig."""
    cfg = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=cfg)
        return cfg
    path = path or os.path.expanduser("~/.kube/config")
    kubernetes.config.load_kube_config(config_file=path, context=context, client_configuration=cfg)
    return cfg


def connection_info(cfg: kubernetes.client.Configuration, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """The same credentials, in the form kopf's own client wants."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme: str | None = None
    token: str | None = None
    if header:
        parts = header.split(" ", 1)
        scheme, token = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        trust_env=trust_env,
    )


def merge_patch_for(current: Any, desired: Any) -> Any:
    """RFC 7386 merge patch turning ``current`` into ``desired`` (dicts recurse, lists replace).

    Keys only ``current`` has become null, so removed tolerations' parents, removed
    node selector labels and the like really go away. Server-defaulted keys come out
    null too; the API server defaults them again, so that changes nothing.
    """
    if not isinstance(current, Mapping) or not isinstance(desired, Mapping):
        return desired
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if key not in current:
            patch[key] = value
        elif isinstance(value, Mapping) and isinstance(current[key], Mapping):
            sub = merge_patch_for(current[key], value)
            if sub != {}:
                patch[key] = sub
        elif current[key] != value:
            patch[key] = value
    for key in current:
        if key not in desired:
            patch[key] = None
    return patch


class KubeApi:
    """Blocking calls; the reconcilers run them with ``asyncio.to_thread``."""

    def __init__(self, cfg: kubernetes.client.Configuration) -> None:
        self._client = kubernetes.client.ApiClient(cfg)
        self._apps = kubernetes.client.AppsV1Api(self._client)
        self._core = kubernetes.client.CoreV1Api(self._client)
        self._custom = kubernetes.client.CustomObjectsApi(self._client)
        self._apis = {
            "core": self._core,
            "rbac": kubernetes.client.RbacAuthorizationV1Api(self._client),
            "resource": kubernetes.client.ResourceV1Api(self._client),
        }

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def _json(response: Any) -> dict[str, Any]:
        return json.loads(response.data)

    # DaemonSets

    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self._apps.read_namespaced_daemon_set(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_daemonset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return self._json(self._apps.create_namespaced_daemon_set(ns, dict(body), _preload_content=False))

    def patch_daemonset(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(self._apps.patch_namespaced_daemon_set(
            name, namespace, dict(patch), _content_type=MERGE_PATCH, _preload_content=False))

    # ConfigMaps

    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self._core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_configmap(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return self._json(self._core.create_namespaced_config_map(ns, dict(body), _preload_content=False))

    def patch_configmap(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(self._core.patch_namespaced_config_map(
            name, namespace, dict(patch), _content_type=MERGE_PATCH, _preload_content=False))

    # WeightCache status (the status subresource: a spec in the patch would be ignored)

    def patch_cache_status(self, namespace: str, name: str, status_patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(self._custom.patch_namespaced_custom_object_status(
            API_GROUP, API_VERSION, namespace, PLURAL, name, {"status": dict(status_patch)},
            _content_type=MERGE_PATCH, _preload_content=False))

    # Pods

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        doc = self._json(self._core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False))
        return list(doc.get("items") or [])

    # Generic namespaced objects (see _KINDS)

    def _method(self, verb: str, kind: str) -> Any:
        api, suffix = _KINDS[kind]
        return getattr(self._apis[api], f"{verb}_namespaced_{suffix}")

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self._method("read", kind)(name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return self._json(self._method("create", body["kind"])(ns, dict(body), _preload_content=False))

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(self._method("patch", kind)(
            name, namespace, dict(patch), _content_type=MERGE_PATCH, _preload_content=False))

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete (background propagation); with ``uid``, only that incarnation. False if already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._method("delete", kind)(name, namespace, body=body, _preload_content=False)
        except ApiException as e:
            if e.status in (404, 409):  # gone, or replaced by a new object of that name
                return False
            raise
        return True

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        doc = self._json(self._method("list", kind)(namespace, label_selector=selector, _preload_content=False))
        return list(doc.get("items") or [])

    # Cluster-scoped and custom objects the EngineSet reconcile reads

    def get_device_class(self, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self._apis["resource"].read_device_class(name, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(self._custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION, namespace, PLURAL, name, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def enginesets_using(self, namespace: str, cache: str) -> list[str]:
        """Names of the EngineSets in `namespace` whose spec.cacheRef names `cache` and that are not
        being deleted themselves; none where the EngineSet kind is not installed."""
        try:
            doc = self._json(self._custom.list_namespaced_custom_object(
                API_GROUP, API_VERSION, namespace, ENGINESET_PLURAL, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return sorted(str((es.get("metadata") or {}).get("name")) for es in doc.get("items") or []
                      if ((es.get("spec") or {}).get("cacheRef") or {}).get("name") == cache
                      and not (es.get("metadata") or {}).get("deletionTimestamp"))

    def patch_engineset_status(self, namespace: str, name: str, status_patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(self._custom.patch_namespaced_custom_object_status(
            API_GROUP, API_VERSION, namespace, ENGINESET_PLURAL, name, {"status": dict(status_patch)},
            _content_type=MERGE_PATCH, _preload_content=False))

    def annotate_engineset(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        """Set (None: drop) annotations of an EngineSet."""
        self._custom.patch_namespaced_custom_object(
            API_GROUP, API_VERSION, namespace, ENGINESET_PLURAL, name, {"metadata": {"annotations": dict(annotations)}},
            _content_type=MERGE_PATCH, _preload_content=False)

    def remove_engineset_annotation(self, namespace: str, name: str, key: str, resource_version: str | None) -> None:
        """Drop one annotation; with ``resource_version``, only from that version (409 otherwise)."""
        meta: dict[str, Any] = {"annotations": {key: None}}
        if resource_version:
            meta["resourceVersion"] = resource_version
        self._custom.patch_namespaced_custom_object(
            API_GROUP, API_VERSION, namespace, ENGINESET_PLURAL, name, {"metadata": meta},
            _content_type=MERGE_PATCH, _preload_content=False)
