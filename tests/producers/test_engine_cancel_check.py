"""A step's cancel check rides the barrier's ownership check: one round trip to Redis per
durable append, none of its own (the cancel flag comes in the same ``MGET`` as the lease);
pipelined steps read the flag every other step. The guarantee stays: the owner sees a
cancellation by its next step or the one after."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from workers.common import read_log

import runlog
from runlog._settings import Settings
from runlog.log._clients import OWN_AFTER
from runlog.producers._engine import CANCEL_FLAG_FRESH_S
from runlog.projections._run_state import fold

CALLS = 40


class RoundTrips:
    """Counts the commands this process sends to Redis (a spy on redis-py's connection:
    every command still goes to the real server). The server's own statistics would count
    every other client of the stack too."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)


def test_an_irreversible_call_costs_no_round_trip_for_the_cancel_check(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    pay = runlog.tool("pay", risk="irreversible", dedupes_by_key=True)(
        lambda args, *, idempotency_key: "ok"
    )
    with runlog.open_run(tenant="t", settings=test_settings, tools=[pay]) as run:
        run.call_tool("pay", {"i": -1})
        trips = RoundTrips(monkeypatch)
        for i in range(CALLS):
            run.call_tool("pay", {"i": i})
        reads = trips.count
    # Two barriers per call (STARTED before the tool, COMPLETED after), one read each (and
    # perhaps a lease renewal); the cancel check before each call asked once more.
    assert reads <= 2 * CALLS + 4, reads


def test_a_cancel_is_seen_by_the_next_step_or_the_one_after(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    pay = runlog.tool("pay", risk="irreversible", dedupes_by_key=True)(
        lambda args, *, idempotency_key: "ok"
    )
    safe = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    for tool in ("pay", "note"):  # durable steps, and pipelined ones with no barrier
        with runlog.open_run(tenant="t", settings=test_settings, tools=[pay, safe]) as run:
            run.call_tool(tool, {"i": 0})
            how = runlog.cancel(
                run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
            )
            assert how == "queued"
            steps = 0
            with pytest.raises(runlog.Cancelled):
                for i in range(1, 5):
                    steps += 1
                    run.call_tool(tool, {"i": i})
            assert steps <= 2, (tool, steps)
        assert fold(r.event for r in read_log(test_settings, run.run_id)).outcome == "cancelled"


def test_pipelined_safe_calls_read_the_cancel_flag_every_other_step(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Safe calls append with no barrier, so no ownership check brings the flag: a step's
    own read serves it and the step after (once), never a third."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        # Enough steps first that the thread has its own connection (its first asks borrow
        # the pool's): a connection's handshake is no step's round trip.
        for i in range(2 * OWN_AFTER + 2):
            run.call_tool("note", {"i": -1 - i})
        trips = RoundTrips(monkeypatch)
        for i in range(CALLS):
            run.call_tool("note", {"i": i})
        reads = trips.count
    assert CALLS // 2 <= reads <= CALLS // 2 + 2, reads


def test_a_stale_read_of_the_last_step_is_not_taken(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A read older than CANCEL_FLAG_FRESH_S serves no step: a cancellation that came before
    a slow step's check is seen by that very step."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        run.call_tool("note", {"i": 0})
        if run.cancel_flag is None:  # that call took an earlier read: the next reads its own
            run.call_tool("note", {"i": 1})
        assert run.cancel_flag is not None  # the last call's own read, left for the next
        runlog.cancel(
            run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
        )
        time.sleep(2 * CANCEL_FLAG_FRESH_S)
        with pytest.raises(runlog.Cancelled):
            run.call_tool("note", {"i": 2})
