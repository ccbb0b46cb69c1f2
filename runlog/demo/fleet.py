"""``runlog demo fleet``: three `runlog worker` processes, killed at random; no supervisor.

Starts the runs with ``runlog.start`` (durable requests), starts three workers, and every
few seconds SIGKILLs one at random and starts a new one. Nobody resumes anything by hand:
the workers that own the dead one's partitions take its runs once its leases expire. At the
end it prints what the log and the ledger say, and exits 1 unless every run finished, every
effect happened exactly once, and every run verifies.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from runlog.api import start
from runlog.consumers.verify import verify_run
from runlog.log.clients import redis_client
from runlog.log.reader import LogReader
from runlog.projections.run_state import fold
from runlog.settings import Settings

DEMO_LEASE_TTL_MS = "3000"
DEMO_SESSION_MS = "6000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=180)


def _spawn(env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runlog.cli",
            "worker",
            "--agents",
            "runlog.demo.fleet_agents",
            "--concurrency",
            "4",
            "--id",
            name,
            "--drain-s",
            "2",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: importing it registers its agent, and every CLI process
    # imports this module (a worker would advertise the demo's agent).
    from runlog.demo.fleet_agents import ledger_key

    env = dict(os.environ)
    env.setdefault("RUNLOG_LEASE_TTL_MS", DEMO_LEASE_TTL_MS)
    env.setdefault("RUNLOG_WORKER_SESSION_TIMEOUT_MS", DEMO_SESSION_MS)
    settings = Settings()
    rng = random.Random(args.seed)
    client = redis_client(settings)
    client.delete(ledger_key(settings, "effects"), ledger_key(settings, "results"))
    batch = uuid.uuid4().hex[:6]
    workers: dict[str, subprocess.Popen[bytes]] = {}
    n = 0

    def spawn() -> None:
        nonlocal n
        n += 1
        name = f"demo-w{n}-{batch}"
        workers[name] = _spawn(env, name)
        print(f"worker {name} started (pid {workers[name].pid})", flush=True)

    for _ in range(3):
        spawn()
    orders: list[dict[str, Any]] = [
        {"order": f"o{batch}-{i}", "lines": [rng.randint(5, 90) for _ in range(3)], "fee": 2}
        for i in range(args.runs)
    ]
    rids = [start("demo.refunds", o, tenant="demo", settings=settings) for o in orders]
    print(f"{len(rids)} runs requested", flush=True)
    kills, deadline = 0, time.monotonic() + args.timeout_s
    states: dict[str, Any] = {}
    try:
        with LogReader(settings) as reader:
            while time.monotonic() < deadline:
                states = {
                    rid: fold(
                        r.event
                        for r in reader.read(rid, partition=reader.partition_of(rid), start=0)
                    )
                    for rid in rids
                }
                done = sum(st.status == "finished" for st in states.values())
                print(f"  {done}/{len(rids)} finished, {kills} workers killed", flush=True)
                if done == len(rids):
                    break
                if kills < args.kills:
                    alive = [w for w, p in workers.items() if p.poll() is None]
                    victim = rng.choice(alive)
                    workers[victim].send_signal(signal.SIGKILL)
                    workers[victim].wait(10)
                    kills += 1
                    print(f"SIGKILL {victim}", flush=True)
                    spawn()
                time.sleep(rng.uniform(2.0, 4.0))
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workers.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    counts = {_text(k): int(v) for k, v in client.hgetall(ledger_key(settings, "effects")).items()}
    expected = sum(len(o["lines"]) + 1 for o in orders)
    finished = sum(st.status == "finished" for st in states.values())
    resumed = sum(st.resumptions for st in states.values())
    bad = [rid for rid in rids if not verify_run(settings, client, rid, tenant="demo").ok]
    print(f"runs finished: {finished}/{len(rids)}; workers killed: {kills}; resumptions: {resumed}")
    print(f"effects: {len(counts)} of {expected}, each once: {set(counts.values()) <= {1}}")
    print(f"verify: {len(rids) - len(bad)} of {len(rids)} runs pass")
    ok = (
        finished == len(rids)
        and len(counts) == expected
        and set(counts.values()) == {1}
        and not bad
    )
    print("OK: every run finished by itself, each effect once" if ok else "FAILED")
    return 0 if ok else 1


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
