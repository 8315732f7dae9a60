"""The EngineSet reconcile: engine pods on a WeightCache's GPUs, and serving labels that follow its agents.

Pure decisions, no I/O:

- ``placement``   which replica of the cache (node, GPUs) each serving group gets;
- ``manifests``   pure builders: engine pods, ResourceClaims, the Service;
- ``leases``      an agent's ``/status`` leases -> each group's primary, each pod's role;
- ``rollout``     the make-before-break planner: one next step per group;
- ``pods``        what an engine pod's object says: ready, failed, age, owner, slot;
- ``inventory``   the EngineSet's pods and claims by group, and the placement they record;
- ``groups``      one placed group's decisions: pods to replace, slots to fill, roles, excess standbys;
- ``switchover``  the checks of a switchover requested by annotation;
- ``status``      what a pass saw and did -> the status keys and conditions.

The pass, with the API:

- ``cache_view``  the WeightCache and its agents' ``/status``, read once per pass;
- ``owned``       the objects the EngineSet owns: listed, created, kept, relabelled;
- ``scope``       one pass's object, view and results, handed from step to step;
- ``reconciler``  one level-based pass as named steps that tie these together.
"""
