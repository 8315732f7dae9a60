"""The chart's optional monitoring: a PodMonitor, a PrometheusRule and a Grafana dashboard.

Off by default; each query and alert expression is parsed as PromQL (promql-parser) and may
name only metrics the code defines (tests/metrics_catalog.py), plus Prometheus's own `up`;
the chart lints (Helm renders every template) with all three on. The real install of them,
read back from an API server, is in tests/test_k8s_install_uninstall.py.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from metrics_catalog import defined_metrics
from operator_fixtures import CHART
from test_chart import SCHEMA, VALUES, chart_copy, lint, problems

ALERTS = yaml.safe_load((CHART / "monitoring" / "alerts.yaml").read_text())
DASHBOARD = json.loads((CHART / "monitoring" / "dashboard.json").read_text())
PROMETHEUS_OWN = {"up"}  # a series Prometheus makes per scrape target, not an exporter


def promql() -> Any:
    try:
        import promql_parser
    except ImportError as e:
        if os.environ.get("CI"):
            raise  # the test extra installs it
        pytest.skip(f"promql-parser not available: {e}")
    return promql_parser


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (raises ValueError where it does not parse)."""
    parser = promql()
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, parser.VectorSelector):
            if not node.name:
                raise ValueError(f"{expr}: a selector without a metric name")
            names.add(node.name)
        return True

    parser.walk(parser.parse(expr), visit)
    return names


def undefined(exprs: list[str]) -> dict[str, set[str]]:
    known = {series for metric in defined_metrics().values() for series in metric.series} | PROMETHEUS_OWN
    return {e: metric_names(e) - known for e in exprs if metric_names(e) - known}


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in ALERTS["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    exprs = [t["expr"] for panel in DASHBOARD["panels"] for t in panel.get("targets", [])]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":  # label_values(METRIC, LABEL): Grafana's, not PromQL
            metric, _ = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"]).groups()
            exprs.append(metric)
    return exprs


def test_monitoring_is_off_by_default_and_the_schema_checks_its_values():
    assert {k: v["enabled"] for k, v in VALUES["monitoring"].items()} == \
        {"podMonitor": False, "prometheusRule": False, "dashboard": False}
    for bad in ({"podMonitor": {"enabled": "yes"}}, {"podMonitor": {"enabled": True, "interval": "30"}},
                {"dashboard": {"enabled": True, "namespace": "Not_A_Namespace"}}, {"grafana": {"enabled": True}}):
        values = {**VALUES, "monitoring": {**VALUES["monitoring"], **bad}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(values, SCHEMA)


def test_alerts_name_only_metrics_the_code_defines():
    rules = alert_rules()
    assert len(rules) >= 5 and all(rule["labels"]["severity"] in ("warning", "critical") for rule in rules)
    assert undefined([rule["expr"] for rule in rules]) == {}
    # each alert watches what its name says
    watched = {rule["alert"]: metric_names(rule["expr"]) for rule in rules}
    exprs = {rule["alert"]: rule["expr"] for rule in rules}
    assert watched["WeightcacheAgentDown"] == {"up"} and 'job="weightcache-agent"' in exprs["WeightcacheAgentDown"]
    assert watched["WeightcacheRankNotReady"] == {"weightcache_rank_ready"}
    assert watched["WeightcacheLoadFailing"] == {"weightcache_worker_restarts_total"}
    assert watched["WeightcacheFallbackToDisk"] == {"weightcache_attach_misses_total", "weightcache_vllm_loads_total"}


def test_dashboard_queries_name_only_metrics_the_code_defines_and_cover_the_agent():
    assert DASHBOARD["uid"] == "weightcache" and DASHBOARD["panels"]
    exprs = dashboard_queries()
    assert undefined(exprs) == {}
    shown = set().union(*(metric_names(e) for e in exprs))
    agent = {m.exposed for m in defined_metrics().values() if "/serve/" in m.source}
    missing = {name for name in agent if not any(s.startswith(name) for s in shown)}
    assert missing == set()  # every agent metric has a panel


def test_the_check_has_teeth():
    assert undefined(["sum(rate(weightcache_attach_misses[5m]))"])  # the counter without _total
    assert undefined(['weightcache_rank_ready{namespace="a"} and on(pod) kube_pod_info'])
    with pytest.raises(ValueError):
        metric_names("sum(rate(weightcache_clients[5m])")  # unbalanced


def test_docs_list_the_alerts_the_chart_installs():
    text = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in text.split("\n| alert | fires when | severity |\n", 1)[1].splitlines()[1:]
            if line.startswith("| `")]
    assert [(r[0].strip("`"), r[2]) for r in rows] == [(rule["alert"], rule["labels"]["severity"])
                                                       for rule in alert_rules()]


def test_helm_lint_passes_with_monitoring_on(tmp_path: Path) -> None:
    on = {"enabled": True}
    chart = chart_copy(tmp_path, monitoring__podMonitor={**on, "interval": "15s", "labels": {"release": "prometheus"}},
                       monitoring__prometheusRule={**on, "labels": {"release": "prometheus"}},
                       monitoring__dashboard={**on, "namespace": "grafana", "labels": {"grafana_dashboard": "1"}},
                       watchNamespaces=["ml"])
    result = lint(chart, tmp_path)
    assert problems(result) == [] and not result.get("Errors")
    # and the lint renders them: a broken monitoring template fails it
    with open(chart / "templates" / "monitoring.yaml", "a") as f:
        f.write("{{ .Values.monitoring.dashboard.missing.deeper }}\n")
    assert problems(lint(chart, tmp_path))
