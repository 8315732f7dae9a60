"""The weightcache Kubernetes operator (kopf).

Turns `WeightCache` custom resources into DaemonSets of node agents and rolls the
agents' per-node state back into the resources' status; turns `EngineSet` resources
into engine pods placed on the cache's GPUs, with a Service that follows the agents'
choice of primary in each serving group. Laid out by resource, as kubebuilder
operators are; each layer imports only the ones above it in this list:

- ``api.v1alpha1``          the CRDs' group and version; each kind's spec -> a validated,
                            normalized spec (``weightcache_types``: ``WeightCacheSpec``,
                            ``engineset_types``: ``EngineSetSpec``), the same rules as
                            the CRDs' schema and CEL, re-checked here;
- shared by both resources:
  - ``config``              operator-wide settings (agent image, priority class, model
                            root, ...) from flags and environment, set once by the chart;
  - ``kube``                the few Kubernetes API calls (create-or-patch, list pods) and login;
  - ``conditions``          Ready / Loading / Degraded conditions and their transitions;
  - ``owned_status``        the status keys a reconcile owns: carried over, patched, announced;
  - ``reconciler``          the base of both reconcilers: one pass at a time per object;
- ``controller.weightcache``  the WeightCache reconcile: agent DaemonSet, agents' ``/status``
                              rolled up into the cache's status;
- ``controller.engineset``    the EngineSet reconcile: placement, engine pods, rollouts,
                              serving labels from the agents' leases (reads the cache
                              through ``controller.weightcache``);
- ``registry``   every kopf handler of both resources, and kopf's settings;
- ``cli``        ``weightcache operator`` entry point.

Nothing here imports torch: the operator never touches weights.
"""
