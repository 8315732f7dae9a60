"""The weightcache Kubernetes operator (kopf).

Turns `WeightCache` custom resources into DaemonSets of node agents and rolls the
agents' per-node state back into the resources' status; turns `EngineSet` resources
into engine pods placed on the cache's GPUs, with a Service that follows the agents'
choice of primary in each serving group. Module map (data flows top to bottom):

- ``config``     operator-wide settings (agent image, priority class, model root, ...)
                 from flags and environment, set once by the chart;
- ``spec``       a WeightCache's spec -> a validated, normalized ``CacheSpec``
                 (the same rules as the CRD's schema and CEL, re-checked here);
- ``manifests``  pure builders: ``CacheSpec`` -> DaemonSet / ConfigMap dicts;
- ``kube``       the few Kubernetes API calls (create-or-patch, list pods) and login;
- ``agents``     reads each agent pod's ``/status`` over HTTP;
- ``rollup``     per-node agent states -> bounded status summary;
- ``conditions`` Ready / Loading / Degraded conditions and their transitions;
- ``handlers``   the kopf handlers that tie these together;
- ``engineset_spec``       an EngineSet's spec -> a validated ``EngineSetSpec``;
- ``placement``            which replica of the cache (node, GPUs) each group gets;
- ``engineset_manifests``  pure builders: engine pods, ResourceClaims, the Service;
- ``engineset``            the EngineSet reconcile (registered by ``handlers``):
                           objects per group, serving labels from the agents' leases;
- ``cli``        ``weightcache operator`` entry point.

Nothing here imports torch: the operator never touches weights.
"""

API_GROUP = "weightcache.io"
API_VERSION = "v1alpha1"
PLURAL = "weightcaches"
KIND = "WeightCache"
ENGINESET_PLURAL = "enginesets"
ENGINESET_KIND = "EngineSet"
