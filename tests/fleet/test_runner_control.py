"""Operator controls on runs of the fleet, on the real stack with `runlog worker` processes.

A cancel of a run that waits (asleep on a durable timer, or for a person) holds no worker,
so the cancel itself dispatches it: the agent sees ``Cancelled`` at its first step and the
run ends cancelled, with no one restarting anything and without waiting for the timer. A
``Cancelled`` the agent lets out ends the run cancelled, never failed. A terminate fences
the worker that held the run and removes the run from the fleet's lifecycle topic (a
tombstone), so no worker dispatches it again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from confluent_kafka import Consumer
from fleet_support import Fleet, effects, states, wait_finished
from scan_support import partition_records

import runlog
from runlog._settings import Settings
from runlog.fleet._worker import live_workers
from runlog.log._kafka import reader_config
from runlog.schemas._keys import partition_for


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def _held(client: redis.Redis, settings: Settings) -> int:
    return sum(int(w["runs_held"]) for w in live_workers(client, settings))


def _wait_idle(client: redis.Redis, settings: Settings, fleet: Fleet, name: str) -> None:
    deadline = time.monotonic() + 15
    while _held(client, settings):
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.2)


def _saw_cancel(client: redis.Redis, settings: Settings, rid: str) -> int:
    got = client.hget(f"{settings.redis_key_prefix}:saw_cancel", rid)
    return 0 if got is None else int(got)


def _lifecycle(settings: Settings, rid: str) -> list[tuple[int, bytes | None]]:
    """The run's lifecycle records (offset, value; None: a tombstone), in order."""
    consumer = Consumer(reader_config(settings))
    try:
        part = partition_for(rid, settings.partitions)
        msgs = partition_records(consumer, settings.lifecycle_topic, part)
    finally:
        consumer.close()
    return [(m.offset(), m.value()) for m in msgs if m.key() == rid.encode()]


@pytest.mark.parametrize("wait", ["sleep", "person"])
def test_a_cancel_wakes_a_waiting_fleet_run_which_ends_cancelled_at_its_first_step(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis, wait: str
) -> None:
    name = fleet.spawn()
    rid = runlog.start("stoppable", {"to": "c", "wait": wait}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while True:
        st = states(fleet_settings, [rid])[rid]
        if st.timers if wait == "sleep" else st.pending_approvals:
            break
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.1)
    _wait_idle(redis_client, fleet_settings, fleet, name)  # it waits holding no worker

    how = runlog.cancel(
        rid, reason="not needed", by="ops@example", tenant="t1", settings=fleet_settings
    )
    assert how == "recorded"
    started = time.monotonic()
    (st,) = wait_finished(fleet_settings, [rid], 20, fleet).values()
    assert time.monotonic() - started < 20  # not the hour of the timer
    assert st.outcome == "cancelled", st.summary
    assert _saw_cancel(redis_client, fleet_settings, rid) == 1  # the agent was told, once
    assert list(effects(redis_client, fleet_settings).values()) == [1]  # nothing after it


