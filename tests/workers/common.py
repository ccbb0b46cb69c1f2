"""Helpers shared by the writer tests and the worker processes they start.

Side effects are counted outside every worker process, in Redis, keyed by idempotency
key: a worker killed with SIGKILL cannot lose or fake the count, and the test reads it
after every worker is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from runlog.log.reader import LogReader, LogRecord
from runlog.projections.run_state import RunState, accept, apply
from runlog.schemas.models import Event
from runlog.schemas.vocabulary import EventType
from runlog.settings import Settings

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
WORKER = Path(__file__).resolve().parent / "agent_worker.py"

# Exit codes of agent_worker.py: how a test observes what stopped a worker.
EXIT_OK = 0
EXIT_FENCED = 3
EXIT_LOCKED = 4
EXIT_ESCALATED = 5
EXIT_UNCERTAIN = 6
EXIT_TOOL_FAILED = 7


# ------------------------------------------------------------------------- effect ledger
class Ledger:
    """The external system a tool changes: a Redis hash per test, outside every worker.

    ``count`` is how many times an effect with that idempotency key was applied;
    ``args`` holds what the effect was (for a reconciler's semantic comparison).
    """

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.redis = client
        self.counts = f"{prefix}:ledger:counts"
        self.args = f"{prefix}:ledger:args"
        self.order = f"{prefix}:ledger:order"

    def apply(self, key: str, args_json: str) -> int:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hincrby(self.counts, key, 1)
        pipe.hset(self.args, key, args_json)
        pipe.rpush(self.order, key)
        n, _, _ = pipe.execute()
        return int(n)

    def count(self, key: str) -> int:
        return int(self.redis.hget(self.counts, key) or 0)

    def total(self) -> int:
        return sum(int(v) for v in self.redis.hvals(self.counts))

    def per_key(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.redis.hgetall(self.counts).items()}

    def found(self, key: str) -> str | None:
        raw = self.redis.hget(self.args, key)
        return None if raw is None else raw.decode()


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


# ------------------------------------------------------------------------- worker processes
def worker_env(settings: Settings, **extra: Any) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RUNLOG_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "RUNLOG_REDIS_URL": settings.redis_url,
            "RUNLOG_TOPIC_PREFIX": settings.topic_prefix,
            "RUNLOG_REDIS_KEY_PREFIX": settings.redis_key_prefix,
            "RUNLOG_PARTITIONS": str(settings.partitions),
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


def start_worker(settings: Settings, tmp: Path, name: str, *args: str, **env: Any) -> Worker:
    cmd = [sys.executable, str(WORKER), "--dir", str(tmp), "--name", name, *args]
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
    """Wait until no run of this test holds a lease (expiry after a pause or a kill)."""
    deadline = time.monotonic() + timeout
    pattern = f"{settings.redis_key_prefix}:*:lease"
    while time.monotonic() < deadline:
        if not any(True for _ in client.scan_iter(match=pattern)):
            return
        time.sleep(0.02)
    raise AssertionError("lease did not expire")


def delete_prefix(client: redis.Redis, prefix: str, *, keep: tuple[str, ...] = ()) -> int:
    """What FLUSHDB would do to this test's keys, leaving other tests' keys alone."""
    keys = [
        k
        for k in client.scan_iter(match=f"{prefix}:*", count=1000)
        if not any(k.decode().startswith(f"{prefix}:{p}") for p in keep)
    ]
    return int(client.delete(*keys)) if keys else 0


@contextlib.contextmanager
def services_for(settings: Settings) -> Iterator[None]:
    """Close this process's shared clients for ``settings`` when the test is done."""
    from runlog.bootstrap import Services

    try:
        yield
    finally:
        key = settings.model_dump_json()
        svc = Services._shared.pop(key, None)
        if svc is not None:
            svc.close()
