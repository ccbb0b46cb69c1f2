"""Durability contracts the writer path rests on, checked on the real stack.

- Events pipelined with ``Run.emit`` but not behind a barrier may be lost in a crash; what
  survives is always a prefix (never a gap), and nothing after it counts.
- Readers find a run where librdkafka's producer put it: our murmur2 agrees with
  ``partitioner=murmur2_random`` for every key.
- The producer is configured for durability (librdkafka's defaults are not).
- Released schemas never change: their fingerprints are pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

import runlog
from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.log._reader import LogReader
from runlog.producers._handle import engine_of
from runlog.producers._writer import BARRIERS, EventWriter, producer_config
from runlog.projections._run_state import fold
from runlog.schemas._keys import partition_for
from runlog.schemas._registry import registry

ROOT = Path(__file__).resolve().parents[2]

CRASHING_WORKER = r"""
import os, signal, sys
import runlog
run = runlog.open_run(sys.argv[1])
run.append("user_message", content="durable")          # behind a barrier: acknowledged
for i in range(int(sys.argv[2])):
    run.emit("user_message", content=f"pipelined {i}")  # no barrier: may be lost
os.kill(os.getpid(), signal.SIGKILL)                    # die before any barrier
"""


def _env(s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RUNLOG_BOOTSTRAP_SERVERS": s.bootstrap_servers,
            "RUNLOG_REDIS_URL": s.redis_url,
            "RUNLOG_TOPIC_PREFIX": s.topic_prefix,
            "RUNLOG_REDIS_KEY_PREFIX": s.redis_key_prefix,
            "RUNLOG_PARTITIONS": str(s.partitions),
            "RUNLOG_LEASE_TTL_MS": str(s.lease_ttl_ms),
            "PYTHONPATH": str(ROOT),
        }
    )
    return env


@pytest.mark.parametrize("pipelined", [1, 50, 400])
def test_a_crash_between_barriers_loses_only_a_suffix_of_unacknowledged_events(
    test_settings: Settings, pipelined: int
) -> None:
    s = test_settings.model_copy(update={"lease_ttl_ms": 800})
    with runlog.open_run(settings=s) as started:  # started, then released
        rid = started.run_id
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_WORKER, rid, str(pipelined)],
        env=_env(s),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -9, done.stderr

    with runlog.open_run(rid, settings=s, wait_s=5) as resumed:
        st = resumed.state
        pipelined_seen = [m.content for m in st.messages if m.content.startswith("pipelined ")]
        # Whatever survived is a prefix of what was emitted: no gap, no reordering.
        assert pipelined_seen == [f"pipelined {i}" for i in range(len(pipelined_seen))]
        print(f"pipelined {pipelined}, survived the crash: {len(pipelined_seen)}")
        assert any(m.content == "durable" for m in st.messages)
        assert st.fenced_writes == 0
        # RUN_STARTED, RUN_RESUMED (the worker), durable, the surviving prefix, RUN_RESUMED.
        assert st.seq == 4 + len(pipelined_seen)
        resumed.append("user_message", content="after the crash")
        live = resumed.state.digest()

    with LogReader(s) as reader:
        records = list(reader.read(rid))
    # Every record in the log counts: nothing half-written, nothing out of order.
    logged = fold(r.event for r in records)
    assert logged.digest() == live
    assert [r.event.seq for r in records] == list(range(1, len(records) + 1))


def test_readers_compute_the_partition_the_producer_chose(settings: Settings) -> None:
    s = settings.model_copy(update={"topic_prefix": f"t-{uuid.uuid4().hex[:8]}", "partitions": 7})
    ensure_topics(s).raise_for_drift()
    writer = EventWriter(s)
    try:
        keys = [f"run-{uuid.uuid4().hex}" for _ in range(150)] + ["r", "ab", "abc", "é"]
        futures = {k: writer.send(s.events_topic, k.encode(), b"x", []) for k in keys}
        for key, fut in futures.items():
            assert fut.result(timeout=30).partition == partition_for(key, 7), key
    finally:
        writer.close()
        from confluent_kafka.admin import AdminClient

        AdminClient(s.kafka_common()).delete_topics([s.events_topic, s.quarantine_topic])


def test_the_producer_is_configured_for_durability(settings: Settings) -> None:
    conf = producer_config(settings)
    assert conf["enable.idempotence"] is True
    assert conf["acks"] == "all"
    assert conf["partitioner"] == "murmur2_random"
    # A caller's extra properties are layered on a copy, never on the settings.
    assert conf["linger.ms"] == 5  # pipelined appends batch; a barrier kicks (kick tests)
    extra = {"linger.ms": 7}
    assert producer_config(settings, extra)["linger.ms"] == 7
    assert extra == {"linger.ms": 7}


PINS = ROOT / "tests" / "fixtures" / "schema_fingerprints.json"


def test_released_schemas_never_change() -> None:
    """Editing a released .avsc changes its fingerprint and fails here (add a version)."""
    pinned: dict[str, str] = json.loads(PINS.read_text())
    shipped = {
        f"{et.value}/v{v}": ws.fingerprint.hex()
        for (et, v), ws in registry().by_type_version.items()
    }
    for name, fp in pinned.items():
        assert shipped.get(name) == fp, f"released schema {name} changed or disappeared"
    new = sorted(set(shipped) - set(pinned))
    assert not new, f"pin the new schema versions in {PINS.name}: {new}"


def test_an_unacknowledged_started_never_invokes_the_tool(test_settings: Settings) -> None:
    """STARTED must be durable before the tool runs; an unknown outcome stops the run."""
    from confluent_kafka.admin import AdminClient

    s = test_settings.model_copy(update={"delivery_timeout_ms": 2000})
    invoked: list[str] = []

    @runlog.tool(risk="irreversible")
    def transfer(args: dict[str, object], *, idempotency_key: str) -> str:
        invoked.append(idempotency_key)
        return "moved"

    run = runlog.open_run(tools=[transfer], settings=s)
    try:
        # The broker loses the topic under the writer: nothing can be acknowledged now.
        admin = AdminClient(s.kafka_common())
        admin.delete_topics([s.events_topic])[s.events_topic].result(timeout=30)
        # The controller accepted the deletion; the broker applies it a moment later, and
        # an append it still took in between would be acknowledged (and then deleted).
        deadline = time.monotonic() + 30
        while s.events_topic in admin.list_topics(timeout=10).topics:
            assert time.monotonic() < deadline, "the topic is still listed 30 s after deletion"
            time.sleep(0.05)
        with pytest.raises((runlog.AppendOutcomeUnknown, runlog.KafkaUnavailable)):
            run.call_tool("transfer", {"amount": 5})
        assert invoked == [], "the tool ran although its STARTED was never acknowledged"
        # The run refuses to go on: the next open_run must learn the truth from the log.
        with pytest.raises(runlog.Fenced):
            run.append("user_message", content="after an unknown outcome")
        assert invoked == []
    finally:
        engine_of(run).lease.release()


def test_a_barrier_does_not_wait_out_the_linger(test_settings: Settings) -> None:
    """Pipelined appends linger to leave in batches; a barrier sends what is queued at once.
    With a 20 s linger, durable appends and a safe call's pipelined pair made durable by a
    barrier all return long before the linger would have sent them."""
    from workers.common import services_for

    s = test_settings.model_copy(
        update={"kafka_extra": {**test_settings.kafka_extra, "linger.ms": SecretStr("20000")}}
    )
    with services_for(s):
        started = time.monotonic()
        with runlog.open_run(settings=s) as run:  # the claim is a barrier too
            for i in range(3):
                run.append(runlog.EventType.USER_MESSAGE, content=f"m{i}")
            run.emit(runlog.EventType.USER_MESSAGE, content="pipelined")
            run.barrier()
            took = time.monotonic() - started
            run_id = run.run_id
    assert took < 10, f"{took:.1f} s: the barriers waited for the 20 s linger"
    contents = [
        r.event.payload.content  # type: ignore[union-attr]
        for r in LogReader(s).read(run_id)
        if r.event.type is runlog.EventType.USER_MESSAGE
    ]
    assert contents == ["m0", "m1", "m2", "pipelined"]


def _user_messages(s: Settings, run_id: str) -> list[str]:
    return [
        r.event.payload.content  # type: ignore[union-attr]
        for r in LogReader(s).read(run_id)
        if r.event.type is runlog.EventType.USER_MESSAGE
    ]


def test_a_barrier_that_follows_does_not_wait_out_the_linger(test_settings: Settings) -> None:
    """A barrier that finds another thread serving delivery reports follows it, and the
    serving thread flushes for it: with a 20 s linger, a sync barrier and an event loop's
    barrier that had to follow (the serving role held elsewhere while they started) return
    long before the linger would have sent their appends."""
    from workers.common import services_for

    s = test_settings.model_copy(
        update={"kafka_extra": {**test_settings.kafka_extra, "linger.ms": SecretStr("20000")}}
    )
    with services_for(s) as svc:
        writer = svc.writer
        before = dict(BARRIERS)
        with runlog.open_run(settings=s) as run:
            with _role_held_until_a_barrier_follows(writer):
                took = _timed_append(run, "m0")
            assert took < 10, f"{took:.1f} s: a following barrier waited for the linger"
            sync_run_id = run.run_id

        async def an_async_run() -> tuple[float, str]:
            async with runlog.aio.open_run(settings=s) as arun:
                started = time.monotonic()
                with _role_held_until_a_barrier_follows(writer):
                    for i in range(3):
                        await arun.append(runlog.EventType.USER_MESSAGE, content=f"a{i}")
                return time.monotonic() - started, arun.run_id

        async_took, async_run_id = asyncio.run(an_async_run())
    assert async_took < 10, f"{async_took:.1f} s: an async barrier waited for the 20 s linger"
    assert BARRIERS["followed"] - before["followed"] >= 2  # the sync one, the first async one
    assert _user_messages(s, sync_run_id) == ["m0"]
    assert _user_messages(s, async_run_id) == ["a0", "a1", "a2"]


@contextlib.contextmanager
def _role_held_until_a_barrier_follows(writer: EventWriter) -> Iterator[None]:
    """Hold the serving role (so no barrier can serve itself) until a barrier starts to
    follow, then hand it back from another thread: the serving thread flushes for it."""
    assert writer._serving.acquire(timeout=10)
    followed = BARRIERS["followed"]

    def release() -> None:
        deadline = time.monotonic() + 10
        try:
            while BARRIERS["followed"] == followed and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            writer._serving.release()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        yield
    finally:
        releaser.join(timeout=30)
    assert BARRIERS["followed"] > followed, "no barrier followed while the role was held"


def _timed_append(run: runlog.Run, content: str) -> float:
    started = time.monotonic()
    run.append(runlog.EventType.USER_MESSAGE, content=content)
    return time.monotonic() - started


def test_a_lone_run_serves_its_own_barriers(test_settings: Settings) -> None:
    """A run whose appends are all the writer has outstanding serves its own delivery
    reports: each durable append's flush is ended by the callback of its own report (none
    follows the serving thread but the odd one that starts while it drains), and the log
    holds every event in order."""
    from workers.common import services_for

    with services_for(test_settings), runlog.open_run(settings=test_settings) as run:
        before = dict(BARRIERS)
        for i in range(20):
            run.append(runlog.EventType.USER_MESSAGE, content=f"m{i}")
        served = BARRIERS["served"] - before["served"]
        followed = BARRIERS["followed"] - before["followed"]
        run_id = run.run_id
    assert served + followed == 20
    # One may follow when it starts while the serving thread drains (a few microseconds
    # every 5 ms); without the callback ending the flush none would count as served.
    assert served >= 15, f"only {served} of 20 barriers ended at their own report"
    assert _user_messages(test_settings, run_id) == [f"m{i}" for i in range(20)]


def test_a_lone_async_run_serves_its_own_barriers(test_settings: Settings) -> None:
    """An event loop's barrier that is alone (its appends are all that is outstanding)
    serves its own report in the loop's thread, as a sync one does, instead of crossing
    two threads (the serving thread's flush, then the loop's wake-up)."""
    from workers.common import services_for

    async def appends() -> tuple[int, int, str]:
        async with runlog.aio.open_run(settings=test_settings) as run:
            before = dict(BARRIERS)
            for i in range(20):
                await run.append(runlog.EventType.USER_MESSAGE, content=f"m{i}")
            served = BARRIERS["served"] - before["served"]
            return served, BARRIERS["followed"] - before["followed"], run.run_id

    with services_for(test_settings):
        served, followed, run_id = asyncio.run(appends())
    assert served + followed == 20
    # Some may follow: one that starts while the serving thread drains, and those after a
    # report slower than the inline budget, with the backoff after it (a loaded machine:
    # 9 of 20 once, with CI's suite and others beside it); without the path, none serve.
    assert served >= 5, f"only {served} of 20 asyncio barriers served their own report"
    assert _user_messages(test_settings, run_id) == [f"m{i}" for i in range(20)]


def test_an_async_barrier_serves_inline_only_for_its_loops_one_run(
    test_settings: Settings,
) -> None:
    """With other runs open in the same loop, a barrier never holds the loop to serve its
    own report (the loop has their work to do meanwhile): it follows, even when its
    appends are all that is outstanding. Once it is the loop's one run, it serves inline."""
    from workers.common import services_for

    async def appends(run: runlog.aio.AsyncRun, names: list[str]) -> tuple[int, int]:
        before = dict(BARRIERS)
        for name in names:
            await run.append(runlog.EventType.USER_MESSAGE, content=name)
        return BARRIERS["served"] - before["served"], BARRIERS["followed"] - before["followed"]

    async def scenario() -> str:
        async with runlog.aio.open_run(settings=test_settings) as run:
            other = await runlog.aio.open_run(settings=test_settings)
            assert await appends(run, [f"m{i}" for i in range(5)]) == (0, 5)
            await other.close()
            # A few may still follow (the other run's close still in flight, a report
            # slower than the budget and the skips after it); with two runs open, none serve.
            served, _ = await appends(run, [f"m{i}" for i in range(5, 15)])
            assert served >= 3, f"{served} of 10 served once the run was the loop's one"
            return run.run_id

    with services_for(test_settings):
        run_id = asyncio.run(scenario())
    assert _user_messages(test_settings, run_id) == [f"m{i}" for i in range(15)]


