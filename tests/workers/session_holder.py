"""Holds run leases bound to its process's session, for the liveness tests.

Usage: python session_holder.py PREFIX TENANT LIVENESS_MS RUN_ID...
Prints ``held <epoch> ...`` once it holds them all, then answers each line of stdin
(``check``) with ``check <verdict of each lease's authoritative check>``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from runlog._settings import Settings
from runlog.errors import RedisUnavailable
from runlog.producers._lease import Lease, LeaseManager

TESTS = Path(__file__).resolve().parent.parent
LIVENESS_MS = 1000


class Holder:
    """``tests/workers/session_holder.py``: a real process holding session-bound leases."""

    def __init__(self, settings: Settings, runs: list[str], liveness_ms: int = LIVENESS_MS) -> None:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        )
        env["RUNLOG_REDIS_URL"] = settings.redis_url
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "workers" / "session_holder.py"),
                settings.redis_key_prefix,
                "t",
                str(liveness_ms),
                *runs,
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._line()
        assert line[0] == "held", line
        self.epochs = [int(e) for e in line[1:]]

    def _line(self) -> list[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().split()

    def check(self) -> list[bool]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        line = self._line()
        assert line[0] == "check", line
        return [v == "True" for v in line[1:]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def main() -> None:
    prefix, tenant, liveness, *runs = sys.argv[1:]
    client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    mgr = LeaseManager(client, key_prefix=prefix, liveness_ttl_ms=int(liveness))
    leases = []
    for rid in runs:
        got = mgr.try_acquire(tenant, rid, f"holder-{os.getpid()}", 60_000)
        assert isinstance(got, Lease), got
        leases.append(got)
    print("held", *(lease.epoch for lease in leases), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            verdicts = []
            for lease in leases:
                try:
                    verdicts.append(str(lease.locally_valid() or lease.check()))
                except RedisUnavailable:
                    verdicts.append("False")
            print("check", *verdicts, flush=True)


if __name__ == "__main__":
    main()