def test_cancelled_let_out_of_the_agent_ends_the_run_cancelled_not_failed(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    name = fleet.spawn()
    rid = runlog.start("cancel_in_flight", {"to": "f"}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while len(effects(redis_client, fleet_settings)) < 2:
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.05)
    runlog.cancel(rid, reason="enough", by="ops@example", tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 20, fleet).values()
    assert st.outcome == "cancelled"
    assert "Traceback" not in (st.summary or "")
    assert all(n == 1 for n in effects(redis_client, fleet_settings).values())


def test_a_terminated_fleet_run_fences_its_worker_and_is_never_dispatched_again(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    name = fleet.spawn()
    rid = runlog.start("cancel_in_flight", {"to": "x"}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while len(effects(redis_client, fleet_settings)) < 2:
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.05)
    done = runlog.terminate(
        rid, reason="runaway", by="ops@example", tenant="t1", settings=fleet_settings
    )
    assert done.agent == "cancel_in_flight"
    # The run's record in the fleet's table is gone at once: a tombstone, its last record.
    records = _lifecycle(fleet_settings, rid)
    assert records[-1][1] is None, records
    # The fenced worker stops the run (an infrastructure stop: it is not recorded as the
    # agent's failure), stays up, and never dispatches the run again: it writes nothing
    # more for it, and nothing more lands in the run's log, past its lease's TTL and more.
    (st,) = states(fleet_settings, [rid]).values()
    assert st.outcome == "terminated"
    time.sleep(fleet_settings.lease_ttl_ms / 1000 * 2 + 1)
    assert _lifecycle(fleet_settings, rid) == records
    after = states(fleet_settings, [rid])[rid]
    assert (after.seq, after.outcome) == (st.seq, "terminated")
    assert fleet.procs[name].poll() is None, fleet.tail(name)
    _wait_idle(redis_client, fleet_settings, fleet, name)
    assert all(n == 1 for n in effects(redis_client, fleet_settings).values())


def test_a_fork_of_a_fleet_run_is_dispatched_like_a_started_run(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """The fork runs the parent's registered agent: the fleet executes it from the fork
    point with no one opening it, and the parent's effects are inherited, not repeated."""
    name = fleet.spawn()
    rid = runlog.start("payer", {"to": "k", "steps": 2}, tenant="t1", settings=fleet_settings)
    (parent,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert parent.outcome == "succeeded"
    made = runlog.fork(
        rid, at_seq=1, tenant="t1", forked_by="ops@example", reason="again", settings=fleet_settings
    )
    assert made.agent == "payer"
    (st,) = wait_finished(fleet_settings, [made.run_id], 30, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "paid 2 times"), fleet.tail(name)
    assert st.agent_name == "payer" and st.agent_input == parent.agent_input
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]  # inherited
    # Finished: its lifecycle record is a tombstone, as a started run's is.
    assert _lifecycle(fleet_settings, made.run_id)[-1][1] is None


def test_a_sync_agent_that_only_appends_sees_a_cancel_at_its_next_append(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """``Run.append`` is a step, as ``AsyncRun.append`` is: an agent that appends and makes
    no model turn or tool call is told ``Cancelled`` there, and the run ends cancelled."""
    name = fleet.spawn()
    rid = runlog.start("noter", {"notes": 600}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while states(fleet_settings, [rid])[rid].seq < 4:
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.1)
    runlog.cancel(
        rid, reason="enough notes", by="ops@example", tenant="t1", settings=fleet_settings
    )
    (st,) = wait_finished(fleet_settings, [rid], 15, fleet).values()  # not the notes' 30 s
    assert st.outcome == "cancelled", st.summary
    assert _saw_cancel(redis_client, fleet_settings, rid) == 1


def test_an_agent_failing_after_a_cancel_ends_cancelled_not_retried(
    fleet_settings: Settings, fleet: Fleet
) -> None:
    """The agent raises (its policy would retry it) after a person cancelled the run, before
    any step of its own saw the cancel: the retry's record is the step that sees it, and
    the run ends cancelled there, neither retried nor left to a crashed dispatch."""
    name = fleet.spawn()
    rid = runlog.start("stumbler", {"wait_s": 1.5}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while states(fleet_settings, [rid])[rid].seq < 2:  # started, then "began"
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.05)
    runlog.cancel(rid, reason="not now", by="ops@example", tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert st.outcome == "cancelled", st.summary
    assert not any(t.purpose == "retry" for t in st.timers), st.timers
    assert "crashed" not in fleet.tail(name)


def test_a_cancel_of_an_orphaned_fleet_run_ends_it_cancelled_once_a_worker_takes_it(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """The run's worker is SIGKILLed mid-run and no worker is alive when the cancel comes:
    the request stands, and the next worker to own the run's partition resumes it, settles
    its open call by the recovery rules, tells the agent, and the run ends cancelled, each
    effect once."""
    name = fleet.spawn()
    rid = runlog.start("cancel_in_flight", {"to": "o"}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while len(effects(redis_client, fleet_settings)) < 3:
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.05)
    fleet.kill(name)
    assert fleet.alive() == []
    how = runlog.cancel(
        rid, reason="owner died", by="ops@example", tenant="t1", settings=fleet_settings
    )
    assert how in ("recorded", "queued"), how
    heir = fleet.spawn()
    (st,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert st.outcome == "cancelled", (st.summary, fleet.tail(heir))
    assert st.cancel is not None and st.cancel.requested_by == "ops@example"
    assert all(n == 1 for n in effects(redis_client, fleet_settings).values())