def test_an_async_barrier_not_served_within_its_budget_follows(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone asyncio barrier serves its report in the loop's thread for at most
    ``INLINE_S`` (each flush slice is bounded by what is left of it); when its report is
    not in by then it follows the serving thread like any other, and the next 2 (then 4,
    8... after misses in a row) follow at once: a broker farther away than the budget must
    not cost every barrier the budget in vain. Every append completes, in order."""
    from workers.common import services_for

    from runlog.producers import _async_run as async_run

    async def appends(run: runlog.aio.AsyncRun, names: list[str]) -> tuple[int, int]:
        before = dict(BARRIERS)
        for name in names:
            await run.append(runlog.EventType.USER_MESSAGE, content=name)
        return BARRIERS["served"] - before["served"], BARRIERS["followed"] - before["followed"]

    names = (f"m{i}" for i in itertools.count())
    sent: list[str] = []

    async def miss(run: runlog.aio.AsyncRun, writer: EventWriter) -> None:
        """Appends with no budget until one barrier tries to serve inline and misses (a
        barrier may find the serving thread draining, and follow without trying)."""
        monkeypatch.setattr(async_run, "INLINE_S", 0.0)
        misses = writer._inline_misses
        for _ in range(50):
            sent.append(next(names))
            assert await appends(run, sent[-1:]) == (0, 1)
            if writer._inline_misses > misses:
                break
        assert writer._inline_misses == misses + 1, "no barrier tried to serve inline"
        monkeypatch.setattr(async_run, "INLINE_S", budget)

    budget = async_run.INLINE_S

    async def scenario(writer: EventWriter) -> str:
        async with runlog.aio.open_run(settings=test_settings) as run:
            await miss(run, writer)
            assert writer._inline_skips == 2
            sent.extend([next(names), next(names)])
            assert await appends(run, sent[-2:]) == (0, 2)  # skipped: they follow
            await miss(run, writer)  # tried again: a second miss in a row
            assert writer._inline_skips == 4
            sent.extend(next(names) for _ in range(4))
            assert await appends(run, sent[-4:]) == (0, 4)
            # The skips ran out: it tries again. A real miss now (a report slower than
            # 3 ms on a loaded machine) means 8 more skips, so allow for a few.
            for _ in range(40):
                sent.append(next(names))
                if await appends(run, sent[-1:]) == (1, 0):
                    break
            else:
                raise AssertionError("no barrier served inline once the skips ran out")
            assert writer._inline_misses == 0  # served in time: the count starts over
            return run.run_id

    with services_for(test_settings) as svc:
        run_id = asyncio.run(scenario(svc.writer))
    assert _user_messages(test_settings, run_id) == sent


def test_a_barrier_follows_when_other_appends_are_outstanding(test_settings: Settings) -> None:
    """With another run's appends outstanding, a barrier does not serve every run's reports
    in its own thread: it follows, and the serving thread flushes everything queued. With a
    20 s linger holding the other run's pipelined appends, the barrier still returns long
    before the linger, and those appends were sent with it."""
    from workers.common import services_for

    s = test_settings.model_copy(
        update={"kafka_extra": {**test_settings.kafka_extra, "linger.ms": SecretStr("20000")}}
    )
    with services_for(s), runlog.open_run(settings=s) as other, runlog.open_run(settings=s) as run:
        for i in range(50):
            other.emit(runlog.EventType.USER_MESSAGE, content=f"o{i}")
        before = dict(BARRIERS)
        took = _timed_append(run, "m0")
        assert BARRIERS["followed"] - before["followed"] == 1
        assert BARRIERS["served"] == before["served"]
        # The other run's appends left with the flush made for the follower (not at the
        # linger's end): their reports come within moments.
        deadline = time.monotonic() + 10
        while any(p.ack.outcome is None for p in engine_of(other).pending):
            assert time.monotonic() < deadline, "the other run's appends waited the linger"
            time.sleep(0.01)
        other.barrier()
        other_id, run_id = other.run_id, run.run_id
    assert took < 10, f"{took:.1f} s: the barrier waited for the 20 s linger"
    assert _user_messages(s, run_id) == ["m0"]
    assert _user_messages(s, other_id) == [f"o{i}" for i in range(50)]
