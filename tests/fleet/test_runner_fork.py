"""The demo's run forked at every seq, dispatched by a real `runlog worker`.

The demo's agent (``tools.demo.agents``: three refunds, a durable timer, the fee) refunds on
a ledger that deduplicates nothing: each request adds one to its key's count. Its run is
executed to the end once, then forked after each of its events; the forks are dispatched
like started runs (``runlog.fork`` wakes them) and executed concurrently by one worker.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, states, verify_all, wait_finished

import runlog
from runlog._settings import Settings
from runlog.projections._lineage import fork_key, logical_of
from runlog.schemas._vocabulary import EventType

AGENT = "demo.refunds"
TENANT = "demo"
ORDER = {"order": "o-fork", "lines": [5, 7, 9], "fee": 2}


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def _events(settings: Settings, rid: str) -> list[runlog.Event]:
    from runlog.log._reader import LogReader

    with LogReader(settings) as reader:
        return [r.event for r in reader.read(rid, partition=reader.partition_of(rid), start=0)]


def _ledger(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """The demo's ledger: how many times each key was refunded (tools.demo.agents)."""
    raw = client.hgetall(f"{settings.redis_key_prefix}:demo:effects")
    return {k.decode(): int(v) for k, v in raw.items()}


@pytest.mark.timeout(420)
def test_the_demos_run_forked_at_every_seq_refunds_nothing_twice(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    s = fleet_settings
    fleet.spawn(concurrency=16, agents="tools.demo.agents")
    parent = runlog.start(AGENT, ORDER, tenant=TENANT, settings=s)
    (done,) = wait_finished(s, [parent], 90, fleet).values()
    assert done.outcome == "succeeded"
    once = _ledger(redis_client, s)
    assert len(once) == 4 and set(once.values()) == {1}, once  # three lines and the fee

    # inherit, at every seq (the finish included): nothing reaches the ledger again.
    forks = [
        runlog.fork(parent, tenant=TENANT, at_seq=n, reason=f"at {n}", settings=s)
        for n in range(1, done.seq + 1)
    ]
    assert all(f.agent == AGENT and f.created for f in forks)
    got = wait_finished(s, [f.run_id for f in forks], 240, fleet)
    for f in forks:
        st = got[f.run_id]
        assert (st.outcome, st.summary) == (done.outcome, done.summary), (f.at_seq, st)
        # The fork holds a result for each refund, all of them the parent's own keys.
        assert set(st.completed_calls) == set(once), f.at_seq
    assert _ledger(redis_client, s) == once

    # execute, from the start: each refund once more, under a key bound to the fork.
    repeat = runlog.fork(parent, tenant=TENANT, at_seq=1, effects="execute", settings=s)
    (rst,) = wait_finished(s, [repeat.run_id], 90, fleet).values()
    assert rst.outcome == "succeeded"
    assert _ledger(redis_client, s) == {
        **once,
        **{fork_key(logical_of(k), repeat.run_id): 1 for k in once},
    }

    # ask: the fork stops for a person at its first repeated refund; nothing runs meanwhile.
    asked = runlog.fork(parent, tenant=TENANT, at_seq=1, effects="ask", settings=s)
    deadline = time.monotonic() + 60
    while not states(s, [asked.run_id])[asked.run_id].pending_approvals:
        assert time.monotonic() < deadline, fleet.tail("w1")
        time.sleep(0.3)
    time.sleep(1)
    assert states(s, [asked.run_id])[asked.run_id].status != "finished"
    assert len(_ledger(redis_client, s)) == 8  # the execute fork's four, nothing of this one

    verified = verify_all(s)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]


def test_a_registered_agent_forked_with_another_input_is_handed_the_parents_conversation(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """A registered agent's fork, at every seq, runs with the fork's input (or, given none,
    the parent's) on a run that holds exactly the parent's conversation up to the fork
    point, the parent's compaction included once the fork point is past it."""
    import json

    from runlog._bootstrap import Services
    from runlog.log._replay import replay

    s = fleet_settings
    fleet.spawn(agents="workers.fleet_agents")
    parent = runlog.start("chatter", {"ask": "hello"}, tenant="t1", settings=s)
    (done,) = wait_finished(s, [parent], 60, fleet).values()
    assert done.compactions == 1
    forks = {
        n: runlog.fork(
            parent,
            tenant="t1",
            at_seq=n,
            input=json.dumps({"ask": f"what if {n}"}) if n % 2 else None,
            settings=s,
        )
        for n in range(1, done.seq + 1)
    }
    got = wait_finished(s, [f.run_id for f in forks.values()], 120, fleet)
    client = Services.shared(s).redis
    compacted_at = next(e.seq for e in _events(s, parent) if e.type is EventType.CONTEXT_COMPACTED)
    for n, f in forks.items():
        assert got[f.run_id].outcome == "succeeded", n
        seen = json.loads(redis_client.hget(f"{s.redis_key_prefix}:seen", f.run_id))
        at_n = replay(s, client, parent, tenant="t1", to_seq=n).state
        assert seen["messages"] == [[m.role, m.content] for m in at_n.messages], n
        assert seen["input"] == ({"ask": f"what if {n}"} if n % 2 else {"ask": "hello"}), n
        assert (["user", "answered once"] in seen["messages"]) is (n >= compacted_at), n
