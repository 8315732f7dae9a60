"""The `weightcache` command line: one entry point, one subcommand per job.

Each subcommand imports only what it needs, so `weightcache status` stays fast and
`weightcache operator` is the only one that touches kopf/kubernetes.
"""
from __future__ import annotations

import sys

from . import __version__
from .usage import EXIT_BUSY, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, parser as usage_parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = usage_parser("weightcache", __doc__.splitlines()[0],
                          examples=["weightcache demo", "weightcache agent --help"],
                          codes=(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED))
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("agent", help="load a model and serve it to engines", add_help=False)
    sub.add_parser("status", help="show what an agent holds and who is attached", add_help=False)
    sub.add_parser("switchover", help="hand a group's primary role to one of its standbys", add_help=False)
    sub.add_parser("engine", help="run the reference inference engine", add_help=False)
    sub.add_parser("demo", help="the whole story on this machine: load, attach, serve, fail over", add_help=False)
    sub.add_parser("operator", help="run the Kubernetes operator", add_help=False)
    sub.add_parser("compile-cache-prune", help="remove an EngineSet's compile caches from this node",
                   add_help=False)
    sub.add_parser("build-native", help="compile the torch-native attach binder for the torch installed here",
                   add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] == "--version":
        parser.parse_args(argv)  # prints the version and exits 0
    command, rest = argv[0], argv[1:]
    if command == "agent":
        from .serve.agent_main import main as run
    elif command == "status":
        from .serve.status_cli import main as run
    elif command == "switchover":
        from .serve.switchover import main as run
    elif command == "engine":
        from .engine.main import main as run
    elif command == "demo":
        from .engine.demo import main as run
    elif command == "operator":
        from weightcache_operator.cli import main as run
    elif command == "compile-cache-prune":
        from .compile_cache_prune import main as run
    elif command == "build-native":
        from .client.native_cli import main as run
    else:
        parser.parse_args(argv)  # prints the usage error and exits 2
        return 2
    try:
        return run(rest)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler was installed (imports, flag checks)
        print(f"\nweightcache {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
