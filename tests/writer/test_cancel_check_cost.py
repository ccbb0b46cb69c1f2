"""A step's cancel check rides the barrier's ownership check: one round trip to Redis per
durable append, none of its own (the cancel flag comes in the same ``MGET`` as the lease);
pipelined steps read the flag the step before sent for them. The guarantee stays: the owner sees a
cancellation by its next step or the one after."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from workers.common import read_log

import runlog
from runlog.log.clients import ThreadGet
from runlog.producers.approvals import CANCEL_FLAG_FRESH_S
from runlog.projections.run_state import fold
from runlog.settings import Settings

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


def test_pipelined_safe_calls_wait_for_no_round_trip_of_their_own(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Safe calls append with no barrier, so no ownership check brings the flag: each step
    sends the GET the next one reads (``ThreadGet.ahead``) and waits for none itself."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    waited = 0
    original = ThreadGet.__call__

    def counting(self: ThreadGet, key: str) -> Any:
        nonlocal waited
        waited += 1
        return original(self, key)

    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        run.call_tool("note", {"i": -1})
        trips = RoundTrips(monkeypatch)
        monkeypatch.setattr(ThreadGet, "__call__", counting)
        for i in range(CALLS):
            run.call_tool("note", {"i": i})
        sent = trips.count
    assert waited <= 1, waited
    assert sent <= CALLS + 2, sent


def test_a_stale_read_of_the_last_step_is_not_taken(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A read older than CANCEL_FLAG_FRESH_S serves no step: a cancellation that came before
    a slow step's check is seen by that very step."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        run.call_tool("note", {"i": -1})
        run.call_tool("note", {"i": 0})
        assert run.cancel_ahead is not None  # read before the cancellation, for the next step
        runlog.cancel(
            run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
        )
        time.sleep(2 * CANCEL_FLAG_FRESH_S)
        with pytest.raises(runlog.Cancelled):
            run.call_tool("note", {"i": 1})
