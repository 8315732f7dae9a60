"""`weightcache build-native`: compile the torch-native row binder for the torch installed here.

Run it once where engines run, after torch is installed (an image's build step, typically):
attaches in every later engine process then bind each tensor inside torch. `--check` says
whether the running torch has a build that would be loaded (owned by this user or root,
writable by nobody else, matching the hash recorded at build time), without compiling.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..usage import EXIT_FAILED, EXIT_OK, parser as usage_parser, refuse

PROG = "weightcache build-native"


ENV_DIR = "WEIGHTCACHE_NATIVE_DIR"  # native_build.ENV_DIR, named here so that a bad flag fails before torch loads


def main(argv: list[str]) -> int:
    p = usage_parser(PROG, __doc__.splitlines()[0],
                     examples=["weightcache build-native", "weightcache build-native --into /opt/weightcache",
                               "weightcache build-native --check"],
                     env={ENV_DIR: "where builds go and are looked for",
                          "CXX": "the C++ compiler (default: c++)"})
    p.add_argument("--into", type=Path, default=None,
                   help=f"the directory to write the build into (default: ${ENV_DIR}, else beside "
                        "the package if writable, else ~/.cache/weightcache/native)")
    p.add_argument("--check", action="store_true", help="only say whether the running torch has a build (exit 1 if not)")
    args = p.parse_args(argv)
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
    print(f"compiling the row binder for torch {torch.__version__} (10-20 s)...", file=sys.stderr)
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
