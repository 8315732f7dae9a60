"""Failover latency through a real EndpointSlice controller: one API write vs two.

What it measures: a Service selects `weightcache.io/engineset=chat,
weightcache.io/serving=true`; a primary (serving "true") and a standby (serving "false")
pod are Running and Ready (played by the fake kubelet on node-1). The agent's writer,
with a token bound to an agent pod on node-1 and through the chart's admission policy,
marks the standby serving. A trial is the time from the start of that write until the
Service's EndpointSlice (watched, timestamps taken as events arrive) lists the standby as
a ready endpoint.

Side by side, in the same run, the two-write path: label the new primary AND unlabel the
old one (what a design that allows only one labelled pod would need; the unlabel is the
operator's write, as the agents may only promote), timed until the
EndpointSlice lists the new primary alone. Trials alternate: one-write trial (then the
operator's unlabel of the old primary, untimed), two-write trial, with the pods' roles
swapping each time.

    python bench/failover_k8s.py --trials 50

starts a control plane with `../shared/k8s` (or reuses the one in WEIGHTCACHE_K8S_LAB),
installs the chart (needs helm-sdkpy), prints the table and stops what it started.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "tests", REPO / "node_agent"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fake_kubelet import FakeKubelet
from k8s_lab import ApiClient, Lab, agent_identity, ns_path, pods_path
from weightcache_agent.serve.serving_label import SERVING_LABEL, ServingLabelWriter

ENGINESET = "chat"
CACHE = "llama"  # the cache whose agent (a pod of its DaemonSet, `<cache>-agent-...`) promotes them
PODS = ("chat-0-0", "chat-0-1")
BAR_P99_S = 0.200
GOAL_P99_S = 0.100


class SliceWatch:
    """Ready endpoints (target pod names) of one Service, with the time each change arrived."""

    def __init__(self, lab: Lab, namespace: str, service: str) -> None:
        self.api = lab.api
        self.namespace, self.service = namespace, service
        self.slices: dict[str, frozenset[str]] = {}
        self.history: list[tuple[float, frozenset[str]]] = []
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="slice-watch", daemon=True)

    def start(self) -> SliceWatch:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        now = time.perf_counter()
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = frozenset(
                e["targetRef"]["name"] for e in obj.get("endpoints") or []
                if e.get("targetRef") and e.get("conditions", {}).get("ready", True))
        with self.cond:
            self.history.append((now, frozenset().union(*self.slices.values())))
            self.cond.notify_all()

    def _run(self) -> None:
        path = ns_path(self.namespace, "endpointslices", group="discovery.k8s.io")
        params = {"labelSelector": f"kubernetes.io/service-name={self.service}"}
        while not self.stop.is_set():
            listing = self.api.get(path, **params)
            self.slices.clear()
            for obj in listing["items"]:
                self._apply("ADDED", obj)
            rv = listing["metadata"]["resourceVersion"]
            for kind, obj in self.api.watch(path, stop=self.stop, params={**params, "resourceVersion": rv}):
                if kind == "ERROR":
                    break
                if kind != "BOOKMARK":
                    self._apply(kind, obj)

    def wait_until(self, pred: Callable[[frozenset[str]], bool], since: float, timeout: float = 10.0) -> float:
        """perf_counter time of the first change at or after `since` whose endpoints satisfy pred."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for t, eps in self.history[seen:]:
                    if t >= since and pred(eps):
                        return t
                seen = len(self.history)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"EndpointSlice never satisfied the condition (now {self.current()})")
                self.cond.wait(left)

    def current(self) -> frozenset[str]:
        return self.history[-1][1] if self.history else frozenset()


@dataclass
class Results:
    one: list[float] = field(default_factory=list)   # seconds, write start -> standby listed
    two: list[float] = field(default_factory=list)   # seconds, first write start -> only the new primary listed
    write: list[float] = field(default_factory=list)  # seconds the one write itself took (round trip)


def pod(name: str, serving: bool) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {
                "app.kubernetes.io/managed-by": "weightcache-operator", "weightcache.io/engineset": ENGINESET,
                "weightcache.io/group": "0", "weightcache.io/cache": CACHE,
                SERVING_LABEL: "true" if serving else "false"}},
            "spec": {"nodeName": "node-1", "containers": [{
                "name": "engine", "image": "engine:1", "ports": [{"name": "http", "containerPort": 8000}]}]}}


