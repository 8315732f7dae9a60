"""Build and find the torch-native row binder (`_bindtorch.cpp`), once per torch build.

The C bind (`_bindfast`) is plain CPython and `pip install` builds it for any torch. The
row binder uses torch's C++ API, so it has to be compiled against the very torch an engine
runs, after that torch is installed: `weightcache build-native` (a C++ compiler and the
torch wheel's own headers; its time per machine: docs/install.md) writes `_bindtorch-KEY.so`, where KEY hashes the
torch version, its git revision, the C++ ABI, the Python ABI and the source. `load()` looks
for the file of the running torch's KEY only, so an upgraded torch never loads a stale
build: attaches then bind without it, slower by about a microsecond per tensor.

Where: `$WEIGHTCACHE_NATIVE_DIR` if set, else beside this module if writable, else
`~/.cache/weightcache/native`; `load()` looks in the same places.

Trust: loading a shared object runs its code, and every input of KEY is public, so the
name proves nothing. `build()` records the file's SHA-256 beside it (`KEY.so.sha256`), and
`find()` takes a build only when the file, its record and their directory are owned by
the running user or root and writable by nobody else, and the file's bytes hash to the
record: all checked before `dlopen`, on the descriptor that is then loaded. A build that
fails a check is skipped (the bind works without it); `refusals()` says why.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import stat
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
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):  # no $HOME and no passwd entry
        return [_HERE]
    return [_HERE, home / ".cache" / "weightcache" / "native"]


def library_name(build_key: str) -> str:
    return f"_bindtorch-{build_key}.so"


RECORD_SUFFIX = ".sha256"  # beside the build: the SHA-256 of its bytes, recorded when it was built


def record_name(build_key: str) -> str:
    return library_name(build_key) + RECORD_SUFFIX


class Untrusted(Exception):
    """A build that exists but may not be loaded; the message says which file and why."""


def _check_owner(st: os.stat_result, path: Path, what: str) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise Untrusted(f"{path}: {what} owned by uid {st.st_uid}, not by uid {os.geteuid()} or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{path}: {what} writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _read_trusted(path: Path, limit: int) -> tuple[int, bytes]:
    """An open descriptor of `path` (a regular file, not a link) and its bytes, after the
    ownership and mode checks on it; the caller closes the descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path}: not a regular file")
        _check_owner(st, path, "file")
        if st.st_size > limit:
            raise Untrusted(f"{path}: {st.st_size} bytes, more than a build can be")
        data = os.pread(fd, st.st_size + 1, 0)
        return fd, data
    except BaseException:
        os.close(fd)
        raise


def verified(path: Path) -> int:
    """An open descriptor of the build at `path`, once the build, its hash record and their
    directory pass the ownership checks and the bytes match the record; raises Untrusted."""
    try:
        _check_owner(os.stat(path.parent), path.parent, "directory")
        record_fd, record = _read_trusted(path.with_name(path.name + RECORD_SUFFIX), 128)
        os.close(record_fd)
        fd, data = _read_trusted(path, 1 << 30)
    except FileNotFoundError as e:
        raise Untrusted(f"{e.filename}: missing (rebuild with weightcache build-native)") from None
    except OSError as e:
        raise Untrusted(f"{path}: {e.strerror}") from None
    if hashlib.sha256(data).hexdigest() != record.decode(errors="replace").strip():
        os.close(fd)
        raise Untrusted(f"{path}: content does not match the hash recorded when it was built")
    return fd


def _candidates(build_key: str) -> list[Path]:
    found = []
    for place in places():
        try:
            if (place / library_name(build_key)).is_file():
                found.append(place / library_name(build_key))
        except OSError:  # an unreadable place (a $HOME we may not enter) has no build
            continue
    return found


def _scan(build_key: str | None) -> tuple[Path | None, list[str]]:
    """(the first build of the running torch that passes `verified()`, why each one before it did not)."""
    refused = []
    for path in _candidates(build_key or key()):
        try:
            os.close(verified(path))
        except Untrusted as e:
            refused.append(str(e))
            continue
        return path, refused
    return None, refused


def find(build_key: str | None = None) -> Path | None:
    """The build for the running torch (whose `key()` is `build_key`, where known), if one exists
    and passes `verified()`."""
    return _scan(build_key)[0]


def refusals(build_key: str | None = None) -> list[str]:
    """Why each build of the running torch found before a usable one is not loaded."""
    return _scan(build_key)[1]


def load(path: Path | None = None) -> object | None:
    """The row binder's function table (a capsule for `_bindfast.bind`), or None where no build
    matches the running torch, none passes `verified()`, or the build will not load. `path`:
    that build, not `find()`'s."""
    build_key = key()  # hashes the sources: once per load
    for candidate in [path] if path is not None else _candidates(build_key):
        try:
            fd = verified(candidate)
        except Untrusted:
            continue
        try:
            # Load the very file that was hashed: through its descriptor, not its name.
            via = f"/proc/self/fd/{fd}"
            loader = importlib.machinery.ExtensionFileLoader(MODULE, via)
            spec = importlib.util.spec_from_file_location(MODULE, via, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except ImportError:
            return None
        finally:
            os.close(fd)
        return module.rows if getattr(module, "built_for", None) == build_key else None
    return None


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
    with open(partial, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    os.chmod(partial, 0o755)
    _write_record(into / record_name(build_key), digest)
    os.replace(partial, target)
    _register_with_installer(target)
    return target


def _register_with_installer(target: Path) -> None:
    """A build beside the installed package goes into the distribution's RECORD, the list of files
    `pip uninstall weightcache` (and uv's) removes, so that no build outlives the package."""
    try:
        dist = importlib.metadata.distribution("weightcache")
        record = Path(next(f for f in dist.files or () if f.name == "RECORD" and f.parent.name.endswith(
            ".dist-info")).locate())  # the installed .dist-info's
        base = Path(dist.locate_file("")).resolve()
        names = [target.relative_to(base).as_posix(), target.with_name(target.name + RECORD_SUFFIX)
                 .relative_to(base).as_posix()]
        listed = record.read_text()
    except (importlib.metadata.PackageNotFoundError, StopIteration, ValueError, OSError):
        return  # not installed, or the build is elsewhere (--into, the cache): `build-native --remove` removes it
    missing = [name for name in names if f"\n{name}," not in "\n" + listed]
    if missing:
        with open(record, "a") as f:
            f.write(("" if listed.endswith("\n") or not listed else "\n") + "".join(f"{n},,\n" for n in missing))


def builds() -> list[Path]:
    """Every build and hash record in `places()`, of any torch: what `build-native --remove` removes."""
    found = []
    for place in places():
        try:
            found += sorted(p for p in place.iterdir() if p.name.startswith("_bindtorch-")
                            and p.name.endswith((".so", ".so" + RECORD_SUFFIX)))
        except OSError:  # absent or unreadable: nothing of ours there
            continue
    return found


def _write_record(path: Path, digest: str) -> None:
    """The build's hash, written under a temporary name (0644, this user's) and renamed."""
    fd, partial = tempfile.mkstemp(prefix=".bindtorch-", suffix=".sha256", dir=path.parent)
    try:
        os.write(fd, digest.encode() + b"\n")
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    os.replace(partial, path)


def _writable(place: Path) -> bool:
    while not place.exists():
        place = place.parent
    return os.access(place, os.W_OK)
