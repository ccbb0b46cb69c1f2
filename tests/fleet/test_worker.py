"""The worker fleet on the real stack: `runlog worker` processes, SIGKILLed at random.

Runs are started with `runlog.start` (a durable request); workers dispatched by Kafka's
consumer group execute them, resume the orphans of the dead, wake sleeping runs and the
runs a person decided. Effects land on a non-idempotent receiver (tests/workers/
fleet_agents.py) that counts each key: every count must be 1.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fleet_support import Fleet, effects, states, verify_all, wait_finished

import runlog
from runlog._settings import Settings
from runlog.schemas._keys import partition_for


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def test_a_started_run_is_executed_and_finishes_with_the_summary(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.spawn()
    rid = runlog.start("payer", {"to": "acme", "steps": 3}, tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "paid 3 times")
    assert st.agent_name == "payer" and st.agent_version and st.agent_input
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1, 1]


def _events(settings: Settings, rid: str) -> list[runlog.Event]:
    from runlog.log._reader import LogReader

    with LogReader(settings) as reader:
        part = reader.partition_of(rid)
        return [r.event for r in reader.read(rid, partition=part, start=0)]


def test_starting_a_run_id_twice_is_one_run(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    order = {"to": "twice", "steps": 2}
    rid = runlog.start("payer", order, tenant="t1", run_id="order-twice-1", settings=fleet_settings)
    again = runlog.start("payer", order, tenant="t1", run_id=rid, settings=fleet_settings)
    assert again == rid
    fleet.spawn()
    wait_finished(fleet_settings, [rid], 60, fleet)
    # A third request after it finished: found finished, nothing runs again.
    runlog.start("payer", order, tenant="t1", run_id=rid, settings=fleet_settings)
    time.sleep(2)
    evs = _events(fleet_settings, rid)
    assert [e.type for e in evs].count(runlog.EventType.RUN_STARTED) == 1
    assert [e.type for e in evs].count(runlog.EventType.RUN_FINISHED) == 1
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_a_sleeping_run_whose_worker_dies_wakes_on_another(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    first = fleet.spawn()
    rid = runlog.start("sleeper", {"to": "s", "sleep_s": 4}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while not states(fleet_settings, [rid])[rid].timers:
        assert time.monotonic() < deadline, fleet.tail(first)
        time.sleep(0.1)
    fleet.kill(first)  # asleep: it holds no lease; the timer is in the log and the topic
    second = fleet.spawn()
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "woke and paid")
    evs = _events(fleet_settings, rid)
    timer = next(e for e in evs if e.type is runlog.EventType.TIMER_STARTED)
    after = [e for e in evs if e.seq > timer.seq]
    assert after and all(e.writer_id.startswith(f"{second}-") for e in after), after
    finished = next(e for e in evs if e.type is runlog.EventType.RUN_FINISHED)
    assert finished.occurred_at >= timer.payload.due_at  # type: ignore[attr-defined]
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_a_decision_resumes_its_run_with_no_one_restarting_anything(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    from runlog.fleet._worker import live_workers

    name = fleet.spawn()
    rid = runlog.start("asker", {"to": "p"}, tenant="t1", settings=fleet_settings)
    deadline = time.monotonic() + 30
    while not states(fleet_settings, [rid])[rid].pending_approvals:
        assert time.monotonic() < deadline, fleet.tail(name)
        time.sleep(0.1)
    # Waiting for a person holds no slot (and no lease).
    deadline = time.monotonic() + 10
    while True:
        (w,) = live_workers(redis_client, fleet_settings)
        if w["runs_held"] == "0":
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.2)
    (aid,) = states(fleet_settings, [rid])[rid].pending_approvals
    how = runlog.decide(
        rid, aid, approved=True, decided_by="ops@example", tenant="t1", settings=fleet_settings
    )
    # Recorded at once when the run is free; queued when a worker holds it at that instant
    # (its owner records it). Either way no one restarts anything: the run must finish.
    assert how in ("recorded", "queued")
    (st,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "approved and paid")
    assert list(effects(redis_client, fleet_settings).values()) == [1]


def test_an_agent_failure_is_recorded_with_its_traceback_after_its_retries(
    fleet_settings: Settings, fleet: Fleet
) -> None:
    fleet.spawn()
    rid = runlog.start("failing", {"n": 1}, tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert st.outcome == "failed"
    assert "ValueError: cannot handle {'n': 1}" in st.summary and "Traceback" in st.summary
    assert [t.purpose for t in st.timers] == ["retry"]  # retries=1: one durable retry


def test_an_async_agent_runs_in_the_workers_event_loop(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.spawn()
    rids = [
        runlog.start(
            "apayer",
            {"to": f"a{i}", "steps": 2, "sleep_s": 1},
            tenant="t1",
            settings=fleet_settings,
        )
        for i in range(5)
    ]
    got = wait_finished(fleet_settings, rids, 60, fleet)
    assert {(st.outcome, st.summary) for st in got.values()} == {("succeeded", "async paid")}
    assert sorted(effects(redis_client, fleet_settings).values()) == [1] * 10


def test_three_workers_killed_at_random_finish_every_run_with_each_effect_once(
    fleet_settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """SIGKILL a random worker every 1-2.5 s and start a new one, until every run finished:
    orphans are resumed by whoever owns their partition, each effect lands once (the
    receiver counts), and `runlog verify --all` passes."""
    import random

    from runlog.fleet._worker import live_workers

    runs, steps = 45, 6
    fleet = Fleet(fleet_settings, tmp_path, FLEET_TEST_STEP_S="0.25")
    rng = random.Random(29)
    try:
        for _ in range(3):
            fleet.spawn(concurrency=4)
        rids = [
            runlog.start(
                "payer", {"to": f"r{i}", "steps": steps}, tenant="t1", settings=fleet_settings
            )
            for i in range(runs)
        ]
        kills, deadline = 0, time.monotonic() + 75
        while time.monotonic() < deadline and kills < 6:
            time.sleep(rng.uniform(1.5, 3.0))
            done = sum(st.status == "finished" for st in states(fleet_settings, rids).values())
            if done == runs:
                break
            holding = [
                w["id"].split("-")[0]
                for w in live_workers(redis_client, fleet_settings)
                if int(w["runs_held"]) > 0
            ]
            victims = [n for n in holding if n in fleet.alive()]
            if not victims:
                continue
            fleet.kill(rng.choice(victims))  # mid-run: its runs are orphans now
            kills += 1
            fleet.spawn(concurrency=4, wait=False)
        assert kills >= 3, "the runs finished before the workers were killed: make them longer"
        got = wait_finished(fleet_settings, rids, 80, fleet)
    finally:
        fleet.stop_all()
    assert {st.outcome for st in got.values()} == {"succeeded"}
    counts = effects(redis_client, fleet_settings)
    assert len(counts) == runs * steps and set(counts.values()) == {1}, counts
    assert sum(st.resumptions for st in got.values()) >= 1  # orphans were resumed
    checked = verify_all(fleet_settings)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]


def test_partitions_move_mid_run_when_a_worker_joins(
    fleet_settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """A second worker joining takes partitions from the first while its runs are in
    flight: the lease, not the assignment, says who acts; every run finishes, each effect
    once, and the newcomer runs runs of its partitions."""

    runs, steps = 12, 8
    fleet = Fleet(fleet_settings, tmp_path, FLEET_TEST_STEP_S="0.2")
    try:
        first = fleet.spawn(concurrency=runs)
        rids = [
            runlog.start(
                "payer", {"to": f"j{i}", "steps": steps}, tenant="t1", settings=fleet_settings
            )
            for i in range(runs)
        ]
        deadline = time.monotonic() + 30
        while not all(st.seq > 2 for st in states(fleet_settings, rids).values()):
            assert time.monotonic() < deadline, fleet.tail(first)
            time.sleep(0.1)
        second = fleet.spawn(concurrency=runs)
        fleet.wait_assigned(second)
        assigned = re.findall(r"assigned \[([0-9, ]*)\]", fleet.tail(second, 100_000))
        theirs = {int(p) for p in assigned[-1].split(",") if p.strip()} if assigned else set()
        # More runs after the join: the partitions the newcomer took are its to run.
        later = [
            runlog.start("payer", {"to": f"k{i}", "steps": 2}, tenant="t1", settings=fleet_settings)
            for i in range(runs)
        ]
        got = wait_finished(fleet_settings, rids + later, 60, fleet)
        assert "revoked" in fleet.tail(first, 100_000), fleet.tail(first)
    finally:
        fleet.stop_all()
    assert {st.outcome for st in got.values()} == {"succeeded"}
    counts = effects(redis_client, fleet_settings)
    assert len(counts) == runs * steps + runs * 2 and set(counts.values()) == {1}
    assert theirs, "the newcomer was given no partition"
    for rid in later:
        writers = {e.writer_id.split("-")[0] for e in _events(fleet_settings, rid)}
        owner = second if partition_for(rid, fleet_settings.partitions) in theirs else first
        assert writers == {owner}, (rid, writers, theirs)
    checked = verify_all(fleet_settings)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]


def test_resume_dispatches_a_waiting_run_now_and_workers_lists_the_fleet(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    import json
    import subprocess
    import sys

    from fleet_support import fleet_env

    name = fleet.spawn()
    rid = runlog.start("needs_fix", {"to": "f"}, tenant="t1", settings=fleet_settings)
    env = fleet_env(fleet_settings)
    deadline = time.monotonic() + 30
    while True:  # dispatched once, escalated, released: no slot held, nothing left to do
        out = subprocess.run(
            [sys.executable, "-m", "runlog.cli", "workers", "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (w,) = json.loads(out)
        if states(fleet_settings, [rid])[rid].seq >= 1 and w["runs_held"] == "0":
            break
        assert time.monotonic() < deadline, (out, fleet.tail(name))
        time.sleep(0.2)
    assert w["id"].startswith(f"{name}-") and w["pid"] == str(fleet.procs[name].pid)
    time.sleep(1)
    assert states(fleet_settings, [rid])[rid].status != "finished"
    redis_client.set(f"{fleet_settings.redis_key_prefix}:fixed", "1")  # the fix is deployed
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "resume", rid, "--tenant", "t1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (st,) = wait_finished(fleet_settings, [rid], 30, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "fixed and paid")
    assert list(effects(redis_client, fleet_settings).values()) == [1]
    # Resuming a finished run is refused.
    again = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "resume", rid, "--tenant", "t1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "RunFinished" in again.stderr


def test_opening_a_new_id_on_a_quiet_partition_reads_it_without_waiting_out_a_timeout(
    test_settings: Settings,
) -> None:
    """A worker opens every requested run by its id. On a partition with no record since
    the id's time, the read starts at the partition's beginning; it used to ask for 500
    records and wait out consume()'s whole 1 s timeout for the few there were, so every
    start on a quiet partition cost a second (the fleet's start latency, p50 330 ms)."""
    import statistics

    from runlog._bootstrap import Services
    from runlog.producers._opening import open_run_with
    from runlog.schemas._keys import new_run_id

    services = Services(test_settings)
    try:
        deps = services.run_deps()
        for _ in range(3):  # a few records in each partition, long before the ids below
            open_run_with(deps, None, tenant="t1").close()
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            open_run_with(deps, new_run_id(), tenant="t1").close()
            took.append(time.perf_counter() - t0)
    finally:
        services.close()
    assert statistics.median(took) < 0.5, took


def test_waiting_runs_hold_no_slot_no_thread_and_no_lease(
    test_settings: Settings, tmp_path: Path, redis_client: redis.Redis, request: Any
) -> None:
    """Runs asleep for an hour: the worker holds none of them (no slot, no lease), so more
    runs than its concurrency wait at once, and a short one still gets a slot at once."""
    from runlog.fleet._worker import live_workers
    from runlog.producers._lease import LeaseManager

    # Leases that would outlive the test: one still there was held, not expired.
    fleet_settings = test_settings.model_copy(update={"lease_ttl_ms": 120_000})
    fleet = Fleet(fleet_settings, tmp_path)
    request.addfinalizer(fleet.stop_all)
    fleet.spawn(concurrency=4)
    rids = [
        runlog.start("napper", {"sleep_s": 3600}, tenant="t1", settings=fleet_settings)
        for _ in range(40)
    ]
    deadline = time.monotonic() + 60
    while not all(st.timers for st in states(fleet_settings, rids).values()):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    quick = runlog.start("payer", {"to": "q", "steps": 1}, tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [quick], 30, fleet).values()
    assert st.outcome == "succeeded"
    leases = LeaseManager(redis_client, key_prefix=fleet_settings.redis_key_prefix)
    held = [rid for rid in rids if redis_client.exists(leases.lease_key("t1", rid))]
    assert held == []
    time.sleep(2.5)  # a heartbeat
    (w,) = live_workers(redis_client, fleet_settings)
    assert w["runs_held"] == "0"
    assert {s.status for s in states(fleet_settings, rids).values()} == {"running"}


def test_a_start_without_the_lifecycle_topic_is_refused_at_once(test_settings: Settings) -> None:
    from runlog._topics import delete_topics

    s = test_settings.model_copy(update={"topic_prefix": f"{test_settings.topic_prefix}-none"})
    delete_topics(s, [s.lifecycle_topic])
    t0 = time.monotonic()
    with pytest.raises(runlog.ConfigError, match="runlog topics create"):
        runlog.start("payer", {"to": "x", "steps": 1}, tenant="t1", settings=s)
    assert time.monotonic() - t0 < 15  # not the 30 s delivery timeout
