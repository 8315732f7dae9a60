"""``weightcache operator``: run the kopf operator against the current cluster.

Credentials: in a pod, the service account (unless --kubeconfig is given); outside,
the kubeconfig from --kubeconfig or $KUBECONFIG. Scope: one or more namespaces
(--namespace, repeatable; the chart's watchNamespaces) or the whole cluster
(--all-namespaces, the default). The operator runs standalone (no kopf peering):
the chart deploys exactly one replica with the Recreate strategy, so two operators
never handle the same object, and no peering CRD or RBAC is needed.

Agent settings (image, priority class, model root, ...) come from WEIGHTCACHE_*
environment variables (see ``config.OperatorConfig.from_env``); the flags below
override them.
"""
from __future__ import annotations

import argparse
import logging

from weightcache_agent.usage import EXIT_FAILED, EXIT_USAGE, parser as usage_parser, refuse

from .config import OperatorConfig

PROG = "weightcache operator"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = usage_parser(
        PROG, __doc__.splitlines()[0],
        examples=["weightcache operator --kubeconfig ~/.kube/config -n ml",
                  "weightcache operator --all-namespaces --liveness http://0.0.0.0:8080/healthz"],
        env={"KUBECONFIG": "credentials outside a pod, when --kubeconfig is not given",
             "WEIGHTCACHE_AGENT_IMAGE": "default of --agent-image",
             "WEIGHTCACHE_PRIORITY_CLASS": "default of --priority-class",
             "WEIGHTCACHE_MODEL_ROOT": "default of --model-root",
             "WEIGHTCACHE_POLL_INTERVAL": "default of --poll-interval",
             "WEIGHTCACHE_*": "the other agent settings: see config.OperatorConfig"})
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                       metavar="NS", help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument("--context", help="kubeconfig context (default: the kubeconfig's current one)")
    parser.add_argument("--agent-image", help="default agent image (default: $WEIGHTCACHE_AGENT_IMAGE, else the "
                                              "release's image)")
    parser.add_argument("--priority-class", help="agent pods' priority class, '' for none (default: "
                                                 "$WEIGHTCACHE_PRIORITY_CLASS, else the configured one)")
    parser.add_argument("--model-root", help="host directory with the models (default: $WEIGHTCACHE_MODEL_ROOT, "
                                             "else the configured one)")
    parser.add_argument("--poll-interval", type=float, help="seconds between agent polls (default: "
                                                            "$WEIGHTCACHE_POLL_INTERVAL, else the configured one)")
    parser.add_argument("--liveness", metavar="URL", help="serve kopf's liveness probe, e.g. "
                                                          "http://0.0.0.0:8080/healthz (default: none)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> OperatorConfig:
    config = OperatorConfig.from_env(environ)
    overrides = {
        "agent_image": args.agent_image,
        "priority_class": args.priority_class,
        "model_root": args.model_root,
        "poll_interval": args.poll_interval,
    }
    return config.replace(**{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # None: sys.argv[1:] (the `weightcache-operator` command)
    try:
        config = config_from_args(args)
    except ValueError as e:
        return refuse(PROG, str(e), EXIT_USAGE)

    # kopf and the kubernetes client are imported only here: the rest of the
    # `weightcache` command does not need them installed.
    try:
        import kopf

        from .registry import build_registry, build_settings
        from .kube import load_client_configuration
    except ModuleNotFoundError as e:
        return refuse(PROG, f"needs the {e.name} package, which is not installed: install the "
                      "operator extra, pip install 'weightcache[operator]'", EXIT_FAILED)

    # Fail fast on missing credentials; kopf would retry the login forever.
    try:
        load_client_configuration(args.kubeconfig, args.context)
    except Exception as e:  # the client raises ConfigException, OSError, yaml errors...
        return refuse(PROG, f"cannot load Kubernetes credentials: {e}", EXIT_USAGE)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry, _ = build_registry(config, kubeconfig=args.kubeconfig, context=args.context)
    kopf.run(
        registry=registry,
        settings=build_settings(),
        standalone=True,
        clusterwide=not args.namespaces,
        namespaces=args.namespaces,
        liveness_endpoint=args.liveness,
    )
    return 0
