"""Shared machinery of the fault tests: workloads, an effect ledger, log verification.

The workload is an agent-like loop per run (user messages, every few a tool call with a
real side effect) driven by threads that share one producer, as many runs in one worker
process do. A worker that stops with a clear error is replaced by a new one (a new
``open_run``), the way a supervisor restarts a crashed worker.

What is checked afterwards, from the log alone (every reader folds it the same way):

* every event acknowledged to a writer (``Run.append``/``call_tool`` returned) is a valid
  event of the run at the seq and epoch the writer was told, and acknowledgements of a
  run came in seq order;
* no event id appears twice (the idempotent producer never duplicates a retried batch);
* acknowledged epochs of a run never go back in time (no double ownership), and every
  ``open_run`` got an epoch above every earlier one (no epoch regression);
* every side effect (counted in a file outside Kafka and Redis) happened at most once
  per idempotency key, and every effect is a completed call in the final state.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import (
    AppendOutcomeUnknown,
    Fenced,
    KafkaUnavailable,
    RedisUnavailable,
    RunLocked,
)
from runlog.log._reader import LogReader, LogRecord
from runlog.producers._engine import Engine, RunDeps
from runlog.producers._opening import open_run_with
from runlog.producers._tools import Absent, Evidence, Match, Tool, ToolError
from runlog.projections._run_state import RunState, apply, is_valid
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

CLEAR_ERRORS: tuple[type[BaseException], ...] = (
    AppendOutcomeUnknown,
    Fenced,
    KafkaUnavailable,
    RedisUnavailable,
    RunLocked,
)
"""How a writer may stop under a fault. Anything else is a bug (an unclear failure)."""


# --------------------------------------------------------------------------- side effects


class EffectLedger:
    """A receiver's record of effects, in a file: outside every worker, Kafka and Redis.

    The receiver does not deduplicate (so a repeated call shows as a duplicate effect);
    its lookup is authoritative, which is what reconciliation needs. It is fenced (the
    writers are threads of this process, so the floors live here): a request whose token
    is below the highest seen for its key is refused, and a lookup raises that floor to
    the asking owner's token first, which makes its "absent" final.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._floors: dict[str, int] = {}
        path.touch()

    def apply(self, key: str, token: int) -> bool:
        line = (key + "\n").encode()
        with self._lock:
            if token < self._floors.get(key, 0):
                return False
            self._floors[key] = token
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line)  # one small O_APPEND write: atomic across processes
            finally:
                os.close(fd)
        return True

    def raise_floor(self, key: str, token: int) -> None:
        with self._lock:
            self._floors[key] = max(self._floors.get(key, 0), token)

    def counts(self) -> Counter[str]:
        return Counter(ln for ln in self.path.read_text().splitlines() if ln)

    def tool(self) -> Tool:
        def effect(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
            if not self.apply(idempotency_key, fencing_token):
                raise ToolError(f"refused {idempotency_key}: a newer owner holds the run")
            return f"done {args['i']}"

        def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Evidence:
            self.raise_floor(idempotency_key, fencing_token)
            if idempotency_key in self.counts():
                return Match(f"done {args['i']}")
            return Absent("no effect with this key in the receiver's ledger")

        return Tool(
            name="effect", fn=effect, risk="irreversible", reconcile=lookup, receiver="fenced"
        )


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Ack:
    """One append a writer was told is durable and owned."""

    run_id: str
    worker: str
    seq: int
    epoch: int
    event_id: str | None
    wall: float
    mono: float


@dataclass
class Journal:
    """Everything the writers were told, in the order they were told it (thread-safe)."""

    acks: list[Ack] = field(default_factory=list)
    opens: list[tuple[str, str, int, float]] = field(default_factory=list)
    """(run id, worker, epoch, monotonic time) of every successful open_run."""
    stops: Counter[str] = field(default_factory=Counter)
    """Clear errors writers stopped with, by type name."""
    unclear: list[str] = field(default_factory=list)
    """Errors that are not clear (a bug): type and message."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ack(self, run: Engine, worker: str, event_id: str | None) -> None:
        with self.lock:
            self.acks.append(
                Ack(
                    run.run_id,
                    worker,
                    run.state.seq,
                    run.epoch,
                    event_id,
                    time.time(),
                    time.monotonic(),
                )
            )


def messages_done(state: RunState) -> int:
    return sum(1 for m in state.messages if m.role == "user" and m.content.startswith("m"))


def drive_once(
    deps: RunDeps,
    run_id: str,
    worker: str,
    journal: Journal,
    ledger: EffectLedger,
    *,
    target: int,
    tool_every: int = 4,
    pace_s: float = 0.0,
    stop: threading.Event | None = None,
) -> bool:
    """One worker's life on one run; True when the run finished.

    It finishes at ``target`` messages, or earlier once ``stop`` is set (the fault
    injector is done: the workload ran for as long as the faults did).
    """
    run = open_run_with(deps, run_id, tools=[ledger.tool()], goal="fault test")
    with journal.lock:
        journal.opens.append((run_id, worker, run.epoch, time.monotonic()))
    with run:
        if run.state.status == "finished":
            return True
        done = messages_done(run.state)
        while done < target and not (stop is not None and stop.is_set()):
            ev = run.append(EventType.USER_MESSAGE, content=f"m{done}")
            journal.ack(run, worker, ev.event_id)
            if done % tool_every == 0:
                run.call_tool("effect", {"run": run_id, "i": done})
                journal.ack(run, worker, None)
            done += 1
            if pace_s:
                time.sleep(pace_s)
        ev = run.finish("completed", f"{done} messages")
        journal.ack(run, worker, ev.event_id)
        return True


def supervise(
    settings: Settings,
    run_ids: list[str],
    journal: Journal,
    ledger: EffectLedger,
    *,
    target: int,
    deadline_s: float,
    pace_s: float = 0.0,
    contenders: int = 1,
    stop: threading.Event | None = None,
    on_progress: Callable[[], None] | None = None,
) -> dict[str, bool]:
    """Drive every run to ``target`` with ``contenders`` threads each, replacing stopped ones.

    Every worker has its own ``Services`` (producer, Redis pool), like a process; a
    replacement gets fresh ones, like a restarted process. With two contenders per run,
    both keep trying to own it: the lease must let only one write at a time.
    """
    finished: dict[str, bool] = {}
    deadline = time.monotonic() + deadline_s

    def loop(run_id: str, contender: int) -> None:
        generation = 0
        while time.monotonic() < deadline:
            generation += 1
            worker = f"{run_id[-6:]}-c{contender}g{generation}"
            services = Services(settings, writer_id=worker)
            try:
                if drive_once(
                    services.run_deps(),
                    run_id,
                    worker,
                    journal,
                    ledger,
                    target=target,
                    pace_s=pace_s,
                    stop=stop,
                ):
                    finished[run_id] = True
                    return
            except CLEAR_ERRORS as exc:
                with journal.lock:
                    journal.stops[type(exc).__name__] += 1
                time.sleep(0.3)
            except Exception as exc:  # noqa: BLE001 - an unclear failure is the finding
                with journal.lock:
                    journal.unclear.append(f"{worker}: {type(exc).__name__}: {exc}")
                return
            finally:
                _close_quietly(services)
        finished.setdefault(run_id, False)

    threads = [
        threading.Thread(target=loop, args=(r, c), daemon=True)
        for r in run_ids
        for c in range(contenders)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline + 5:
        if on_progress is not None:
            on_progress()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=1)
    for r in run_ids:
        finished.setdefault(r, False)
    return finished


def _close_quietly(services: Services) -> None:
    with contextlib.suppress(Exception):  # closing a broken worker's clients: best effort
        services.close()


# --------------------------------------------------------------------------- verification


@dataclass
class RunCheck:
    run_id: str
    records: int = 0
    valid: int = 0
    fenced: int = 0
    acked: int = 0
    lost: list[str] = field(default_factory=list)
    """Acknowledged events missing from the valid log, or seen at another seq/epoch."""
    violations: list[str] = field(default_factory=list)
    """Duplicates, double ownership, epoch regressions, repeated effects."""
    state: RunState = field(default_factory=RunState)


def read_log(settings: Settings, run_id: str) -> list[LogRecord]:
    with LogReader(settings) as reader:
        return list(reader.read(run_id))


def verify_run(
    settings: Settings,
    run_id: str,
    journal: Journal,
    records: list[LogRecord] | None = None,
) -> RunCheck:
    recs = read_log(settings, run_id) if records is None else records
    check = RunCheck(run_id, records=len(recs))
    ids = Counter(r.event.event_id for r in recs)
    for event_id, n in ids.items():
        if n > 1:
            check.violations.append(f"event {event_id} is in the log {n} times")
    state = RunState()
    valid_at: dict[int, tuple[int, str]] = {}
    for r in recs:
        ok = is_valid(state, r.event)
        apply(state, r.event)
        if ok:
            valid_at[r.event.seq] = (r.event.epoch, r.event.event_id)
    check.state = state
    check.valid = len(valid_at)
    check.fenced = state.fenced_writes
    acks = [a for a in journal.acks if a.run_id == run_id]
    check.acked = len(acks)
    for a in acks:
        got = valid_at.get(a.seq)
        if got is None:
            check.lost.append(f"acked seq {a.seq} epoch {a.epoch} ({a.worker}) is not valid")
        elif got[0] != a.epoch or (a.event_id is not None and got[1] != a.event_id):
            check.lost.append(
                f"acked seq {a.seq} epoch {a.epoch} ({a.worker}) is epoch {got[0]} in the log"
            )
    by_time = sorted(acks, key=lambda a: a.mono)
    for prev, nxt in itertools.pairwise(by_time):
        if nxt.epoch < prev.epoch:
            check.violations.append(
                f"double ownership: {nxt.worker} acked epoch {nxt.epoch} after "
                f"{prev.worker} acked epoch {prev.epoch}"
            )
        if nxt.epoch == prev.epoch and nxt.seq <= prev.seq and nxt.event_id is not None:
            check.violations.append(f"acks out of order: seq {nxt.seq} after {prev.seq}")
    opens = sorted((o for o in journal.opens if o[0] == run_id), key=lambda o: o[3])
    for prev_o, nxt_o in itertools.pairwise(opens):
        if nxt_o[2] <= prev_o[2]:
            check.violations.append(
                f"epoch regression: {nxt_o[1]} opened at epoch {nxt_o[2]} after "
                f"{prev_o[1]} had epoch {prev_o[2]}"
            )
    return check


def verify_effects(ledger: EffectLedger, states: list[RunState]) -> list[str]:
    """Each key's effect at most once, and every effect a completed call of some run."""
    problems: list[str] = []
    counts = ledger.counts()
    completed: set[str] = set()
    for st in states:
        completed.update(st.completed_calls)
        for key, call in st.open_calls.items():
            problems.append(f"call {key} of {st.run_id} still open ({call.status})")
    for key, n in counts.items():
        if n > 1:
            problems.append(f"effect {key} happened {n} times")
        if key not in completed:
            problems.append(f"effect {key} happened but no run records it as completed")
    return problems


# --------------------------------------------------------------------------- cluster


def _admin(settings: Settings) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient(settings.kafka_common())


def partition_leaders(settings: Settings) -> dict[int, tuple[int, list[int]]]:
    """partition -> (leader node id, ISR) of the events topic."""
    md = _admin(settings).list_topics(settings.events_topic, timeout=10)
    t = md.topics[settings.events_topic]
    return {p: (pm.leader, list(pm.isrs)) for p, pm in t.partitions.items()}


def wait_full_isr(settings: Settings, replicas: int = 3, timeout: float = 120.0) -> float:
    """Wait until every partition of the events topic has a leader and a full ISR."""
    t0 = time.monotonic()
    while True:
        try:
            parts = partition_leaders(settings)
            if parts and all(ldr >= 0 and len(isr) >= replicas for ldr, isr in parts.values()):
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - metadata may fail while a node restarts; poll again
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"ISR not back to {replicas} after {timeout:.0f}s: {parts!r}")
        time.sleep(0.5)


