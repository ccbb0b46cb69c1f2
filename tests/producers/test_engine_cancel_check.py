"""A step's cancel check rides the barrier's ownership check: one round trip to Redis per
durable append, none of its own (the cancel flag comes in the same ``MGET`` as the lease);
pipelined steps read the flag once per ``CANCEL_FLAG_FRESH_S``. The guarantee: the owner
sees a cancellation by its first step that begins ``CANCEL_FLAG_FRESH_S`` after it, and a
durable step by its next step or the one after."""

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
from runlog.producers._handle import engine_of
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


def test_a_cancel_is_seen_by_the_next_durable_step_or_the_one_after(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """Durable steps: the barrier of the step after the request reads the flag with the
    lease, so the step after that raises at the latest, however fast they come."""
    pay = runlog.tool("pay", risk="irreversible", dedupes_by_key=True)(
        lambda args, *, idempotency_key: "ok"
    )
    with runlog.open_run(tenant="t", settings=test_settings, tools=[pay]) as run:
        run.call_tool("pay", {"i": 0})
        how = runlog.cancel(
            run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
        )
        assert how == "queued"
        steps = 0
        with pytest.raises(runlog.Cancelled):
            for i in range(1, 5):
                steps += 1
                run.call_tool("pay", {"i": i})
        assert steps <= 2, steps
    assert fold(r.event for r in read_log(test_settings, run.run_id)).outcome == "cancelled"


def test_no_step_that_begins_a_window_after_a_cancel_misses_it(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """Pipelined safe calls in a tight loop (no barrier brings the flag): the steps that
    began less than CANCEL_FLAG_FRESH_S after the request may go on; the first one that
    begins later raises, in every round."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    for round_ in range(3):
        with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
            for i in range(20):
                run.call_tool("note", {"i": -1 - i})
            runlog.cancel(
                run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
            )
            requested = time.monotonic()  # after the request: a step begun past it + window
            late: list[float] = []
            with pytest.raises(runlog.Cancelled):
                for i in range(100_000):
                    began = time.monotonic()
                    run.call_tool("note", {"i": i})
                    if began - requested > CANCEL_FLAG_FRESH_S:
                        late.append(began - requested)
            assert not late, (round_, late[:3])
        assert fold(r.event for r in read_log(test_settings, run.run_id)).outcome == "cancelled"


def test_pipelined_safe_calls_read_the_cancel_flag_once_a_window(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Safe calls append with no barrier, so no ownership check brings the flag: a step's
    own read serves the steps of the next CANCEL_FLAG_FRESH_S, and no read serves longer."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        # Enough reads first that the thread has its own connection (its first asks borrow
        # the pool's): a connection's handshake is no step's round trip. Each step here
        # comes a window after the last, so each reads.
        for i in range(OWN_AFTER + 2):
            run.call_tool("note", {"i": -1 - i})
            time.sleep(1.2 * CANCEL_FLAG_FRESH_S)
        trips = RoundTrips(monkeypatch)
        started = time.monotonic()
        steps = 0
        while time.monotonic() - started < 8 * CANCEL_FLAG_FRESH_S:
            run.call_tool("note", {"i": steps})
            steps += 1
        elapsed = time.monotonic() - started
        reads = trips.count
    windows = elapsed / CANCEL_FLAG_FRESH_S
    assert steps > 2 * reads, (steps, reads)  # many steps share a read
    # One read per window at most (and perhaps a liveness renewal); more than one in all:
    # a read serves no step after its window (test_a_stale_read_is_not_taken, and
    # test_no_step_that_begins_a_window_after_a_cancel_misses_it, check the bound itself;
    # one slow step may span a window and need no read of it).
    assert 2 <= reads <= int(windows) + 3, (reads, windows, steps)


def test_a_stale_read_is_not_taken(test_settings: Settings, redis_client: redis.Redis) -> None:
    """A read older than CANCEL_FLAG_FRESH_S serves no step: a cancellation that came before
    a slow step's check is seen by that very step."""
    note = runlog.tool("note", risk="safe")(lambda args, *, idempotency_key: "noted")
    with runlog.open_run(tenant="t", settings=test_settings, tools=[note]) as run:
        run.call_tool("note", {"i": 0})
        assert engine_of(run).cancel_flag is not None  # a read, left for the next steps
        runlog.cancel(
            run.run_id, reason="stop", by="ops", tenant="t", settings=test_settings, wait_s=0
        )
        time.sleep(2 * CANCEL_FLAG_FRESH_S)
        with pytest.raises(runlog.Cancelled):
            run.call_tool("note", {"i": 2})
