"""A start request for a run id that has a log is answered from that log, on the real stack
with `runlog worker` processes.

The lifecycle topic is a cache of the run's log: a request of another tenant or another
agent is refused where it is made and nothing is written; a record that disagrees with the
log anyway (written over the run by a request that raced the check, or by an older client)
is rebuilt from the log by the worker, never dropped, so a durable timer survives it and a
worker restart; a worker executes the agent the run's RUN_STARTED recorded.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from fleet_support import Fleet, effects, fleet_env, states, wait_finished

import runlog
from runlog._settings import Settings
from runlog.fleet._lifecycle import Latest, Record, read_latest, writer_for
from runlog.log._kafka import high_watermark, reader_config
from runlog.log._reader import LogReader
from runlog.projections._run_state import RunState
from runlog.schemas._keys import partition_for
from runlog.schemas._vocabulary import EventType


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=fleet_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _latest(settings: Settings, rid: str) -> Latest | None:
    return read_latest(settings, run_ids=frozenset({rid})).get(rid)


def _history(settings: Settings, rid: str) -> list[Record | None]:
    """Every lifecycle record of ``rid`` still in its partition, oldest first."""
    consumer = Consumer(reader_config(settings))
    part = partition_for(rid, settings.partitions)
    out: list[Record | None] = []
    try:
        end = high_watermark(consumer, settings.lifecycle_topic, part)
        consumer.assign([TopicPartition(settings.lifecycle_topic, part, OFFSET_BEGINNING)])
        offset = -1
        while offset < end - 1:
            for msg in consumer.consume(500, timeout=0.5):
                if msg.error() is not None:
                    continue
                offset = msg.offset() or 0
                if msg.key() == rid.encode():
                    value = msg.value()
                    out.append(None if value is None else Record.decode(value))
    finally:
        consumer.close()
    return out


def _until(what: str, check: Any, fleet: Fleet, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            logs = "\n".join(fleet.tail(n, 2000) for n in fleet.logs)
            raise AssertionError(f"{what} never happened\n{logs}")
        time.sleep(0.1)


def _asleep(settings: Settings, rid: str, fleet: Fleet) -> RunState:
    """The run's state once its timer is in the log and its record says it waits for it."""

    def check() -> RunState | None:
        st = states(settings, [rid])[rid]
        got = _latest(settings, rid)
        waits = got is not None and got.record is not None and got.record.state == "waiting_until"
        return st if st.timers and waits else None

    return _until(f"{rid} asleep", check, fleet)


