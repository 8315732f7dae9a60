"""Everything is in pyproject.toml except three optional C extensions: the attach loop
(`_bindfast`), the message for a write to a read-only weight (`_rofault`) and the CPU
block-FP8 quantizer (`_fp8cpu`).

`optional=True`: without a C compiler the install still succeeds, and attach and the
loader use their torch paths (same bytes, more time). The torch-native row binder
(`_bindtorch.cpp`) is not built here: it needs the engine's own torch, which a build
environment need not have; `weightcache build-native` compiles it after install.

No RUNPATH: a Python built under its own prefix (pyenv, a source build) links extensions with
`-Wl,-rpath,<prefix>/lib` from its LDFLAGS, a path of the build machine that the wheel would carry
into every installation. The extensions need no library of Python's (only libc), so those flags go.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _is_rpath(arg: str) -> bool:
    return arg.startswith(("-Wl,-rpath", "-Wl,-R", "-Wl,--enable-new-dtags,-rpath")) or arg in ("-rpath", "-R")


class BuildExt(build_ext):
    def build_extensions(self):
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not _is_rpath(a)]
        super().build_extensions()


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[
    Extension("weightcache_agent.client._bindfast", ["node_agent/weightcache_agent/client/_bindfast.c"],
              depends=["node_agent/weightcache_agent/client/_bindtorch.h"],
              extra_compile_args=["-O2", "-Wall"], optional=True),
    Extension("weightcache_agent.client._rofault", ["node_agent/weightcache_agent/client/_rofault.c"],
              extra_compile_args=["-O2", "-Wall"], optional=True),
    Extension("weightcache_agent.load._fp8cpu", ["node_agent/weightcache_agent/load/_fp8cpu.c"],
              # no FP traps: lets the compiler vectorise the conversion (it computes both rounding cases)
              extra_compile_args=["-O3", "-fno-trapping-math", "-Wall"], optional=True),
])
