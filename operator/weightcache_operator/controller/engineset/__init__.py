"""The EngineSet reconcile: engine pods on a WeightCache's GPUs, and serving labels that follow its agents.

- ``placement``   which replica of the cache (node, GPUs) each serving group gets;
- ``manifests``   pure builders: engine pods, ResourceClaims, the Service;
- ``leases``      an agent's ``/status`` leases -> each group's primary, each pod's role;
- ``rollout``     the make-before-break planner: one next step per group;
- ``reconciler``  one level-based pass that ties these together.
"""
