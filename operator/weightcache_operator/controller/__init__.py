"""The two reconciles, one subpackage per resource: ``weightcache`` and ``engineset``.

An EngineSet runs on a WeightCache's agents, so ``engineset`` reads the cache through
``weightcache`` (its spec, agents, control tokens); ``weightcache`` never imports
``engineset``. ``registry`` registers both with kopf.
"""
