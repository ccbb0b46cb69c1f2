"""The barrier rule under SIGKILL at every point of a loop of safe and irreversible calls.

Safe calls are pipelined (no wait), irreversible ones wait for their STARTED to be
confirmed before the effect and for their outcome before returning. Killing the worker at
each point in turn (before every produce, after every acknowledgement, after every effect)
and resuming it from the top must leave: every irreversible effect applied exactly once,
every call completed, the log sound and the run finished. The same loop runs on the sync
API and on ``runlog.aio``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from workers import mixed_worker
from workers.common import ROOT, Ledger, assert_log_sound, read_log, worker_env

import runlog
from runlog._settings import Settings
from runlog.log._reader import LogReader
from runlog.producers._handle import engine_of
from runlog.producers._writer import EventWriter
from runlog.schemas._keys import partition_for
from runlog.schemas._vocabulary import EventType

WORKER = ROOT / "tests" / "workers" / "mixed_worker.py"
ROUNDS = 2


def _worker(
    settings: Settings, run_id: str, *, kill_at: int, aio: bool, points: Path | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(WORKER), "--run-id", run_id, "--kill-at", str(kill_at)]
    if aio:
        cmd.append("--aio")
    if points is not None:
        cmd += ["--points", str(points)]
    return subprocess.run(
        cmd, env=worker_env(settings), capture_output=True, text=True, timeout=120
    )


def _check(settings: Settings, ledger: Ledger, run_id: str, where: str) -> None:
    events = [rec.event for rec in read_log(settings, run_id)]
    state = assert_log_sound(events)
    assert state.status == "finished", f"{where}: run not finished ({state.status})"
    assert not state.open_calls, f"{where}: calls left open {sorted(state.open_calls)}"
    pays = {k for k in state.completed_calls if ledger.found(k) and "pay" in _name(events, k)}
    assert len(pays) == ROUNDS, f"{where}: irreversible calls completed: {sorted(pays)}"
    for key in pays:
        assert ledger.count(key) == 1, (
            f"{where}: irreversible effect {key} applied {ledger.count(key)} times"
        )
    looked = [k for k in state.completed_calls if "lookup" in _name(events, k)]
    assert len(looked) == ROUNDS, f"{where}: safe calls completed: {looked}"
    for key in looked:
        assert ledger.count(key) >= 1, f"{where}: safe effect {key} never happened"


def _name(events: list, key: str) -> str:
    for ev in events:
        if getattr(ev.payload, "idempotency_key", None) == key and hasattr(ev.payload, "name"):
            return str(ev.payload.name)
    return ""


@pytest.mark.timeout(900)  # two dozen SIGKILLed worker processes, on a shared machine
@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_sigkill_at_every_point_of_a_mixed_loop(
    fast: Settings, ledger: Ledger, tmp_path: Path, aio: bool
) -> None:
    counted = tmp_path / "points"
    clean = f"mixed-{uuid.uuid4().hex[:8]}"
    done = _worker(fast, clean, kill_at=0, aio=aio, points=counted)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(fast, ledger, clean, "uninterrupted")
    total = int(counted.read_text())
    # open (RUN_STARTED), per round a safe call (2 produces + 1 effect) and an
    # irreversible one (2 produces, 2 acknowledgements, 1 effect), finish (1 + 1)
    assert total >= 2 + ROUNDS * 8 + 2, total
    for k in range(1, total + 1):
        run_id = f"mixed-{k}-{uuid.uuid4().hex[:8]}"
        killed = _worker(fast, run_id, kill_at=k, aio=aio)
        assert killed.returncode == -9, (
            f"point {k}: exit {killed.returncode}\n{killed.stderr[-3000:]}"
        )
        # The successor is this process: the same loop, re-executed from the top.
        tools = mixed_worker.make_tools(ledger, mixed_worker.Points(0), aio=aio)
        if aio:
            asyncio.run(mixed_worker.run_aio(run_id, tools, fast))
        else:
            mixed_worker.run_sync(run_id, tools, fast)
        _check(fast, ledger, run_id, f"killed at point {k} of {total}")


def test_a_confirmation_reads_nothing_when_the_log_tail_shows_only_its_own_records(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run writes between this run's records in the same partition, so the
    writer's own offsets are not contiguous: the process's log tail shows that no record of
    this run but its own stands in between, and the tool runs without a read-back."""

    def pay_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return "paid"

    pay = runlog.tool("pay", risk="irreversible")(pay_fn)
    a = runlog.open_run(settings=fast, tools=[pay])
    tag = uuid.uuid4().hex[:6]
    other = next(
        rid
        for rid in (f"neighbour-{tag}-{i}" for i in itertools.count())
        if partition_for(rid, fast.partitions) == engine_of(a).partition
    )
    b = runlog.open_run(other, settings=fast)
    assert engine_of(b).partition == engine_of(a).partition
    reads: list[str] = []
    original = LogReader.read

    def counted(self: LogReader, run_id: str, *args: Any, **kw: Any) -> Any:
        reads.append(run_id)
        return original(self, run_id, *args, **kw)

    monkeypatch.setattr(LogReader, "read", counted)
    for i in range(5):
        b.append(EventType.USER_MESSAGE, content=f"between {i}")
        assert a.call_tool("pay", {"i": i}) == "paid"
    assert reads == [], f"confirmations read the log back: {reads}"
    a.finish("succeeded")
    b.finish("succeeded")
    state = assert_log_sound([rec.event for rec in read_log(fast, a.run_id)])
    assert len(state.completed_calls) == 5 and sorted(ledger.per_key().values()) == [1] * 5