def measure(lab: Lab, trials: int = 50, *, warmup: int = 5, namespace: str | None = None,
            progress: bool = False) -> Results:
    """Run `trials` one-write and `trials` two-write failovers in a fresh namespace, after
    `warmup` rounds of both that are not counted (first requests on fresh connections and
    objects)."""
    ns = namespace or lab.namespace("failover")
    api = lab.api
    api.create(ns_path(ns, "services"), {
        "metadata": {"name": ENGINESET},
        "spec": {"selector": {"weightcache.io/engineset": ENGINESET, SERVING_LABEL: "true"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}})
    uids = {name: api.create(pods_path(ns), pod(name, serving=(name == PODS[0])))["metadata"]["uid"]
            for name in PODS}
    agent = agent_identity(lab, ns, "node-1", name=f"{CACHE}-agent-x7k2p")
    writer = ServingLabelWriter(lab.server, token_path=agent.token_path, ca_path=lab.ca_path, timeout=5)
    results = Results()
    with FakeKubelet(lab, ["node-1"], namespace=ns, label_selector=f"weightcache.io/engineset={ENGINESET}"), \
            _closing(SliceWatch(lab, ns, ENGINESET).start()) as watch:
        primary, standby = PODS
        watch.wait_until(lambda eps: eps == {primary}, since=0, timeout=30)
        writer.connect()

        def unlabel(client: ApiClient, name: str) -> None:
            client.call("PATCH", pods_path(ns, name), {"metadata": {"labels": {SERVING_LABEL: "false"}}},
                        content_type="application/merge-patch+json")

        for i in range(-warmup, trials):
            if i == 0:
                results = Results()
            # one write: the agent labels the standby; the endpoint appears
            t0 = time.perf_counter()
            results.write.append(writer.mark_serving(ns, standby, uids[standby]))
            results.one.append(watch.wait_until(lambda eps, s=standby: s in eps, since=t0) - t0)
            # the operator's reconcile later unlabels the old primary (untimed)
            t1 = time.perf_counter()
            unlabel(api, primary)
            watch.wait_until(lambda eps, s=standby: eps == {s}, since=t1)
            primary, standby = standby, primary
            # two writes: label the new primary, unlabel the old (a write only the operator may
            # make: the agents' policy admits promotions alone); until only the new one is listed
            t0 = time.perf_counter()
            writer.mark_serving(ns, standby, uids[standby])
            unlabel(api, primary)
            results.two.append(watch.wait_until(lambda eps, s=standby: eps == {s}, since=t0) - t0)
            primary, standby = standby, primary
            if progress and i >= 0 and (i + 1) % 10 == 0:
                print(f"  {i + 1}/{trials} trials", file=sys.stderr)
    writer.close()
    lab.delete_namespace(ns)
    return results


class _closing:
    def __init__(self, watch: SliceWatch) -> None:
        self.watch = watch

    def __enter__(self) -> SliceWatch:
        return self.watch

    def __exit__(self, *exc: object) -> None:
        self.watch.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def verdict(what: str, p99: float) -> str:
    """One line: a p99 against the failover bar and goal."""
    word = "goal met" if p99 <= GOAL_P99_S else "bar met" if p99 <= BAR_P99_S else "BAR MISSED"
    return f"{what} p99 {p99 * 1000:.1f} ms: {word} (bar {BAR_P99_S * 1000:.0f} ms, goal {GOAL_P99_S * 1000:.0f} ms)"


def table(r: Results) -> str:
    def ms(x: float) -> str:
        return f"{x * 1000:7.1f}"
    rows = [("one write (label standby)", r.one), ("two writes (label new + unlabel old)", r.two)]
    lines = [f"{'failover path':<38} {'trials':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'mean ms':>7}"]
    for name, v in rows:
        lines.append(f"{name:<38} {len(v):>6} {ms(statistics.median(v))} {ms(percentile(v, 99))} "
                     f"{ms(max(v))} {ms(statistics.fmean(v))}")
    lines.append(f"{'ratio two/one':<38} {'':>6} {statistics.median(r.two) / statistics.median(r.one):7.2f} "
                 f"{percentile(r.two, 99) / percentile(r.one, 99):7.2f}")
    lines.append(f"{'the one write itself (round trip)':<38} {len(r.write):>6} {ms(statistics.median(r.write))} "
                 f"{ms(percentile(r.write, 99))} {ms(max(r.write))} {ms(statistics.fmean(r.write))}")
    slowest = max(range(len(r.one)), key=r.one.__getitem__)
    lines.append(f"slowest one-write trial: #{slowest + 1}, {r.one[slowest] * 1000:.1f} ms, of which the write "
                 f"{r.write[slowest] * 1000:.1f} ms")
    lines.append(verdict("one-write", percentile(r.one, 99)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="rounds run first and not counted")
    args = ap.parse_args(argv)
    from k8s_lab import install_or_upgrade_chart, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"no Kubernetes control plane: {reason}", file=sys.stderr)
        return 2
    t = time.monotonic()
    lab = Lab.start(("node-1",))
    try:
        print(f"control plane up in {time.monotonic() - t:.0f}s ({lab.server})", file=sys.stderr)
        install_or_upgrade_chart(lab)
        results = measure(lab, args.trials, warmup=args.warmup, progress=True)
        print(table(results))
    finally:
        lab.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
