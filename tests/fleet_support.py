"""Helpers of the fleet tests: `runlog worker` processes, their runs, their effects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import redis
from workers.common import ROOT, TESTS, worker_env

from runlog._settings import Settings
from runlog.log._reader import LogReader
from runlog.projections._run_state import RunState, fold

FLEET_ENV = {
    "RUNLOG_WORKER_SESSION_TIMEOUT_MS": "6000",
}


def fleet_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = worker_env(settings, **{**FLEET_ENV, **extra})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


class Fleet:
    """`runlog worker` processes of one test, each logging to its own file."""

    def __init__(self, settings: Settings, tmp: Path, **env: str) -> None:
        self.settings = settings
        self.tmp = tmp
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self._n = 0

    def spawn(
        self,
        *,
        concurrency: int = 8,
        wait: bool = True,
        agents: str = "workers.fleet_agents",
        drain_s: float = 2,
        ready_file: Path | None = None,
    ) -> str:
        self._n += 1
        name = f"w{self._n}"
        path = self.tmp / f"{name}.log"
        out = open(path, "ab")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runlog.cli",
                "worker",
                "--agents",
                agents,
                "--concurrency",
                str(concurrency),
                "--id",
                f"{name}-{os.getpid()}",
                "--drain-s",
                str(drain_s),
                *([] if ready_file is None else ["--ready-file", str(ready_file)]),
            ],
            env=fleet_env(self.settings, **self.env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        self.logs[name] = path
        if wait:
            self.wait_ready(name)
        return name

    def wait_ready(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while "worker ready" not in self.logs[name].read_text(errors="replace"):
            assert self.procs[name].poll() is None, self.tail(name)
            assert time.monotonic() < deadline, self.tail(name)
            time.sleep(0.05)

    def wait_assigned(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while "caught up" not in self.logs[name].read_text(errors="replace"):
            assert self.procs[name].poll() is None, self.tail(name)
            assert time.monotonic() < deadline, self.tail(name)
            time.sleep(0.05)

    def tail(self, name: str, n: int = 4000) -> str:
        return self.logs[name].read_text(errors="replace")[-n:]

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def terminate(self, name: str) -> None:
        """SIGTERM ``name`` (a node drain): the worker drains and exits by itself."""
        self.procs[name].send_signal(signal.SIGTERM)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def states(settings: Settings, run_ids: Iterable[str]) -> dict[str, RunState]:
    """Each run's state, folded from the log by a reader of its own."""
    out = {}
    with LogReader(settings) as reader:
        for rid in run_ids:
            part = reader.partition_of(rid)
            out[rid] = fold(r.event for r in reader.read(rid, partition=part, start=0))
    return out


def wait_finished(
    settings: Settings, run_ids: list[str], timeout: float, fleet: Fleet | None = None
) -> dict[str, RunState]:
    deadline = time.monotonic() + timeout
    while True:
        got = states(settings, run_ids)
        left = [rid for rid, st in got.items() if st.status != "finished"]
        if not left:
            return got
        if time.monotonic() > deadline:
            logs = "" if fleet is None else "\n".join(fleet.tail(n, 1500) for n in fleet.logs)
            raise AssertionError(f"{len(left)} runs not finished, e.g. {got[left[0]]}\n{logs}")
        time.sleep(0.5)


def effects(client: redis.Redis, settings: Settings) -> dict[str, int]:
    raw = client.hgetall(f"{settings.redis_key_prefix}:effects")
    return {k.decode(): int(v) for k, v in raw.items()}


def verify_all(settings: Settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", "verify", "--all"],
        env=fleet_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