def test_a_confirmation_needs_no_tail_when_the_writer_acknowledged_every_record_between(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run of this process writes between this run's records in the same partition,
    and the run has no log tail: every offset in between is one this process's producer
    had acknowledged, so the confirmation reads nothing. A record of another producer in
    between (another process's) cannot be accounted for that way: that confirmation reads
    the log back, and the call still runs once."""

    def pay_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return "paid"

    pay = runlog.tool("pay", risk="irreversible")(pay_fn)
    a = runlog.open_run(settings=fast, tools=[pay])
    engine_of(a).deps = dataclasses.replace(engine_of(a).deps, tail=None)
    tag = uuid.uuid4().hex[:6]
    other = next(
        rid
        for rid in (f"neighbour-{tag}-{i}" for i in itertools.count())
        if partition_for(rid, fast.partitions) == engine_of(a).partition
    )
    b = runlog.open_run(other, settings=fast)
    reads: list[str] = []
    original = LogReader.read

    def counted(self: LogReader, run_id: str, *args: Any, **kw: Any) -> Any:
        reads.append(run_id)
        return original(self, run_id, *args, **kw)

    monkeypatch.setattr(LogReader, "read", counted)
    for i in range(3):
        b.append(EventType.USER_MESSAGE, content=f"between {i}")
        assert a.call_tool("pay", {"i": i}) == "paid"
    assert reads == [], f"confirmations read the log back: {reads}"
    foreign = EventWriter(fast)  # another producer: what it writes is not this writer's
    try:
        foreign.send(
            fast.events_topic, b"elsewhere", b"not an event", [], partition=engine_of(a).partition
        )
        assert foreign.flush(10) == 0
        assert a.call_tool("pay", {"i": 3}) == "paid"
    finally:
        foreign.close(timeout=5)
    assert reads == [a.run_id], "a record of another producer went unread"
    a.finish("succeeded")
    b.finish("succeeded")
    state = assert_log_sound([rec.event for rec in read_log(fast, a.run_id)])
    assert len(state.completed_calls) == 4 and sorted(ledger.per_key().values()) == [1] * 4


def test_the_writer_vouches_only_for_ranges_it_wrote_whole(fast: Settings) -> None:
    """``EventWriter.own_offsets``: the offsets of one key in a range every record of which
    this producer had acknowledged; None once another producer's record stands in it, or the
    range reaches past what was acknowledged."""
    mine, theirs = EventWriter(fast), EventWriter(fast)
    topic, part = fast.events_topic, 0
    try:
        sent = [mine.send(topic, key, b"v", [], partition=part) for key in (b"a", b"b", b"a", b"c")]
        offs = [f.result(timeout=10).offset for f in sent]
        first, last = offs[0], offs[-1]
        assert offs == list(range(first, first + 4)), "the broker gave them consecutive offsets"
        assert mine.own_offsets(topic, part, b"a", first, last) == [first, first + 2]
        assert mine.own_offsets(topic, part, b"z", first, last) == []
        assert mine.own_offsets(topic, part, b"a", first, last + 1) is None, "not written yet"
        foreign = theirs.send(topic, b"a", b"v", [], partition=part).result(timeout=10).offset
        after = mine.send(topic, b"a", b"v", [], partition=part).result(timeout=10).offset
        assert after > foreign > last
        assert mine.own_offsets(topic, part, b"a", first, after) is None, "another's record"
        assert mine.own_offsets(topic, part, b"a", after, after) == [after]
        assert theirs.own_offsets(topic, part, b"a", foreign, foreign) == [foreign]
    finally:
        mine.close(timeout=5)
        theirs.close(timeout=5)
