"""Helpers shared by the writer tests and the worker processes they start.

Side effects are counted outside every worker process, in Redis, keyed by idempotency
key: a worker killed with SIGKILL cannot lose or fake the count, and the test reads it
after every worker is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._reader import LogReader, LogRecord
from runlog.producers._tools import Receiver, Risk
from runlog.projections._run_state import RunState, accept, apply
from runlog.schemas._keys import live_key, session_of
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
WORKER = Path(__file__).resolve().parent / "agent_worker.py"
EFFECTS_WORKER = WORKER.with_name("effects_worker.py")

# Exit codes of the worker processes: how a test observes what stopped a worker.
EXIT_OK = 0
EXIT_FENCED = 3
EXIT_LOCKED = 4
EXIT_ESCALATED = 5
EXIT_UNCERTAIN = 6
EXIT_TOOL_FAILED = 7
EXIT_FINISHED = 8
"""``RunFinished``: the run had already finished (with another outcome)."""

# What a worker reports when an error of the run stops it: outcome name and exit code.
Stops = tuple[tuple[type[runlog.RunlogError], str, int], ...]
STOPPED_BY: Stops = (
    (runlog.Fenced, "Fenced", EXIT_FENCED),
    (runlog.RunLocked, "RunLocked", EXIT_LOCKED),
    (runlog.Escalated, "Escalated", EXIT_ESCALATED),
    (runlog.CallUncertain, "CallUncertain", EXIT_UNCERTAIN),
    (runlog.ToolFailed, "ToolFailed", EXIT_TOOL_FAILED),
)
STOPPED_BY_FINISHING: Stops = (*STOPPED_BY, (runlog.RunFinished, "RunFinished", EXIT_FINISHED))
"""For a worker that may finish a finished run again (with another outcome): one more stop."""


# ------------------------------------------------------------------------- effect ledger
class Ledger:
    """The external system a tool changes: a Redis hash per test, outside every worker.

    ``count`` is how many times an effect with that idempotency key was applied;
    ``args`` holds what the effect was (for a reconciler's semantic comparison).

    It is a receiver that honours runlog's tool contract as ``honours`` says (what a tool
    on it declares as ``receiver=``): ``"fenced"`` (the default) remembers the highest
    fencing token per key, refuses a request below it, and ``found`` with a token (a new
    owner's lookup) raises that floor first; ``"deadline"`` refuses a request after the
    commit deadline it carries, by Redis's clock; ``"dedupes_by_key"`` applies a key once;
    None honours nothing (every request that arrives is applied). The token and deadline
    are the call's (``runlog.current_call()``) unless given. Each check is one Lua script,
    so a refusal and a lookup's floor cannot interleave.
    """

    def __init__(
        self, client: redis.Redis, prefix: str, honours: Receiver | None = "fenced"
    ) -> None:
        self.redis = client
        self.honours = honours
        self.counts = f"{prefix}:ledger:counts"
        self.args = f"{prefix}:ledger:args"
        self.order = f"{prefix}:ledger:order"
        self.floors = f"{prefix}:ledger:floors"
        self.refusals = f"{prefix}:ledger:refused"
        self._apply = client.register_script(_APPLY)
        self._found = client.register_script(_FOUND)

    def apply(
        self,
        key: str,
        args_json: str,
        *,
        token: int | None = None,
        deadline: datetime | None = None,
    ) -> int:
        """The effect's count for ``key`` after this request, 0 if deduplicated, or
        ``REFUSED`` (a stale token or a passed deadline: nothing was applied)."""
        ctx = runlog.current_call()
        token = token if token is not None else (ctx.fencing_token if ctx else None)
        deadline = deadline if deadline is not None else (ctx.commit_deadline if ctx else None)
        fenced = self.honours == "fenced" and token is not None
        timed = self.honours == "deadline" and deadline is not None
        n = self._apply(
            keys=[self.counts, self.args, self.order, self.floors, self.refusals],
            args=[
                key,
                args_json,
                str(token) if fenced else "",
                str(int(deadline.timestamp() * 1_000_000)) if timed and deadline else "",
                "1" if self.honours == "dedupes_by_key" else "0",
            ],
        )
        return int(n)

    def count(self, key: str) -> int:
        return int(self.redis.hget(self.counts, key) or 0)

    def total(self) -> int:
        return sum(int(v) for v in self.redis.hvals(self.counts))

    def per_key(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.redis.hgetall(self.counts).items()}

    def refused(self) -> int:
        """Requests refused (a stale token or a passed deadline), over all keys."""
        return sum(int(v) for v in self.redis.hvals(self.refusals))

    def found(self, key: str, *, token: int | None = None) -> str | None:
        """What the effect under ``key`` was, or None; a fenced ledger given a token (the
        asking owner's: ``runlog.current_call()`` in a reconciler) first raises the key's
        floor to it, so "absent" also means "an older request is refused from now on"."""
        ctx = runlog.current_call()
        token = token if token is not None else (ctx.fencing_token if ctx else None)
        fence = str(token) if self.honours == "fenced" and token is not None else ""
        raw = self._found(keys=[self.args, self.floors], args=[key, fence])
        return None if raw is None else bytes(raw).decode()


REFUSED = -1
"""``Ledger.apply``: the request was refused and applied nothing."""

_APPLY = """
local key, token, deadline = ARGV[1], ARGV[3], ARGV[4]
if token ~= '' then
  local floor = tonumber(redis.call('HGET', KEYS[4], key) or '0')
  if tonumber(token) < floor then
    redis.call('HINCRBY', KEYS[5], key, 1)
    return -1
  end
  redis.call('HSET', KEYS[4], key, token)
end
if deadline ~= '' then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) > tonumber(deadline) then
    redis.call('HINCRBY', KEYS[5], key, 1)
    return -1
  end
end
if ARGV[5] == '1' and redis.call('HEXISTS', KEYS[1], key) == 1 then
  return 0
end
local n = redis.call('HINCRBY', KEYS[1], key, 1)
redis.call('HSET', KEYS[2], key, ARGV[2])
redis.call('RPUSH', KEYS[3], key)
return n
"""

_FOUND = """
local key, token = ARGV[1], ARGV[2]
if token ~= '' then
  local floor = tonumber(redis.call('HGET', KEYS[2], key) or '0')
  if tonumber(token) > floor then redis.call('HSET', KEYS[2], key, token) end
end
return redis.call('HGET', KEYS[1], key)
"""


def fenced_effect(
    client: redis.Redis,
    floors: str,
    key: str,
    token: int,
    *,
    counter: str,
    by_key: bool = True,
    results: str | None = None,
    result: str = "",
) -> bool:
    """A fenced receiver's effect, for the test receivers that keep their own keys: unless
    ``token`` is below the highest seen for ``key`` (``floors``), count the effect (in the
    hash ``counter`` by key, or the plain counter ``counter``) and keep ``result`` in
    ``results``, in one script. False: refused, nothing applied."""
    keys = [floors, counter] + ([results] if results is not None else [])
    mode = "hash" if by_key else "counter"
    return bool(client.eval(_FENCED_EFFECT, len(keys), *keys, key, token, mode, result))


def raise_floor(client: redis.Redis, floors: str, key: str, token: int | None) -> None:
    """A fenced receiver's lookup, first half: from now on, refuse ``key``'s requests with a
    token below ``token`` (the asking owner's; None: the caller has no token to give)."""
    if token is not None:
        client.eval(_RAISE_FLOOR, 1, floors, key, token)


_FENCED_EFFECT = """
local key, token = ARGV[1], tonumber(ARGV[2])
if token < tonumber(redis.call('HGET', KEYS[1], key) or '0') then return 0 end
redis.call('HSET', KEYS[1], key, ARGV[2])
if ARGV[3] == 'hash' then
  redis.call('HINCRBY', KEYS[2], key, 1)
else
  redis.call('INCR', KEYS[2])
end
if KEYS[3] then redis.call('HSET', KEYS[3], key, ARGV[4]) end
return 1
"""

_RAISE_FLOOR = """
if tonumber(ARGV[2]) > tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
"""


# ------------------------------------------------------------------------- reading back
def read_log(settings: Settings, run_id: str) -> list[LogRecord]:
    with LogReader(settings) as reader:
        return list(reader.read(run_id))


def verdicts(events: list[Event]) -> list[tuple[Event, bool]]:
    """Each event with the shared validation rule's verdict, in log order."""
    st = RunState()
    out = []
    for ev in events:
        out.append((ev, accept(st, ev)))
    return out


def fold_log(events: list[Event]) -> RunState:
    st = RunState()
    for ev in events:
        apply(st, ev)
    return st


def valid_types(events: list[Event]) -> list[str]:
    return [ev.type.value for ev, ok in verdicts(events) if ok]


def assert_log_sound(events: list[Event]) -> RunState:
    """Invariants every run's log must satisfy, whatever happened to its writers."""
    good = [ev for ev, ok in verdicts(events) if ok]
    assert good, "no valid events"
    assert [ev.seq for ev in good] == list(range(1, len(good) + 1)), "valid seqs not contiguous"
    assert good[0].type is EventType.RUN_STARTED
    owners: dict[int, set[str]] = {}
    for ev in good:
        owners.setdefault(ev.epoch, set()).add(ev.writer_id)
    assert all(len(w) == 1 for w in owners.values()), f"an epoch with two writers: {owners}"
    epochs = [ev.epoch for ev in good]
    assert epochs == sorted(epochs), "valid epochs went backwards"
    finished = [ev for ev in good if ev.type is EventType.RUN_FINISHED]
    assert len(finished) <= 1 and (not finished or finished[0] is good[-1])
    return fold_log(events)


def payloads(events: list[Event], et: EventType, *, valid_only: bool = True) -> list[Any]:
    pairs = verdicts(events)
    return [ev.payload for ev, ok in pairs if ev.type is et and (ok or not valid_only)]


def valid_events(settings: Settings, run_id: str, *, after_seq: int = 0) -> list[Event]:
    """The run's valid events after ``after_seq``, read back from a log that must be sound."""
    events = [r.event for r in read_log(settings, run_id)]
    assert_log_sound(events)
    return [ev for ev, ok in verdicts(events) if ok and ev.seq > after_seq]


def shape(
    events: list[Event],
    fields: Mapping[EventType, tuple[str, ...]],
    *,
    leave_out: Collection[EventType] = (),
) -> list[tuple[Any, ...]]:
    """Each event as a label followed by the payload fields ``fields`` gives for its type
    (``(label, field, ...)``; the type's name alone for a type it does not name), in order;
    events of a type in ``leave_out`` are left out."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if ev.type in leave_out:
            continue
        label, *names = fields.get(ev.type, (ev.type.value,))
        out.append((label, *(getattr(ev.payload, name) for name in names)))
    return out


def times_out_first(
    name: str, fails: int, answer: str, risk: Risk = "safe"
) -> tuple[runlog.Tool, list[str]]:
    """A tool whose first ``fails`` calls time out, then answer ``answer``; and the
    idempotency key of every call made to it, in order."""
    keys: list[str] = []

    @runlog.tool(name, risk=risk)
    def call(args: dict[str, Any], *, idempotency_key: str) -> str:
        keys.append(idempotency_key)
        if len(keys) <= fails:
            raise TimeoutError("no answer")
        return answer

    return call, keys


# ------------------------------------------------------------------------- worker processes
HOLD_MAX_S = 120.0


class Flags:
    """The worker's side of ``Worker.flag``: files ``<dir>/<name>.<flag>`` a test waits for."""

    def __init__(self, directory: str, name: str) -> None:
        self.dir, self.name = Path(directory), name

    def path(self, flag: str) -> Path:
        return self.dir / f"{self.name}.{flag}"

    def set(self, flag: str, text: str = "") -> None:
        tmp = self.path(flag + ".tmp")
        tmp.write_text(text)
        tmp.rename(self.path(flag))  # atomic: a test never reads half a flag

    def hold(self) -> None:
        """Block until the test writes the ``go`` flag (or a signal ends the process)."""
        deadline = time.monotonic() + HOLD_MAX_S
        while not self.path("go").exists():
            if time.monotonic() > deadline:
                raise SystemExit("held too long without a go")
            time.sleep(0.01)


Scenario = Callable[[runlog.Run, argparse.Namespace, Flags], None]
"""What a worker does with its run once it holds it (``--scenario``)."""


def by_name(*scenarios: Scenario) -> dict[str, Scenario]:
    """A worker's scenarios by ``--scenario`` name: ``scenario_<name>`` is ``<name>``."""
    return {fn.__name__.removeprefix("scenario_"): fn for fn in scenarios}


def worker_parser(
    scenarios: Iterable[str], *, scenario: str, reconcile: str, risk: str
) -> argparse.ArgumentParser:
    """The options every worker takes: its flag directory and name, the run, the scenario,
    how its tool settles an uncertain call, and whether it holds after its calls."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--scenario", choices=sorted(scenarios), default=scenario)
    ap.add_argument("--reconcile", choices=["ledger", "none"], default=reconcile)
    ap.add_argument("--risk", choices=["safe", "reversible", "irreversible"], default=risk)
    ap.add_argument("--hold-after", action="store_true")
    return ap


def stopped_by(exc: Exception, table: Stops = STOPPED_BY) -> tuple[dict[str, Any], int] | None:
    """The result and exit code for an error that stops a worker, or None for a failure."""
    for kind, outcome, code in table:
        if isinstance(exc, kind):
            result: dict[str, Any] = {"outcome": outcome, "error": str(exc)}
            if isinstance(exc, runlog.Escalated):
                result["approval_id"] = exc.approval_id
            return result, code
    return None


def run_worker(
    settings: Settings,
    flags: Flags,
    open_run: Callable[[], runlog.Run],
    scenario: Callable[[runlog.Run], None],
    table: Stops = STOPPED_BY,
) -> int:
    """Open the run, play the scenario, and report what stopped it: the ``opened`` and
    ``result`` flags, the result on stdout, and the exit code (1: the test failed)."""
    result: dict[str, Any] = {"outcome": "ok", "error": ""}
    code = EXIT_OK
    run: runlog.Run | None = None
    try:
        run = open_run()
        flags.set("opened", json.dumps({"epoch": run.epoch, "seq": run.state.seq}))
        scenario(run)
    except Exception as exc:  # noqa: BLE001 - anything not in the table: show it, exit 1
        stopped = stopped_by(exc, table)
        if stopped is None:
            traceback.print_exc()
            return 1
        result, code = stopped
    finally:
        if run is not None:
            try:
                run.close()
            except runlog.RunlogError as exc:  # the outcome above is what the test checks
                print(f"close: {exc}", file=sys.stderr)
    if run is not None:
        result.update(
            run_id=run.run_id,
            epoch=run.epoch,
            seq=run.state.seq,
            status=run.state.status,
            outcome_recorded=run.state.outcome,
            digest=run.state.digest(),
            fenced_writes=run.state.fenced_writes,
        )
    Services.shared(settings).close()
    flags.set("result", json.dumps(result))
    print(json.dumps(result))
    return code


# Faster takeover after a SIGKILL (the broker's minimum session timeout): RUNLOG_KAFKA_EXTRA.
FAST_TAKEOVER = '{"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"}'


KEEP = {"RUNLOG_LEASE_TTL_MS": "8000", "RUNLOG_LIVENESS_TTL_MS": "8000"}
"""Extra environment for a worker that is meant to finish the run: 8 s of lease and liveness
(the smaller of the two applies). ``fast``'s 1.5 s let one stall of a loaded CI machine fence
such a worker (outcome ``fenced``, not the run's end). Workers a test kills keep ``fast``'s,
so the next one takes over soon: a new owner waits out the dead one's TTL, not its own."""


def worker_env(settings: Settings, **extra: Any) -> dict[str, str]:
    """A child process's environment: this one's, with ``settings`` as RUNLOG_* and ``extra``."""
    env = dict(os.environ)
    env.update(
        {
            "RUNLOG_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "RUNLOG_REDIS_URL": settings.redis_url,
            "RUNLOG_TOPIC_PREFIX": settings.topic_prefix,
            "RUNLOG_REDIS_KEY_PREFIX": settings.redis_key_prefix,
            "RUNLOG_PARTITIONS": str(settings.partitions),
            "RUNLOG_REPLICATION_FACTOR": str(settings.replication_factor),
            "RUNLOG_LEASE_TTL_MS": str(settings.lease_ttl_ms),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    dir: Path
    name: str

    def flag(self, name: str) -> Path:
        return self.dir / f"{self.name}.{name}"

    def wait_flag(self, name: str, timeout: float = 30.0) -> str:
        """Wait for the worker to write flag ``name``; fail early if it exits first."""
        path = self.flag(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text()
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(
                    f"worker {self.name} exited {self.proc.returncode} before flag {name!r}\n"
                    f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
                )
            time.sleep(0.01)
        raise AssertionError(f"worker {self.name} did not reach {name!r} in {timeout}s")

    def go(self) -> None:
        """Release a worker waiting in ``hold`` (see agent_worker.hold)."""
        self.flag("go").write_text("go")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(timeout=10)

    def finish(self, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
        """Exit code and the result the worker wrote (empty if it wrote none)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"worker {self.name} hung\n{out}\n{err[-4000:]}") from None
        path = self.flag("result")
        result = json.loads(path.read_text()) if path.exists() else {}
        result["_stdout"], result["_stderr"] = out, err
        return self.proc.returncode, result


def start_worker(
    settings: Settings, tmp: Path, name: str, *args: str, script: Path = WORKER, **env: Any
) -> Worker:
    """A worker process (agent_worker.py unless ``script`` names another) on ``settings``."""
    cmd = [sys.executable, str(script), "--dir", str(tmp), "--name", name, *args]
    proc = subprocess.Popen(
        cmd,
        env=worker_env(settings, **env),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Worker(proc, tmp, name)


def wait_lease_gone(client: redis.Redis, settings: Settings, timeout: float = 15.0) -> None:
    """Wait until no run of this test holds a lease (expiry after a pause or a kill): no
    lease key, or only leases whose owner's session is gone (its liveness key expired)."""
    deadline = time.monotonic() + timeout
    pattern = f"{settings.redis_key_prefix}:*:lease"
    while time.monotonic() < deadline:
        if not any(_held(client, settings, key) for key in client.scan_iter(match=pattern)):
            return
        time.sleep(0.02)
    raise AssertionError("lease did not expire")


def _held(client: redis.Redis, settings: Settings, key: bytes) -> bool:
    value = client.get(key)
    if value is None:
        return False
    session = session_of(value.decode())
    return session is None or bool(client.exists(live_key(settings.redis_key_prefix, session)))


def delete_prefix(client: redis.Redis, prefix: str, *, keep: tuple[str, ...] = ()) -> int:
    """What FLUSHDB would do to this test's keys, leaving other tests' keys alone."""
    keys = [
        k
        for k in client.scan_iter(match=f"{prefix}:*", count=1000)
        if not any(k.decode().startswith(f"{prefix}:{p}") for p in keep)
    ]
    return int(client.delete(*keys)) if keys else 0


@contextlib.contextmanager
def services_for(settings: Settings) -> Iterator[Services]:
    """This process's shared clients for ``settings``, closed when the test is done."""
    try:
        yield Services.shared(settings)
    finally:
        svc = Services._shared.pop(settings.fingerprint(), None)
        if svc is not None:
            svc.close()
