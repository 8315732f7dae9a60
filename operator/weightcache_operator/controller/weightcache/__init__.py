"""The WeightCache reconcile: a cache's spec -> its agent DaemonSet, and its agents' states -> its status.

- ``manifests``   pure builders: ``WeightCacheSpec`` -> DaemonSet / ConfigMap / agent identity dicts;
- ``control``     the agents' control token and Secret, and planned switchovers over HTTP;
- ``agents``      reads each agent pod's ``/status`` over HTTP (the EngineSet reconcile too);
- ``rollup``      per-node agent states -> the bounded status summary and conditions;
- ``transition``  a model change: held while a node lacks memory for a second copy;
- ``reconciler``  one level-based pass that ties these together.
"""
