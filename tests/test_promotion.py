"""Hot standby with real processes: the agent promotes the oldest standby of the dead primary's group.

One agent serves every test; each test uses its own group names, so what one test kills
cannot promote an engine of another.
"""
from __future__ import annotations

import os
import time

import pytest

from engine_fixtures import PROMPT, llama_checkpoint, module_supervisor, readyz, wait_until  # noqa: F401
from weightcache_agent import CacheSpec, WeightCacheError
from weightcache_agent.engine.server import load_model


@pytest.fixture(scope="module")
def cluster(module_supervisor, llama_checkpoint):  # noqa: F811
    """The agent and every engine, started in two waves so that attach order is known.

    Wave 1 attaches first (the oldest standby of g1, a standby of another group, g3's
    primary); wave 2 starts once wave 1 is serving. Groups are disjoint, so the tests
    cannot disturb each other while all engines start in parallel.
    """
    sup, ck = module_supervisor, llama_checkpoint
    agent = sup.start_agent(ck, backend="cpu")
    sock = agent.socket
    first = {
        "s1": sup.start_engine(ck, "s1", socket=sock, group="g1", role="standby"),
        "other": sup.start_engine(ck, "other", socket=sock, group="g2-b", role="standby"),
        "p3": sup.start_engine(ck, "p3", socket=sock, group="g3"),
    }
    agent.wait_ready()
    for engine in first.values():
        engine.wait_serving()
    second = {
        "p1": sup.start_engine(ck, "p1", socket=sock, group="g1"),
        "s2": sup.start_engine(ck, "s2", socket=sock, group="g1", role="standby"),
        "p2": sup.start_engine(ck, "p2", socket=sock, group="g2-a"),
        "same": sup.start_engine(ck, "same", socket=sock, group="g2-a", role="standby"),
        "p3b": sup.start_engine(ck, "p3b", socket=sock, group="g3"),
    }
    return agent, {**first, **second}


@pytest.fixture(scope="module")
def agent(cluster):
    return cluster[0]


def roles(agent) -> dict[int, tuple[str, str]]:
    return {c["pid"]: (c["role"], c["group"]) for c in agent.status()["clients"]}


def test_standby_is_promoted_when_the_primary_dies(cluster, agent, llama_checkpoint, time_bar):  # noqa: F811
    engines = cluster[1]
    older, primary, younger = engines["s1"], engines["p1"], engines["s2"]  # s1 attached first: the oldest standby
    primary.wait_state(lambda h: h["ready"], what="readiness")
    younger.wait_serving()

    # Before: only the primary takes traffic; standbys are attached and warm but refuse.
    assert readyz(primary) == 200 and readyz(older) == 503 and readyz(younger) == 503
    status, refused = older.generate(PROMPT, 4)
    assert status == 503 and "standby" in refused["error"]
    _, expected = primary.generate(PROMPT, 8)
    assert roles(agent)[older.pid] == ("standby", "g1")

    primary.kill()
    killed = time.monotonic()
    while True:
        status, reply = older.generate(PROMPT, 8)
        if status == 200:
            break
        assert time.monotonic() - killed < 5, "standby never took over"
    failover = time.monotonic() - killed
    time_bar("kill of the primary -> the standby answers", failover, 1.0)
    assert reply["tokens"] == expected["tokens"]  # same weights, same answer
    assert readyz(older) == 200
    assert "PROMOTED" in older.log()

    # Only the oldest standby was promoted; the younger one still stands by.
    time.sleep(0.2)
    assert readyz(younger) == 503
    current = roles(agent)
    assert current[older.pid] == ("primary", "g1") and current[younger.pid] == ("standby", "g1")
    assert primary.pid not in current

    # A new standby can join afterwards, and status shows it with its role.
    _, lease = load_model(CacheSpec(model=llama_checkpoint), mode="client", socket=agent.socket,
                              role="standby", group="g1")
    try:
        assert lease.role == "standby"
        assert roles(agent)[os.getpid()] == ("standby", "g1")
    finally:
        lease.close()

    # Kill the new primary too: the remaining standby takes over in turn.
    older.kill()
    wait_until(lambda: readyz(younger) == 200, timeout=2.0)
    assert younger.generate(PROMPT, 8)[1]["tokens"] == expected["tokens"]


def test_standby_of_another_group_is_not_promoted(cluster, agent, llama_checkpoint):  # noqa: F811
    engines = cluster[1]
    other = engines["other"]  # older than `same`, but of another group
    primary, same = engines["p2"], engines["same"]
    primary.wait_state(lambda h: h["ready"], what="readiness")
    same.wait_serving()

    primary.kill()
    wait_until(lambda: readyz(same) == 200, timeout=2.0)  # promotion did happen, in the right group
    time.sleep(0.2)
    assert readyz(other) == 503
    assert other.generate(PROMPT, 2)[0] == 503
    assert "PROMOTED" not in other.log()
    current = roles(agent)
    assert current[other.pid] == ("standby", "g2-b") and current[same.pid] == ("primary", "g2-a")


def test_a_second_primary_is_refused(cluster, agent, llama_checkpoint):  # noqa: F811
    primary, second = cluster[1]["p3"], cluster[1]["p3b"]  # p3b started after p3 was serving
    assert readyz(primary) == 200
    assert second.proc.wait(60) == 1
    assert "already has a primary" in second.log()

    # In-process through the public client too: a WeightCacheError, and nothing is left attached.
    with pytest.raises(WeightCacheError, match="already has a primary"):
        load_model(CacheSpec(model=llama_checkpoint), mode="client", socket=agent.socket, role="primary", group="g3")
    group = [pid for pid, (_, g) in roles(agent).items() if g == "g3"]
    assert group == [primary.pid]
    assert readyz(primary) == 200