def final_open(settings: Settings, run_id: str, ledger: EffectLedger) -> RunState:
    """A last reader-writer: resume the run (settling uncertain calls) and return its state."""
    services = Services(settings, writer_id="final-check")
    try:
        with open_run_with(services.run_deps(), run_id, tools=[ledger.tool()]) as run:
            return run.state
    finally:
        _close_quietly(services)


@dataclass
class FaultReport:
    """What was injected and what was lost, for the session summary."""

    faults: Counter[str] = field(default_factory=Counter)
    stops: Counter[str] = field(default_factory=Counter)
    acked: int = 0
    records: int = 0
    fenced_writes: int = 0
    stale_writes: int = 0
    lost: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)

    def add_checks(self, checks: list[RunCheck]) -> None:
        for c in checks:
            self.acked += c.acked
            self.records += c.records
            self.fenced_writes += c.fenced
            self.lost.extend(f"{c.run_id}: {x}" for x in c.lost)
            self.violations.extend(f"{c.run_id}: {x}" for x in c.violations)

    def add_journal(self, journal: Journal) -> None:
        self.stops.update(journal.stops)
        self.violations.extend(f"unclear error: {u}" for u in journal.unclear)

    def to_json(self) -> str:
        return json.dumps(
            {
                "faults_injected": dict(self.faults),
                "writers_stopped_by": dict(self.stops),
                "acked_appends": self.acked,
                "records_read_back": self.records,
                "fenced_writes_excluded": self.fenced_writes,
                "stale_writes_after_takeover": self.stale_writes,
                "lost": self.lost,
                "violations": self.violations,
                "notes": self.notes,
                "test_seconds": {k: round(v, 1) for k, v in self.durations.items()},
            },
            indent=2,
        )


