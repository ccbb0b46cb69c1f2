"""A SIGTERMed worker hands its runs over: real `runlog worker` processes on the real stack.

The drainer gives its partitions up at once, lets each run finish the step it is in, then
releases the run's lease as a handover; the other worker resumes every run (the ones
mid-step and the ones asleep), and the receiver (tests/workers/fleet_agents.py, which
counts each key) sees every effect once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, effects, states, wait_finished

import runlog
from runlog._settings import Settings
from runlog.log._reader import LogReader


@pytest.fixture
def drain_settings(test_settings: Settings) -> Settings:
    # A lease that would outlive the test: a run the survivor resumes was handed over, not
    # left to expire.
    return test_settings.model_copy(update={"lease_ttl_ms": 120_000})


def _records(settings: Settings, rid: str) -> list[runlog.Event]:
    """Every record of the run in log order, fenced ones included."""
    with LogReader(settings) as reader:
        part = reader.partition_of(rid)
        return [r.event for r in reader.read(rid, partition=part, start=0)]


def _wait(cond: object, what: str, fleet: Fleet, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, (
            what + "\n" + "\n".join(fleet.tail(n) for n in fleet.logs)
        )
        time.sleep(0.1)


def test_a_sigtermed_worker_hands_runs_mid_step_and_mid_sleep_to_the_other(
    drain_settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    steps, payers, sleepers = 40, 6, 4
    fleet = Fleet(drain_settings, tmp_path, FLEET_TEST_STEP_S="0.3")
    try:
        ready = tmp_path / "first.ready"
        first = fleet.spawn(concurrency=16, drain_s=20, ready_file=ready)
        assert ready.exists()  # ready: taking runs
        paying = [
            runlog.start(
                "payer", {"to": f"p{i}", "steps": steps}, tenant="t1", settings=drain_settings
            )
            for i in range(payers)
        ] + [
            # an ``async def`` agent hands over from the worker's event loop
            runlog.start(
                "apayer", {"to": f"a{i}", "steps": steps}, tenant="t1", settings=drain_settings
            )
            for i in range(2)
        ]
        sleeping = [
            runlog.start(
                "sleeper", {"to": f"s{i}", "sleep_s": 12}, tenant="t1", settings=drain_settings
            )
            for i in range(sleepers)
        ]
        # Every payer is mid-run on the first worker; every sleeper is asleep (its timer in
        # the log, no lease held).
        _wait(
            lambda: (
                all(
                    len(st.completed_calls) >= 2 and st.status != "finished"
                    for st in states(drain_settings, paying).values()
                )
                and all(st.timers for st in states(drain_settings, sleeping).values())
            ),
            "runs did not get going on the first worker",
            fleet,
        )
        second = fleet.spawn(concurrency=16)
        fleet.wait_assigned(second)
        before = states(drain_settings, paying + sleeping)
        done = [rid for rid, st in before.items() if st.status == "finished"]
        assert not done, f"finished before the SIGTERM: {done}"
        fleet.terminate(first)
        assert fleet.procs[first].wait(60) == 0, fleet.tail(first)
        assert not ready.exists()  # not ready once it drains
        got = wait_finished(drain_settings, paying + sleeping, 90, fleet)
    finally:
        fleet.stop_all()
    assert {st.outcome for st in got.values()} == {"succeeded"}, got
    counts = effects(redis_client, drain_settings)
    assert len(counts) == (payers + 2) * steps + sleepers * 2 and set(counts.values()) == {1}, (
        counts
    )
    for rid in paying + sleeping:
        recs = _records(drain_settings, rid)
        writers = [e.writer_id.split("-")[0] for e in recs]
        last_first = max(i for i, w in enumerate(writers) if w == first)
        # Every record after the drainer's last is the survivor's: the next event of every
        # run, and all that follow, come from the other worker.
        assert writers[last_first + 1 :] and set(writers[last_first + 1 :]) == {second}, writers
        kinds = {e.type for e in recs}
        # The call in flight at SIGTERM completed and was recorded by the drainer: nothing
        # was left uncertain for the survivor to reconcile.
        assert runlog.EventType.TOOL_CALL_UNCERTAIN not in kinds, rid
        assert runlog.EventType.RECONCILIATION_ATTEMPTED not in kinds, rid
    for rid in paying:
        recs = _records(drain_settings, rid)
        resumed = [e for e in recs if e.type is runlog.EventType.RUN_RESUMED]
        taken = [e for e in resumed if e.writer_id.startswith(f"{second}-")]
        assert len(taken) == 1, resumed
        # A handover the next owner saw (the drainer's token), not an expiry.
        reason = taken[0].payload.reason  # type: ignore[attr-defined]
        assert f"handed over by {first}-" in reason, reason
        assert taken[0].payload.previous_epoch == taken[0].epoch - 1  # type: ignore[attr-defined]


def test_a_killed_workers_runs_resume_on_the_other_before_its_partitions_move(
    test_settings: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """Default lease and liveness settings; the group's session timeout so long that the
    dead worker's partitions do not move during the test: its runs, SIGKILLed mid-step,
    are resumed by the other worker once its liveness key is gone (its session's runs are
    adopted), every effect once, every record after the dead worker's from the survivor."""
    steps, runs = 30, 8
    fleet = Fleet(test_settings, tmp_path, FLEET_TEST_STEP_S="0.2")
    fleet.env["RUNLOG_WORKER_SESSION_TIMEOUT_MS"] = "60000"
    try:
        first = fleet.spawn(concurrency=16)
        second = fleet.spawn(concurrency=16)
        fleet.wait_assigned(second)
        rids = [
            runlog.start(
                "payer", {"to": f"k{i}", "steps": steps}, tenant="t1", settings=test_settings
            )
            for i in range(runs)
        ]
        _wait(
            lambda: all(
                len(st.completed_calls) >= 2 for st in states(test_settings, rids).values()
            ),
            "runs did not get going",
            fleet,
        )
        victim_runs = [
            rid
            for rid in rids
            if _records(test_settings, rid)[-1].writer_id.startswith(f"{first}-")
        ]
        assert victim_runs, "the first worker holds none of the runs"
        fleet.kill(first)
        got = wait_finished(test_settings, rids, 45, fleet)
    finally:
        fleet.stop_all()
    assert {st.outcome for st in got.values()} == {"succeeded"}
    counts = effects(redis_client, test_settings)
    assert len(counts) == runs * steps and set(counts.values()) == {1}, counts
    for rid in victim_runs:
        writers = [e.writer_id.split("-")[0] for e in _records(test_settings, rid)]
        last_first = max(i for i, w in enumerate(writers) if w == first)
        assert set(writers[last_first + 1 :]) == {second}, writers
    assert "runs adopted" in fleet.tail(second, 200_000)
