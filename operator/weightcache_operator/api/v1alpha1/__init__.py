"""weightcache.io/v1alpha1: the group, version, kinds and plurals of the CRDs in crds/.

- ``weightcache_types``  a WeightCache's spec -> a validated, normalized ``WeightCacheSpec``
                         (the CRD's schema and CEL rules, checked again), and the
                         ``SpecError`` every spec check raises;
- ``engineset_types``    an EngineSet's spec -> a validated ``EngineSetSpec``.
"""

API_GROUP = "weightcache.io"
API_VERSION = "v1alpha1"
PLURAL = "weightcaches"
KIND = "WeightCache"
ENGINESET_PLURAL = "enginesets"
ENGINESET_KIND = "EngineSet"
