"""The conformance harness's driver: one set of attacks, run on every framework integration.

An integration is plugged in by an adapter (``oai.py``, ``pai.py``, ``lg.py``) that builds
the same scripted agent in its framework and runs (or resumes) one run to its end:

* a scripted model (the framework's own test model) proposes ``Script.steps`` charges, one
  per model turn, then answers ``done``. Call ids are new at every request (as a real
  provider's), one per turn, repeated (``call_0`` at every turn) or missing; the charges'
  arguments are distinct or all the same (two legitimate charges of one amount);
* the ``charge`` tool is irreversible (optionally approval-required); it applies its effect
  to the ``Receiver`` (Redis, outside every worker, not deduplicating: each apply counts,
  recorded with its key) and its reconciler (when the script has one) looks the key up there.
  The receiver is fenced (``receiver="fenced"``): it refuses a request whose fencing token is
  below the highest it has seen for the key, and the lookup raises that floor to the asking
  owner's token first, so a lookup's ``Absent`` is final and recovery may retry on it;
* ``Script.definition`` changes the agent: other instructions and one more tool (v2), or no
  charge tool at all (v3).

Every execution runs in a child process forked from a server that preloaded the adapters
(``multiprocessing``'s forkserver), so a SIGKILL costs no interpreter start. The driver's
attacks: SIGKILLs at seeded random points until the run finishes (``kill_loop``; where they
landed is counted), two resumers released together from a barrier (``race``), a kill while
an execution waits for a person (``kill_while_waiting``), uncertain charges escalated after a
kill and decided by a person from the receiver's truth (``decide_by_truth``), and resumes
with a changed definition. ``check`` then counts, from the receiver alone, the effects, the
doubles (a key applied twice, or more keys than charges) and the losses (fewer keys than
charges), and folds the run's log: sound, finished, succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import redis
from workers.common import assert_log_sound, read_log

import runlog
from runlog import aio
from runlog._settings import Settings
from runlog.log._clients import redis_client
from runlog.projections._run_state import RunState

ADAPTERS = ("oai", "pai", "lg")
Ids = Literal["random", "fresh", "repeated", "missing"]


@dataclass(frozen=True)
class Script:
    """What the scripted model does and how the agent is defined."""

    steps: int = 4
    ids: Ids = "random"
    """random: a new id at every request, as a real provider gives; fresh: one per turn."""
    same_args: bool = False
    lookup: bool = True
    """The charge has a reconciler (else an uncertain charge waits for a person)."""
    definition: Literal["v1", "v2", "v3"] = "v1"
    """v2: other instructions and one more (never called) tool than v1; v3: v2 without the
    charge tool (a definition the run's recorded turns cannot be replayed on)."""
    approval: bool = False
    """The charge needs a person's approval first (the framework's own approval flag)."""
    session: bool = False
    """Agents SDK only: the conversation in a ``RunlogSession`` (history in the log)."""
    pace_s: float = 0.02
    """How long the model thinks and the tool waits before and after its effect."""

    def call_id(self, turn: int) -> str | None:
        if self.ids == "random":
            return f"c-{uuid.uuid4().hex[:10]}"
        if self.ids == "fresh":
            return f"c-{turn}"
        return "call_0" if self.ids == "repeated" else None

    def args(self, turn: int) -> dict[str, int]:
        return {"order": 42 if self.same_args else turn, "cents": 100}


@dataclass(frozen=True)
class Spec:
    """One execution of a run, in a child process."""

    adapter: str
    run_id: str
    script: Script
    settings: Settings
    exec_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    takeover: bool = True
    wait_s: float | None = None
    approval_wait_s: float = 0.0


class Receiver:
    """The charge's counterparty: every apply counts, by key, per run (and a phase marker a
    driver may wait for). Lives in Redis, so a SIGKILLed worker can neither lose nor fake it."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.r, self.prefix = client, f"{prefix}conf:"

    def _k(self, run_id: str, what: str) -> str:
        return f"{self.prefix}{run_id}:{what}"

    def apply(self, run_id: str, key: str, token: int | None) -> bool:
        """Count the effect unless ``token`` is below the key's floor (then refuse: False)."""
        keys = [self._k(run_id, "floors"), self._k(run_id, "applied")]
        return bool(self.r.eval(_FENCED_APPLY, 2, *keys, key, -1 if token is None else token))

    def raise_floor(self, run_id: str, key: str, token: int | None) -> None:
        """A lookup's first half: refuse ``key``'s requests below ``token`` from now on."""
        if token is not None:
            self.r.eval(_RAISE_FLOOR, 1, self._k(run_id, "floors"), key, token)

    def found(self, run_id: str, key: str) -> bool:
        return bool(self.r.hexists(self._k(run_id, "applied"), key))

    def applied(self, run_id: str) -> dict[str, int]:
        got = self.r.hgetall(self._k(run_id, "applied"))
        return {k.decode(): int(v) for k, v in got.items()}

    def phase(self, run_id: str, text: str) -> None:
        self.r.rpush(self._k(run_id, "phases"), text)

    def phases(self, run_id: str) -> list[str]:
        return [p.decode() for p in self.r.lrange(self._k(run_id, "phases"), 0, -1)]

    def charge(self, run_id: str, script: Script, key: str, token: int | None) -> None:
        """The tool's body around the receiver: time to be killed before and after it."""
        self.phase(run_id, "before")
        time.sleep(script.pace_s)
        if not self.apply(run_id, key, token):
            raise runlog.ToolError(f"refused {key}: a newer owner holds the run")
        self.phase(run_id, "after")
        time.sleep(script.pace_s)

    def lookup(
        self, run_id: str, key: str, token: int | None, result: str
    ) -> runlog.Match | runlog.Absent:
        """The charge's reconciler: raise the key's floor to the asking owner's token, then
        answer from the receiver's record."""
        self.raise_floor(run_id, key, token)
        if self.found(run_id, key):
            return runlog.Match(result)
        return runlog.Absent("the receiver has no charge with this key")

    def result(self, exec_id: str) -> dict[str, Any] | None:
        got = self.r.get(f"{self.prefix}result:{exec_id}")
        return None if got is None else dict(json.loads(got))

    def set_result(self, exec_id: str, result: dict[str, Any]) -> None:
        self.r.set(f"{self.prefix}result:{exec_id}", json.dumps(result), ex=3600)


_FENCED_APPLY = """
local floor = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local token = tonumber(ARGV[2])
if token < floor then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
"""

_RAISE_FLOOR = """
local floor = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > floor then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


class Adapter(Protocol):
    def execute(self, spec: Spec, receiver: Receiver) -> dict[str, Any]:
        """Run or resume ``spec.run_id`` to its end in this process: ``{"outcome":
        "finished", "output": ...}``; a runlog error (``Escalated``, ``RunLocked``...) raised."""
        ...


STOPS: tuple[tuple[type[runlog.RunlogError], str], ...] = (
    (runlog.Escalated, "escalated"),
    (runlog.RunLocked, "locked"),
    (runlog.Fenced, "fenced"),
    (runlog.CallUncertain, "uncertain"),
    (runlog.RunlogError, "refused"),
)


def child(spec: Spec, barrier: Any) -> None:
    """A child process's body: one execution, its outcome written to the receiver."""
    import importlib

    adapter: Adapter = importlib.import_module(f"conformance.{spec.adapter}").ADAPTER
    receiver = Receiver(redis_client(spec.settings), spec.settings.redis_key_prefix)
    if barrier is not None:
        barrier.wait(timeout=60)
    try:
        result = adapter.execute(spec, receiver)
    except Exception as exc:  # noqa: BLE001 - every outcome is reported; the driver judges it
        name = next((n for t, n in STOPS if isinstance(exc, t)), "error")
        result = {"outcome": name, "error": f"{type(exc).__name__}: {exc}"}
        if name == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
    receiver.set_result(spec.exec_id, result)


@dataclass
class Counts:
    kills: int = 0
    runs: int = 0
    executions: int = 0
    effects: int = 0
    doubles: int = 0
    losses: int = 0
    escalations: int = 0
    races: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    kill_points: dict[str, int] = field(default_factory=dict)
    """Where the kill loop's kills landed, by what the receiver saw of that execution: no
    charge yet (opening, replaying, recovering, the model), inside a charge (STARTED, the
    effect not yet applied), or after a charge's effect (its completion maybe unrecorded)."""

    def where(self, phases: list[str]) -> None:
        point = "in-charge" if phases[-1:] == ["before"] else "after-a-charge"
        point = point if phases else "before-any-charge"
        self.kill_points[point] = self.kill_points.get(point, 0) + 1

    def line(self, adapter: str, case: str) -> str:
        return (
            f"conformance {adapter} {case}: kills={self.kills} runs={self.runs} "
            f"executions={self.executions} effects={self.effects} doubles={self.doubles} "
            f"losses={self.losses} escalations={self.escalations} races={self.races} "
            f"outcomes={dict(sorted(self.outcomes.items()))} "
            f"kill_points={dict(sorted(self.kill_points.items()))}"
        )


_CTX: Any = None


def context() -> Any:
    """The forkserver context, its server preloaded with every adapter (and so runlog and
    the three frameworks): a child starts in milliseconds instead of seconds."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([f"conformance.{a}" for a in ADAPTERS])
        _CTX = ctx
    return _CTX


def stop_server() -> None:
    """Stop the forkserver this process started (tests stop what they start)."""
    from multiprocessing import forkserver

    if _CTX is not None:
        forkserver._forkserver._stop()


class Harness:
    def __init__(self, adapter: str, settings: Settings, client: redis.Redis, seed: int) -> None:
        self.adapter, self.settings = adapter, settings
        self.receiver = Receiver(client, settings.redis_key_prefix)
        self.rng = random.Random(seed)
        self.counts = Counts()

    def new_run(self) -> str:
        self.counts.runs += 1
        return f"conf-{self.adapter}-{uuid.uuid4().hex[:12]}"

    def spec(self, run_id: str, script: Script, **kw: Any) -> Spec:
        return Spec(self.adapter, run_id, script, self.settings, **kw)

    def spawn(self, spec: Spec, barrier: Any = None) -> Any:
        proc = context().Process(target=child, args=(spec, barrier), daemon=True)
        proc.start()
        self.counts.executions += 1
        return proc

    def outcome(self, spec: Spec, proc: Any, *, error: bool = False) -> dict[str, Any]:
        proc.join(120)
        assert not proc.is_alive(), f"execution {spec.exec_id} hung"
        got = self.receiver.result(spec.exec_id)
        assert got is not None, f"execution {spec.exec_id} exited {proc.exitcode} silently"
        assert error or got["outcome"] != "error", got
        name = str(got["outcome"])
        self.counts.outcomes[name] = self.counts.outcomes.get(name, 0) + 1
        return got

    def kill(self, proc: Any) -> None:
        proc.kill()
        proc.join(30)
        self.counts.kills += 1

    def run_once(self, spec: Spec, *, error: bool = False) -> dict[str, Any]:
        """One execution to its end; ``error``: an error other than runlog's is an outcome.
        An execution fenced because it lost its lease (a renewal starved on a loaded
        machine) stopped as runlog promises; the next one resumes the run."""
        while True:
            got = self.outcome(spec, self.spawn(spec), error=error)
            if got["outcome"] != "fenced":
                return got
            spec = replace(spec, exec_id=uuid.uuid4().hex[:12])

    def kill_loop(self, run_id: str, script: Script, kills: int, window_s: float) -> dict[str, Any]:
        """Execute the run again and again, SIGKILLing each execution at a seeded random
        point within ``window_s`` of its start, until ``kills`` landed; then to its end."""
        landed = 0
        while True:
            spec = self.spec(run_id, script)
            seen = len(self.receiver.phases(run_id))
            proc = self.spawn(spec)
            if landed < kills:
                self._until_kill_point(run_id, script, proc, seen, window_s)
                if proc.is_alive():
                    self.kill(proc)
                    self.counts.where(self.receiver.phases(run_id)[seen:])
                    landed += 1
                    continue
            got = self.outcome(spec, proc)
            if got["outcome"] == "finished":
                return got
            if got["outcome"] == "fenced":
                continue  # it lost its lease (a renewal starved on a loaded machine): resume
            # Only a charge needing approval or without a lookup waits for a person.
            assert got["outcome"] == "escalated", got
            assert script.approval or not script.lookup, got
            assert self.decide_by_truth(run_id) > 0, f"escalated with nothing to decide: {got}"

    def _until_kill_point(
        self, run_id: str, script: Script, proc: Any, seen: int, window_s: float
    ) -> None:
        """Wait for a seeded random kill point of this execution: a moment within
        ``window_s`` of its start (opening, replay, recovery, a model request), or a little
        after its n-th charge began (inside the tool) or ended (its completion being
        recorded, the next model request), n drawn from the charges still to make."""
        how = self.rng.choice(("time", "before", "after"))
        if how == "time":
            proc.join(self.rng.uniform(0.0, window_s))
            return
        left = max(1, script.steps - len(self.receiver.applied(run_id)))
        nth, extra = self.rng.randint(1, left), self.rng.uniform(0.0, 2 * script.pace_s)
        deadline = time.monotonic() + 120
        while proc.is_alive() and time.monotonic() < deadline:
            if self.receiver.phases(run_id)[seen:].count(how) >= nth:
                time.sleep(extra)
                return
            time.sleep(0.002)

    def kill_at(self, run_id: str, script: Script, phase: str, nth: int) -> None:
        """One execution, SIGKILLed once the receiver saw its ``nth`` ``phase`` marker."""
        proc = self.spawn(self.spec(run_id, script))
        deadline = time.monotonic() + 120
        while self.receiver.phases(run_id).count(phase) < nth:
            assert proc.is_alive() or self.receiver.phases(run_id).count(phase) >= nth, (
                "the execution ended before the kill point"
            )
            assert time.monotonic() < deadline, "the kill point was never reached"
            time.sleep(0.005)
        self.kill(proc)

    def kill_while_waiting(self, run_id: str, script: Script) -> None:
        """One execution that waits for a person's decision, SIGKILLed while it waits."""
        proc = self.spawn(self.spec(run_id, script, approval_wait_s=120.0))
        deadline = time.monotonic() + 120
        while not [a for a in self.approvals(run_id) if a.approved is None]:
            assert proc.is_alive(), "the execution ended without asking a person"
            assert time.monotonic() < deadline, "no approval was requested"
            time.sleep(0.05)
        self.kill(proc)

    def race(self, run_id: str, script: Script, wait_s: float) -> list[dict[str, Any]]:
        """Two resumers of the run released together from a barrier."""
        barrier = context().Barrier(2)
        specs = [self.spec(run_id, script, takeover=False, wait_s=wait_s) for _ in range(2)]
        procs = [self.spawn(s, barrier) for s in specs]
        self.counts.races += 1
        return [self.outcome(s, p) for s, p in zip(specs, procs, strict=True)]

    def decide_by_truth(self, run_id: str) -> int:
        """A person settles each undecided approval of the run from the receiver's truth:
        the effect happened (reject: nothing more to do) or not (approve: retry the key)."""
        state = self.state(run_id)
        decided = 0
        for approval in state.approvals.values():
            if approval.approved is not None:
                continue
            happened = self.receiver.found(run_id, approval.idempotency_key or "")
            asyncio.run(
                aio.decide(
                    run_id,
                    approval.approval_id,
                    approved=not happened,
                    decided_by="ops",
                    note="charged already" if happened else "",
                    settings=self.settings,
                )
            )
            decided += 1
        self.counts.escalations += decided
        return decided

    def approvals(self, run_id: str) -> list[Any]:
        """The run's approvals so far (none while it has no events yet)."""
        events = [rec.event for rec in read_log(self.settings, run_id)]
        return list(assert_log_sound(events).approvals.values()) if events else []

    def state(self, run_id: str) -> RunState:
        return assert_log_sound([rec.event for rec in read_log(self.settings, run_id)])

    def check(self, run_id: str, script: Script, *, finished: bool = True) -> RunState:
        """Every charge once, none lost, the run (``finished``) finished and succeeded."""
        applied = self.receiver.applied(run_id)
        self.counts.effects += sum(applied.values())
        doubles = sum(n - 1 for n in applied.values()) + max(0, len(applied) - script.steps)
        losses = max(0, script.steps - len(applied))
        self.counts.doubles += doubles
        self.counts.losses += losses
        state = self.state(run_id)
        assert doubles == 0 and losses == 0, (
            f"run {run_id}: {script.steps} charges expected, applied {applied}"
        )
        if finished:
            assert state.status == "finished" and state.outcome == "succeeded", state.status
        return state


@contextlib.contextmanager
def harness(adapter: str, settings: Settings, client: redis.Redis, case: str) -> Iterator[Harness]:
    seed = int(os.environ.get("RUNLOG_CONFORMANCE_SEED", "7"))
    h = Harness(adapter, settings, client, seed)
    try:
        yield h
    finally:
        print("\n" + h.counts.line(adapter, f"{case} seed={seed}"))


def total_kills() -> int:
    """Kills per integration in the kill loop: 50 in the normal run, more for a soak."""
    return int(os.environ.get("RUNLOG_CONFORMANCE_KILLS", "30"))
