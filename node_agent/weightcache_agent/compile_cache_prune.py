"""`weightcache compile-cache-prune`: remove an EngineSet's compile caches from a node.

Why: the operator gives each EngineSet's engine pods a host directory per artifact key,
``<root>/<namespace>/<engineset>/<key>`` (``controller/engineset/compile_cache.py``). When
the EngineSet is deleted its directories would stay on every node it ran on. The operator
then runs this command once per such node, in a pod of the agent's image that mounts the
namespace's directory ``<root>/<namespace>`` at ``/cache``:

    weightcache compile-cache-prune /cache chat              # the EngineSet chat's directory, whole
    weightcache compile-cache-prune /cache chat --keep KEY   # its other keys only

How data flows: the two arguments are checked to be a directory and a DNS label (the
command never follows a path it is given further than that one name); the keys to
remove are the entries of ``<dir>/<engineset>`` that are not kept; each goes with
``shutil.rmtree``, which unlinks symbolic links instead of following them, so an engine
that planted a link in its cache cannot make this command delete anything outside it.
One line per removed key (its bytes) on stdout; exit 0 also when there was nothing to
remove, 1 when something could not be removed (one line saying what), 2 for a bad call.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import sys

from .usage import EXIT_OK, EXIT_USAGE, parser as usage_parser, refuse

PROG = "weightcache compile-cache-prune"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY = re.compile(r"^[0-9a-f]{16}$")


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path`, links not followed."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(top, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def prune(directory: str, engineset: str, keep: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """Remove `directory/engineset` (whole where `keep` is empty, else its entries not in `keep`);
    returns (entry, bytes) for each removed. Raises OSError for what could not be removed."""
    base = os.path.join(directory, engineset)
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):  # a link or a file where the EngineSet's directory belongs
        os.unlink(base)
        return [(engineset, 0)]
    removed = []
    for entry in sorted(os.listdir(base)):
        if entry in keep:
            continue
        path = os.path.join(base, entry)
        size = tree_bytes(path) if os.path.isdir(path) and not os.path.islink(path) else 0
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed.append((entry, size))
    if not keep:
        os.rmdir(base)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = usage_parser(PROG, __doc__.splitlines()[0], examples=[
        "weightcache compile-cache-prune /cache chat", "weightcache compile-cache-prune /cache chat --keep 0123456789abcdef"])
    parser.add_argument("directory", help="the namespace's compile-cache directory (<root>/<namespace>)")
    parser.add_argument("engineset", help="the EngineSet whose directory goes")
    parser.add_argument("--keep", action="append", default=[], metavar="KEY",
                        help="an artifact key (16 hex characters) to keep; repeatable")
    args = parser.parse_args(argv)
    if not _DNS_LABEL.match(args.engineset) or len(args.engineset) > 63:
        return refuse(PROG, f"EngineSet name {args.engineset!r} is not a DNS label", EXIT_USAGE)
    bad = [k for k in args.keep if not _KEY.match(k)]
    if bad:
        return refuse(PROG, f"--keep {bad[0]!r} is not an artifact key (16 lowercase hex characters)", EXIT_USAGE)
    if not os.path.isdir(args.directory):
        return refuse(PROG, f"{args.directory} is not a directory", EXIT_USAGE)
    try:
        removed = prune(args.directory, args.engineset, frozenset(args.keep))
    except OSError as e:
        return refuse(PROG, f"cannot remove {e.filename or args.engineset}: {e.strerror or e}")
    for entry, size in removed:
        print(f"removed {args.engineset}/{entry}: {size / 2**20:.1f} MiB")
    if not removed:
        print(f"nothing to remove under {args.engineset}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
