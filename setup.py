"""Everything is in pyproject.toml except the optional C extension of the attach loop.

`optional=True`: without a C compiler the install still succeeds and attach uses its
pure-Python path (same results, a few microseconds more per tensor).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("weightcache_agent._bindfast", ["node_agent/weightcache_agent/_bindfast.c"],
                             extra_compile_args=["-O2", "-Wall"], optional=True)])
