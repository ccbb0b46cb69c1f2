"""The demo's run forked at every seq, dispatched by a real `runlog worker`.

The demo's agent (``runlog.demo.agents``: three refunds, a durable timer, the fee) refunds on
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
from runlog.projections.lineage import fork_key, logical_of
from runlog.settings import Settings

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


def _ledger(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """The demo's ledger: how many times each key was refunded (runlog.demo.agents)."""
    raw = client.hgetall(f"{settings.redis_key_prefix}:demo:effects")
    return {k.decode(): int(v) for k, v in raw.items()}


@pytest.mark.timeout(420)
def test_the_demos_run_forked_at_every_seq_refunds_nothing_twice(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    s = fleet_settings
    fleet.spawn(concurrency=16, agents="runlog.demo.agents")
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
