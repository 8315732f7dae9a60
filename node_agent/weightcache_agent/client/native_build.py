"""Build and find the torch-native row binder (`_bindtorch.cpp`), once per torch build.

The C bind (`_bindfast`) is plain CPython and `pip install` builds it for any torch. The
row binder uses torch's C++ API, so it has to be compiled against the very torch an engine
runs, after that torch is installed: `weightcache build-native` (a C++ compiler and the
torch wheel's own headers; 10-20 s) writes `_bindtorch-KEY.so`, where KEY hashes the
torch version, its git revision, the C++ ABI, the Python ABI and the source. `load()` looks
for the file of the running torch's KEY only, so an upgraded torch never loads a stale
build: attaches then bind without it, slower by about a microsecond per tensor.

Where: `$WEIGHTCACHE_NATIVE_DIR` if set, else beside this module if writable, else
`~/.cache/weightcache/native`; `load()` looks in the same places.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
SOURCES = (_HERE / "_bindtorch.cpp", _HERE / "_bindtorch.h")
MODULE = "weightcache_agent.client._bindtorch"
ENV_DIR = "WEIGHTCACHE_NATIVE_DIR"


class BuildError(RuntimeError):
    """The compiler is missing or refused the source; the message carries its last lines."""


def key() -> str:
    """What a build is valid for: this torch (version, git revision, C++ ABI), this Python, this source."""
    h = hashlib.sha256()
    for part in (torch.__version__, getattr(torch.version, "git_version", ""), str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 sysconfig.get_config_var("SOABI") or sys.version):
        h.update(part.encode() + b"\0")
    for source in SOURCES:
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def places() -> list[Path]:
    """Where builds go and are looked for, first match wins."""
    env = os.environ.get(ENV_DIR)
    if env:
        return [Path(env)]
    return [_HERE, Path.home() / ".cache" / "weightcache" / "native"]


def library_name(build_key: str) -> str:
    return f"_bindtorch-{build_key}.so"


def find(build_key: str | None = None) -> Path | None:
    """The build for the running torch (whose `key()` is `build_key`, where known), if one exists."""
    name = library_name(build_key or key())
    for place in places():
        if (place / name).is_file():
            return place / name
    return None


def load(path: Path | None = None) -> object | None:
    """The row binder's function table (a capsule for `_bindfast.bind`), or None where no build
    matches the running torch or the build will not load. `path`: that build, not `find()`'s."""
    build_key = key()  # hashes the sources: once per load
    path = path or find(build_key)
    if path is None:
        return None
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError:
        return None
    return module.rows if getattr(module, "built_for", None) == build_key else None


def build(into: Path | None = None, compiler: str | None = None) -> Path:
    """Compile the row binder for the running torch into `into` (default: the first writable of
    `places()`); returns the file. Written under a temporary name and renamed, so an engine
    starting meanwhile sees the whole file or none."""
    build_key = key()
    if into is None:
        into = next((p for p in places() if _writable(p)), None)
        if into is None:
            raise BuildError(f"no writable place for the build: tried {', '.join(map(str, places()))}; "
                             f"set {ENV_DIR}")
    into.mkdir(parents=True, exist_ok=True)
    target = into / library_name(build_key)
    torch_dir = Path(torch.__file__).resolve().parent
    cxx = compiler or os.environ.get("CXX", "c++")
    fd, partial = tempfile.mkstemp(prefix=".bindtorch-", suffix=".so", dir=into)
    os.close(fd)
    command = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f'-DWEIGHTCACHE_TORCH_KEY="{build_key}"',
               "-I", sysconfig.get_paths()["include"], "-I", str(torch_dir / "include"),
               "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
               str(SOURCES[0]), "-o", partial,
               "-L", str(torch_dir / "lib"), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
               f"-Wl,-rpath,{torch_dir / 'lib'}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(partial)
        raise BuildError(f"no C++ compiler {cxx!r} (install g++, or set CXX)") from None
    if done.returncode != 0:
        os.unlink(partial)
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise BuildError(f"{cxx} failed (exit {done.returncode}): {tail}")
    os.replace(partial, target)
    return target


def _writable(place: Path) -> bool:
    while not place.exists():
        place = place.parent
    return os.access(place, os.W_OK)
