"""`weightcache build-native`: compile the torch-native row binder for the torch installed here.

Run it once where engines run, after torch is installed (an image's build step, typically):
attaches in every later engine process then bind each tensor inside torch. `--check` says
whether the running torch has a build that would be loaded (owned by this user or root,
writable by nobody else, matching the hash recorded at build time), without compiling.
`--remove` deletes every build (of any torch) where engines look: before `pip uninstall
weightcache`, which removes a build beside the package by itself but not one elsewhere.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..usage import EXIT_FAILED, EXIT_OK, EXIT_USAGE, parser as usage_parser, refuse

PROG = "weightcache build-native"


ENV_DIR = "WEIGHTCACHE_NATIVE_DIR"  # native_build.ENV_DIR, named here so that a bad flag fails before torch loads


def main(argv: list[str]) -> int:
    p = usage_parser(PROG, __doc__.splitlines()[0],
                     examples=["weightcache build-native", "weightcache build-native --into /opt/weightcache",
                               "weightcache build-native --check", "weightcache build-native --remove"],
                     env={ENV_DIR: "where builds go and are looked for",
                          "CXX": "the C++ compiler (default: c++)"})
    p.add_argument("--into", type=Path, default=None,
                   help=f"the directory to write the build into (default: ${ENV_DIR}, else beside "
                        "the package if writable, else ~/.cache/weightcache/native)")
    p.add_argument("--check", action="store_true", help="only say whether the running torch has a build (exit 1 if not)")
    p.add_argument("--remove", action="store_true",
                   help="delete every build, of any torch, where engines look (and in --into), then exit")
    args = p.parse_args(argv)
    if args.check and args.remove:
        return refuse(PROG, "--check and --remove are two commands: give one", EXIT_USAGE)
    if args.remove:
        return remove(args.into)
    import torch

    from . import native_build

    if args.check:
        found = native_build.find()
        if found is None:
            refused = native_build.refusals()
            if refused:
                return refuse(PROG, f"refusing the build for torch {torch.__version__}: {refused[0]}", EXIT_FAILED)
            return refuse(PROG, f"no build for torch {torch.__version__} (key {native_build.key()}); "
                                f"run {PROG}", EXIT_FAILED)
        print(f"{found} (torch {torch.__version__})")
        return EXIT_OK
    print(f"compiling the row binder for torch {torch.__version__} (its time per machine: docs/install.md)...",
          file=sys.stderr)
    began = time.monotonic()
    try:
        built = native_build.build(args.into)
    except (native_build.BuildError, OSError) as e:
        return refuse(PROG, str(e), EXIT_FAILED)
    try:
        os.close(native_build.verified(built))
    except native_build.Untrusted as e:
        return refuse(PROG, f"built, but engines will not load it: {e}", EXIT_FAILED)
    if native_build.load(built) is None:
        return refuse(PROG, f"{built} was built but does not load into this torch", EXIT_FAILED)
    print(f"built {built} for torch {torch.__version__} in {time.monotonic() - began:.1f} s")
    if args.into is not None and native_build.places()[0] != args.into.resolve():
        print(f"engines find it with {native_build.ENV_DIR}={args.into.resolve()}", file=sys.stderr)
    return EXIT_OK


def remove(into: Path | None) -> int:
    """Delete the builds and their hash records; one line per file, one line if there were none."""
    from . import native_build

    found = native_build.builds()
    if into is not None:
        found += sorted(p for p in into.glob("_bindtorch-*.so*") if p.name.endswith((".so", ".so.sha256")))
    failed = False
    for path in dict.fromkeys(found):
        try:
            path.unlink()
            print(f"removed {path}")
        except FileNotFoundError:
            continue
        except OSError as e:
            print(f"{PROG}: cannot remove {path}: {e.strerror}", file=sys.stderr)
            failed = True
    if not found:
        print(f"no build to remove in {', '.join(str(p) for p in native_build.places())}")
    return EXIT_FAILED if failed else EXIT_OK
