"""Opening a requested run through the process's log tail (a fleet worker's open).

A tail that holds the run's partition from its beginning answers "this run has no record"
without the read from the partition's beginning, and a claim nobody raced is confirmed
from the tail without a read-back. Neither may weaken ownership: a run that has records is
replayed (its epoch floor holds even when Redis forgot), and two workers opening the same
new run at once leave exactly one owner and one effect.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from workers import open_race
from workers.common import Ledger, assert_log_sound, delete_prefix, read_log, verdicts

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._reader import LogReader
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(180)

TRIALS = 6


@pytest.fixture
def whole(fast: Settings) -> Iterator[Services]:
    """A worker's services: its tail follows every partition from the beginning."""
    svc = Services(fast)
    for p in range(fast.partitions):
        svc.tail.follow_whole(p)
    try:
        yield svc
    finally:
        svc.close()


def _counting(deps: RunDeps, reads: list[tuple[str, int | None]]) -> RunDeps:
    """``deps`` whose readers note every ``read`` (the log reads an open makes)."""

    def factory() -> LogReader:
        reader = deps.reader_factory()
        real = LogReader.read

        def read(run_id: str, **kw: Any) -> Any:
            reads.append((run_id, kw.get("start")))
            return real(reader, run_id, **kw)

        reader.read = read  # type: ignore[method-assign]
        return reader

    return dataclasses.replace(deps, reader_factory=factory)


def _caught_up(svc: Services, settings: Settings) -> None:
    """Until the tail has read every partition to its head (a warm worker's tail)."""
    with LogReader(settings) as reader:
        heads = {p: reader.high_watermark(p) for p in range(settings.partitions)}
    deadline = time.monotonic() + 20
    for p, head in heads.items():
        while (got := svc.tail.unseen_below(p, b"-nobody-")) is None or got < head:
            assert time.monotonic() < deadline, f"tail never reached {p}@{head}"
            time.sleep(0.01)


def test_a_new_run_is_opened_from_the_tail_without_reading_the_log(
    fast: Settings, whole: Services
) -> None:
    for _ in range(6):  # other runs' records in every partition: a scan would read them
        with runlog.open_run(settings=fast) as other:
            other.append(EventType.USER_MESSAGE, content="someone else")
    _caught_up(whole, fast)
    reads: list[tuple[str, int | None]] = []
    deps = _counting(whole.run_deps(), reads)
    rid = new_run_id()
    run = open_run_with(deps, rid, agent="a")
    try:
        assert reads == [], f"the open read the log: {reads}"
        assert (run.state.status, run.state.seq) == ("running", 1)
        run.append(EventType.USER_MESSAGE, content="mine")
    finally:
        run.close()
    events = [r.event for r in read_log(fast, rid)]
    state = assert_log_sound(events)
    assert [ev.type for ev in events] == [EventType.RUN_STARTED, EventType.USER_MESSAGE]
    assert state.epoch == run.epoch


def test_a_run_with_records_is_replayed_and_its_epoch_floor_holds(
    fast: Settings, whole: Services, redis_client: redis.Redis
) -> None:
    rid = new_run_id()
    for _ in range(3):  # epochs 1..3 in the log
        with runlog.open_run(rid, settings=fast) as run:
            run.append(EventType.USER_MESSAGE, content="before")
    before = assert_log_sound([r.event for r in read_log(fast, rid)])
    assert before.epoch == 3
    # Redis forgets everything (a restart without persistence): its epoch counter is gone,
    # and so is the run's start index.
    delete_prefix(redis_client, fast.redis_key_prefix)
    _caught_up(whole, fast)
    run = open_run_with(whole.run_deps(), rid, agent="a")
    try:
        assert run.epoch > before.epoch, "the new owner's epoch must exceed the log's"
        assert run.state.seq == before.seq + 1
        assert run.state.status == "running"
        run.append(EventType.USER_MESSAGE, content="after")
    finally:
        run.close()
    events = [r.event for r in read_log(fast, rid)]
    state = assert_log_sound(events)
    assert [ev.type for ev, ok in verdicts(events) if ok].count(EventType.RUN_STARTED) == 1
    assert state.epoch == run.epoch and all(ok for _, ok in verdicts(events))