def test_a_start_for_another_tenants_run_is_refused_and_writes_nothing(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.spawn()
    rid = runlog.start(
        "sleeper",
        {"to": "a", "sleep_s": 3},
        tenant="acme",
        run_id="order-r1",
        settings=fleet_settings,
    )
    _asleep(fleet_settings, rid, fleet)
    with pytest.raises(runlog.StartRefused) as refused:
        runlog.start(
            "sleeper",
            {"to": "b", "sleep_s": 0},
            tenant="other",
            run_id=rid,
            settings=fleet_settings,
        )
    assert refused.value.run_id == rid
    assert "acme" not in str(refused.value)  # another tenant's run: its owner is not named
    with pytest.raises(runlog.StartRefused):
        asyncio.run(
            runlog.aio.start(
                "sleeper",
                {"to": "b", "sleep_s": 0},
                tenant="other",
                run_id=rid,
                settings=fleet_settings,
            )
        )
    cli = _cli(
        fleet_settings,
        "start",
        "sleeper",
        "--input",
        '{"to": "c", "sleep_s": 0}',
        "--tenant",
        "other",
        "--run-id",
        rid,
    )
    assert cli.returncode == 1, cli
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    # Nothing of the other tenant was ever written to the lifecycle topic.
    assert all(r is None or r.tenant == "acme" for r in _history(fleet_settings, rid))
    assert (st.tenant, st.outcome, st.summary) == ("acme", "succeeded", "woke and paid")
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_a_timer_survives_a_record_written_over_it_and_a_worker_restart(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """A record of another tenant written over a sleeping run (as a request that raced
    the check writes it): the worker rebuilds the run's record from the log; a second one,
    written while no worker runs, is rebuilt by the worker that reads the topic again."""
    first = fleet.spawn()
    rid = runlog.start(
        "sleeper",
        {"to": "a", "sleep_s": 8},
        tenant="acme",
        run_id="order-r2",
        settings=fleet_settings,
    )
    st = _asleep(fleet_settings, rid, fleet)
    due = st.timers[-1].due_at
    lw = writer_for(fleet_settings)
    foreign = Record("requested", "other", "sleeper", input_json='{"to": "x", "sleep_s": 0}')
    at = lw.write(rid, foreign)

    def rebuilt() -> Record | None:
        got = _latest(fleet_settings, rid)
        if got is not None and got.offset > at and got.record is not None:
            return got.record
        return None

    rec = _until("the record rebuilt", rebuilt, fleet)
    assert (rec.state, rec.tenant, rec.agent, rec.due_at) == (
        "waiting_until",
        "acme",
        "sleeper",
        due,
    )
    fleet.kill(first)
    lw.write(rid, Record("requested", "other", "nosuchagent", input_json="{}"))
    fleet.spawn()
    (st,) = wait_finished(fleet_settings, [rid], 90, fleet).values()
    assert (st.tenant, st.outcome, st.summary) == ("acme", "succeeded", "woke and paid")
    assert st.last_event_at is not None and st.last_event_at >= due
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]
    assert _latest(fleet_settings, rid).record is None  # type: ignore[union-attr]  # tombstone


def test_a_start_naming_another_agent_is_refused_naming_both(
    fleet_settings: Settings, fleet: Fleet
) -> None:
    fleet.spawn()
    rid = runlog.start(
        "napper", {"sleep_s": 3}, tenant="acme", run_id="order-r3", settings=fleet_settings
    )
    _asleep(fleet_settings, rid, fleet)
    with pytest.raises(runlog.AgentMismatch) as refused:
        runlog.start(
            "payer", {"to": "p", "steps": 1}, tenant="acme", run_id=rid, settings=fleet_settings
        )
    assert (refused.value.agent, refused.value.recorded_agent) == ("payer", "napper")
    assert "payer" in str(refused.value) and "napper" in str(refused.value)
    cli = _cli(
        fleet_settings,
        "start",
        "payer",
        "--input",
        '{"to": "p", "steps": 1}',
        "--tenant",
        "acme",
        "--run-id",
        rid,
    )
    assert cli.returncode == 1 and "napper" in cli.stderr, cli
    assert all(r is None or r.agent == "napper" for r in _history(fleet_settings, rid))


def test_a_worker_executes_the_agent_the_log_recorded_never_the_records(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """A record naming `payer` over a run of `napper` (which calls no tool): the worker
    never runs payer's function or tools under the run's lease; the run ends napper's.
    (Its input would let payer pay: the irreversible call must still never fire.)"""
    fleet.spawn()
    rid = runlog.start(
        "napper",
        {"sleep_s": 4, "to": "p", "steps": 2},
        tenant="acme",
        run_id="order-r4",
        settings=fleet_settings,
    )
    _asleep(fleet_settings, rid, fleet)
    writer_for(fleet_settings).write(
        rid, Record("requested", "acme", "payer", input_json='{"to": "p", "steps": 2}')
    )
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.agent_name, st.outcome, st.summary) == ("napper", "succeeded", "rested")
    assert effects(redis_client, fleet_settings) == {}  # payer's tool never fired
    assert not st.completed_calls and not st.open_calls


def test_a_start_of_the_same_agent_restores_a_record_that_was_lost(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """The lifecycle record of a sleeping run is gone (a tombstone written over it: what a
    worker reading the topic after compaction would see); a restarted worker has nothing to
    dispatch. A start of the same agent for the id is "already started": answered from the
    log, it writes the record the log implies (the timer's), and the run wakes and ends."""
    first = fleet.spawn()
    rid = runlog.start(
        "sleeper",
        {"to": "a", "sleep_s": 6},
        tenant="acme",
        run_id="order-r5",
        settings=fleet_settings,
    )
    due = _asleep(fleet_settings, rid, fleet).timers[-1].due_at
    fleet.kill(first)
    writer_for(fleet_settings).write(rid, None)
    fleet.spawn()
    cli = _cli(
        fleet_settings,
        "start",
        "sleeper",
        "--input",
        '{"to": "z", "sleep_s": 0}',
        "--tenant",
        "acme",
        "--run-id",
        rid,
    )
    assert cli.returncode == 0 and cli.stdout.strip() == rid, cli
    assert "already started" in cli.stderr
    # The record written after the lost one (the test's tombstone); read from the history,
    # since on a slow machine the timer may be due by now and the run already ended. The
    # record the log implies is the timer's, or ``open`` when the timer was due by the time
    # the start was answered (a slow machine again).
    history = _history(fleet_settings, rid)
    restored = history[history.index(None) + 1]
    assert restored is not None
    assert (restored.state, restored.due_at, restored.input_json) in (
        ("waiting_until", due, None),
        ("open", None, None),
    )
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "woke and paid")
    assert st.agent_input is not None and '"to":"a"' in st.agent_input  # the first input
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_two_tenants_starting_one_new_id_at_once_make_one_run(
    fleet_settings: Settings, fleet: Fleet
) -> None:
    """Two requests for the same new id, released together: at most one run is started
    (one RUN_STARTED), under one of the two tenants, and it ends; the other request is
    refused where it was made, or (when both passed the check before either wrote) its
    record is rebuilt from the log by the worker, never executed."""
    fleet.spawn()
    rounds = 4
    for i in range(rounds):
        rid = f"contested-{i}"
        gate = threading.Barrier(2)
        outcome: dict[str, Any] = {}

        def ask(
            tenant: str,
            rid: str = rid,
            gate: threading.Barrier = gate,
            outcome: dict[str, Any] = outcome,
        ) -> None:
            gate.wait()
            try:
                outcome[tenant] = runlog.start(
                    "napper", {"sleep_s": 0}, tenant=tenant, run_id=rid, settings=fleet_settings
                )
            except runlog.StartRefused as exc:
                outcome[tenant] = exc

        threads = [threading.Thread(target=ask, args=(t,)) for t in ("acme", "other")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert any(v == rid for v in outcome.values()), outcome
        (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
        assert st.tenant in ("acme", "other") and st.outcome == "succeeded"
        with LogReader(fleet_settings) as reader:
            part = reader.partition_of(rid)
            evs = [r.event for r in reader.read(rid, partition=part, start=0)]
        assert [e.type for e in evs].count(EventType.RUN_STARTED) == 1
        assert {e.tenant for e in evs} == {st.tenant}

        # Whichever record the loser wrote, nothing is left that would start its run:
        # the id's record ends as the finished run's tombstone.
        def ended(rid: str = rid) -> bool:
            got = _latest(fleet_settings, rid)
            return got is not None and got.record is None

        _until(f"{rid}'s tombstone", ended, fleet)


def test_a_tombstone_over_a_sleeping_run_is_rebuilt_from_its_log(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """A record naming an end (a tombstone) the run's log contradicts: the worker reads the
    log, finds the run asleep, and writes its timer's record again."""
    fleet.spawn()
    rid = runlog.start(
        "sleeper",
        {"to": "a", "sleep_s": 5},
        tenant="acme",
        run_id="order-r6",
        settings=fleet_settings,
    )
    due = _asleep(fleet_settings, rid, fleet).timers[-1].due_at
    at = writer_for(fleet_settings).write(rid, None)

    def rebuilt() -> Record | None:
        got = _latest(fleet_settings, rid)
        return got.record if got is not None and got.offset > at else None

    rec = _until("the record rebuilt", rebuilt, fleet)
    assert (rec.state, rec.tenant, rec.due_at) == ("waiting_until", "acme", due)
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "woke and paid")
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_a_foreign_record_racing_a_takeover_resumes_the_run_as_its_log_says(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """The run's worker is SIGKILLed mid-run and, before another takes the run over, a
    record of another tenant and agent is written over it: the new worker resumes the run
    for its own tenant and agent once the dead holder's lease is gone, and never runs the
    record's agent."""
    first = fleet.spawn()
    rid = runlog.start(
        "noter", {"notes": 60}, tenant="acme", run_id="order-r7", settings=fleet_settings
    )

    def noting() -> bool:
        st = states(fleet_settings, [rid])[rid]
        return st.seq >= 6

    _until("notes", noting, fleet)
    fleet.kill(first)
    writer_for(fleet_settings).write(
        rid, Record("requested", "other", "payer", input_json='{"to": "x", "steps": 3}')
    )
    fleet.spawn()
    (st,) = wait_finished(fleet_settings, [rid], 90, fleet).values()
    assert (st.tenant, st.agent_name, st.outcome, st.summary) == (
        "acme",
        "noter",
        "succeeded",
        "noted everything",
    )
    assert st.resumptions >= 1
    assert effects(redis_client, fleet_settings) == {}


def test_a_pending_request_of_another_tenant_is_not_written_over(
    fleet_settings: Settings,
) -> None:
    """No worker up, no log yet: the id's pending request is the only record of it, and
    another tenant's request would silently replace it. It is refused; the same tenant may
    replace its own (nothing ran)."""
    rid = runlog.start(
        "napper", {"sleep_s": 0}, tenant="acme", run_id="order-r8", settings=fleet_settings
    )
    before = _latest(fleet_settings, rid)
    with pytest.raises(runlog.StartRefused):
        runlog.start("napper", {"sleep_s": 1}, tenant="other", run_id=rid, settings=fleet_settings)
    assert _latest(fleet_settings, rid) == before
    runlog.start(
        "payer", {"to": "p", "steps": 1}, tenant="acme", run_id=rid, settings=fleet_settings
    )
    got = _latest(fleet_settings, rid)
    assert got is not None and got.record is not None
    assert (got.record.tenant, got.record.agent) == ("acme", "payer")