@dataclass
class Workload:
    """What a fault test drives and then checks: its runs, the journal of what their
    writers were told, and the effects their tool changed; timed from its start."""

    settings: Settings
    run_ids: list[str]
    journal: Journal
    ledger: EffectLedger
    started: float

    @classmethod
    def start(cls, settings: Settings, runs: int, effects: Path) -> Workload:
        run_ids = [new_run_id() for _ in range(runs)]
        return cls(settings, run_ids, Journal(), EffectLedger(effects), time.monotonic())

    def supervise(self, **how: Any) -> dict[str, bool]:
        """:func:`supervise` on this workload's runs (``how``: its keyword arguments)."""
        return supervise(self.settings, self.run_ids, self.journal, self.ledger, **how)

    def check(
        self, name: str, report: FaultReport, finished: dict[str, bool], *, timed_as: str
    ) -> None:
        """:func:`finish_and_check`, then the time since the start as ``timed_as``."""
        args = (self.settings, self.run_ids, self.journal, self.ledger, report, finished)
        finish_and_check(name, *args)
        report.durations[timed_as] = time.monotonic() - self.started


def finish_and_check(
    name: str,
    settings: Settings,
    run_ids: list[str],
    journal: Journal,
    ledger: EffectLedger,
    report: FaultReport,
    finished: dict[str, bool],
) -> None:
    """Verify every run, record the outcome, and fail on any loss or violation."""
    states = [final_open(settings, r, ledger) for r in run_ids]
    checks = [verify_run(settings, r, journal) for r in run_ids]
    effects = verify_effects(ledger, states)
    report.add_checks(checks)
    report.add_journal(journal)
    report.violations.extend(f"{name}: {e}" for e in effects)
    lost = [x for c in checks for x in c.lost]
    violations = [x for c in checks for x in c.violations] + effects + journal.unclear
    assert all(finished.values()), f"runs did not finish: {finished}, stops {journal.stops}"
    assert not lost, lost
    assert not violations, violations
    for c, st in zip(checks, states, strict=True):
        assert st.status == "finished" and st.digest() == c.state.digest()