@pytest.mark.parametrize("stale", ["behind", "behind, Redis forgot", "above the head"])
def test_a_tail_that_has_not_read_the_run_never_starts_it_again(
    fast: Settings,
    whole: Services,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    stale: str,
) -> None:
    """The tail answers what it has read, not the head: a run whose records it has not
    read yet (behind), or a log that went back under it (above the head, a topic made
    again), may look new. The claim reads the run back from the offset the tail named and
    so finds its history, or finds its own record below that offset and never confirms.
    Found that way, a higher epoch in the log than the claim's (Redis forgot) is a newer
    owner as far as the claim can tell: it stands down, and a later open, from the log,
    goes above it."""
    rid = new_run_id()
    for _ in range(2):
        with runlog.open_run(rid, settings=fast) as run:
            run.append(EventType.USER_MESSAGE, content="before")
    before = assert_log_sound([r.event for r in read_log(fast, rid)])
    if "Redis forgot" in stale:
        delete_prefix(redis_client, fast.redis_key_prefix)
    with LogReader(fast) as reader:
        head = reader.high_watermark(reader.partition_of(rid))
    named = head + 1000 if stale == "above the head" else 0
    with monkeypatch.context() as m:
        m.setattr(whole.tail, "unseen_below", lambda partition, key: named)
        if stale == "behind":
            run = open_run_with(whole.run_deps(), rid, agent="a")
            assert run.epoch > before.epoch
            assert (run.state.status, run.state.seq) == ("running", before.seq + 1)
        else:
            with pytest.raises(runlog.Fenced):
                open_run_with(whole.run_deps(), rid, agent="a")
    if stale != "behind":  # the tail answers truly again: the open reads the log
        run = open_run_with(whole.run_deps(), rid, agent="a", wait_s=10)
        assert run.epoch > before.epoch and run.state.status == "running"
    try:
        run.append(EventType.USER_MESSAGE, content="after")
    finally:
        run.close()
    events = [r.event for r in read_log(fast, rid)]
    assert_log_sound(events)
    valid = [ev for ev, ok in verdicts(events) if ok]
    assert [ev.type for ev in valid].count(EventType.RUN_STARTED) == 1, "started twice"
    said = [ev.payload.content for ev in valid if ev.type is EventType.USER_MESSAGE]  # type: ignore[union-attr]
    assert said == ["before", "before", "after"]


@pytest.mark.parametrize("kind", ["free", "takeover"])
def test_two_workers_opening_the_same_new_run_at_once_one_acts(
    fast: Settings, redis_client: redis.Redis, kind: str
) -> None:
    trials = [(new_run_id(), kind) for _ in range(TRIALS)]
    got: dict[str, dict[int, tuple[str, int | None]]] = {}
    with open_race.contenders(fast, trials) as (results, procs):
        for _ in range(2 * len(trials)):
            rid, index, outcome, epoch = results.get(timeout=open_race.RESULT_TIMEOUT_S)
            got.setdefault(rid, {})[index] = (outcome, epoch)
    assert all(p.exitcode == 0 for p in procs)
    for rid, _ in trials:
        outcomes = got[rid]
        winners = [i for i, (o, _) in outcomes.items() if o == "won"]
        assert len(winners) == 1, f"{kind} {rid}: {outcomes}"
        loser = outcomes[1 - winners[0]][0]
        assert loser in (("RunLocked",) if kind == "free" else ("Fenced", "RunLocked")), outcomes
        events = [r.event for r in read_log(fast, rid)]
        state = assert_log_sound(events)
        valid = [ev for ev, ok in verdicts(events) if ok]
        assert [ev.type for ev in valid].count(EventType.RUN_STARTED) == 1
        assert state.outcome == "succeeded" and state.summary == f"contender-{winners[0]}"
        ledger = Ledger(redis_client, f"{fast.redis_key_prefix}:{rid}")
        assert ledger.total() == 1, f"{kind} {rid}: effects {ledger.per_key()}"
        started = [ev for ev in valid if ev.type is EventType.TOOL_CALL_STARTED]
        assert len(started) == 1 and started[0].epoch == outcomes[winners[0]][1]


def test_a_dispatch_the_tail_has_not_caught_up_with_opens_the_run_it_names(
    fast: Settings, whole: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet dispatch opens with ``create=False``: a run with no events is refused. A
    tail that has not read the run yet (a loaded worker's) answers "no record below" an
    offset under the run's records; the open must read on to the head before it refuses,
    or a woken run (a cancel, a timer) is dropped with its history in the log. A run that
    truly has no events is still refused, and nothing is written for it."""
    rid = new_run_id()
    with runlog.open_run(rid, settings=fast) as run:
        run.append(EventType.USER_MESSAGE, content="before")
    before = assert_log_sound([r.event for r in read_log(fast, rid)])
    monkeypatch.setattr(whole.tail, "unseen_below", lambda partition, key: 0)
    run = open_run_with(whole.run_deps(), rid, agent="a", create=False)
    try:
        assert (run.state.status, run.state.seq) == ("running", before.seq + 1)
        assert run.epoch > before.epoch
    finally:
        run.close()
    events = [r.event for r in read_log(fast, rid)]
    assert_log_sound(events)
    assert all(ok for _, ok in verdicts(events)), "the open appended a record the log rejects"
    assert [ev.type for ev in events].count(EventType.RUN_STARTED) == 1

    nobody = new_run_id()
    with pytest.raises(runlog.UnknownRun):
        open_run_with(whole.run_deps(), nobody, agent="a", create=False)
    assert read_log(fast, nobody) == []
