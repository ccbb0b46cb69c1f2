"""``runlog demo`` (``make demo``): three `runlog worker` processes, killed and paused.

Starts the runs with ``runlog.start`` (durable requests), starts three workers, and every
few seconds SIGKILLs one at random and starts a new one, or SIGSTOPs one (a frozen process,
its refund in flight) long enough for the others to take its runs over, then SIGCONTs it:
its late requests reach the ledger after the takeover, and the ledger refuses them by their
fencing token. Nobody resumes anything by hand: the workers that own the dead or frozen
one's partitions take its runs once its leases expire. At the end it prints a report read
from the log and the ledger (never from its own memory of what happened): per run, its
status, how often it was resumed and by how many workers it was written; the ledger's count
of every effect and of the late requests it refused; and ``verify`` of every run. It exits
1 unless every run finished, every effect happened exactly once, and every run verifies.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from runlog._api import start
from runlog._settings import Settings
from runlog.consumers._verify import verify_run
from runlog.log._clients import redis_client
from runlog.log._reader import LogReader
from runlog.projections._run_state import fold
from runlog.schemas._models import Event
from tools import child_env

DEMO_LEASE_TTL_MS = "3000"
DEMO_SESSION_MS = "6000"
PAUSE_S = 9.0
"""How long a paused worker stays frozen: past its session (its partitions move) and its
leases (its runs are taken over), so its in-flight request lands after the takeover."""
TENANT = "demo"
AGENT = "demo.refunds"


def _spawn(env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runlog.cli",
            "worker",
            "--agents",
            "tools.demo.agents",
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


def _in_flight(
    reader: LogReader, rids: list[str], names: set[str], within_s: float = 10.0
) -> tuple[str, str, str] | None:
    """A worker (among ``names``) with a call in flight, its run and the call's key: the
    run's log holds the call's STARTED, written by that worker (a worker's ``--id`` is its
    writer id), and no completion. Looked for until ``within_s`` has passed."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        for rid in rids:
            evs = _events(reader, rid)
            st = fold(evs)
            for call in st.open_calls.values():
                if call.status != "started":
                    continue
                mine = (e for e in evs if e.seq == call.started_seq and e.epoch == st.epoch)
                writer = next((e.writer_id for e in mine), "")
                if writer in names:
                    return writer, rid, call.idempotency_key
    return None


def _events(reader: LogReader, rid: str) -> list[Event]:
    return [r.event for r in reader.read(rid, partition=reader.partition_of(rid), start=0)]


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: importing it registers its agent, and every CLI process
    # imports this module (a worker would advertise the demo's agent).
    from tools.demo.agents import ledger_key

    env = child_env()  # the workers import tools.demo.agents
    env.setdefault("RUNLOG_LEASE_TTL_MS", DEMO_LEASE_TTL_MS)
    env.setdefault("RUNLOG_WORKER_SESSION_TIMEOUT_MS", DEMO_SESSION_MS)
    settings = Settings()
    rng = random.Random(args.seed)
    client = redis_client(settings)
    client.delete(*(ledger_key(settings, w) for w in ("effects", "results", "floors", "refused")))
    batch = uuid.uuid4().hex[:6]
    workers: dict[str, subprocess.Popen[bytes]] = {}
    killed: list[dict[str, Any]] = []
    paused: list[dict[str, Any]] = []
    frozen: dict[str, float] = {}  # worker -> when to SIGCONT it
    # Popped from the end: the pauses first, while every run still has calls to make.
    faults = ["kill"] * args.kills + ["pause"] * args.pauses
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
    rids = [start(AGENT, o, tenant=TENANT, settings=settings) for o in orders]
    print(f"{len(rids)} runs requested (runlog.start); no process is told which", flush=True)
    deadline = time.monotonic() + args.timeout_s
    logs: dict[str, list[Event]] = {}
    try:
        with LogReader(settings) as reader:
            first = True
            while time.monotonic() < deadline:
                if not first:  # the first fault lands once the workers hold runs
                    time.sleep(rng.uniform(2.0, 4.0))
                first = False
                woke = False
                for name, due in list(frozen.items()):
                    if time.monotonic() >= due:
                        woke = True  # its late requests land after this: look once more
                        workers[name].send_signal(signal.SIGCONT)
                        del frozen[name]
                        print(f"SIGCONT {name}: its late requests reach the ledger", flush=True)
                logs = {rid: _events(reader, rid) for rid in rids}
                done = sum(fold(evs).status == "finished" for evs in logs.values())
                print(
                    f"  {done}/{len(rids)} finished, {len(killed)} workers killed, "
                    f"{len(paused)} paused",
                    flush=True,
                )
                if done == len(rids) and not frozen and not woke:
                    break
                alive = [w for w, p in workers.items() if p.poll() is None and w not in frozen]
                if faults and len(alive) > 1 and faults[-1] == "kill":
                    faults.pop()
                    victim = rng.choice(alive)
                    proc = workers[victim]
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                    killed.append({"worker": victim, "pid": proc.pid, "rc": proc.returncode})
                    print(f"SIGKILL {victim} (pid {proc.pid})", flush=True)
                    spawn()
                elif faults and len(alive) > 1:
                    # Frozen inside a call: the log shows its STARTED and no completion.
                    caught = _in_flight(reader, rids, set(alive))
                    if caught is not None:
                        faults.pop()
                        victim, rid, key = caught
                        pid = workers[victim].pid
                        workers[victim].send_signal(signal.SIGSTOP)
                        frozen[victim] = time.monotonic() + PAUSE_S
                        paused.append(
                            {"worker": victim, "pid": pid, "for_s": PAUSE_S, "run_id": rid}
                        )
                        print(
                            f"SIGSTOP {victim} (pid {pid}) for {PAUSE_S:.0f} s, "
                            f"inside the call {key} of {rid}",
                            flush=True,
                        )
                        spawn()
    finally:
        for name in frozen:
            workers[name].send_signal(signal.SIGCONT)  # a frozen process ignores SIGTERM
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workers.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    report = _report(settings, client, rids, orders, logs, killed, ledger_key)
    report["paused"] = paused
    _print(report)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


def _report(
    settings: Settings,
    client: Any,
    rids: list[str],
    orders: list[dict[str, Any]],
    logs: dict[str, list[Event]],
    killed: list[dict[str, Any]],
    ledger_key: Any,
) -> dict[str, Any]:
    """What the log, the ledger and verify say (the demo's own counters are not trusted)."""
    counts = {_text(k): int(v) for k, v in client.hgetall(ledger_key(settings, "effects")).items()}
    refused = sum(int(v) for v in client.hvals(ledger_key(settings, "refused")))
    runs = []
    for rid, order in zip(rids, orders, strict=True):
        evs = logs.get(rid, [])
        st = fold(evs)
        keys = sorted(st.completed_calls)
        runs.append(
            {
                "run_id": rid,
                "order": order["order"],
                "status": st.status,
                "outcome": st.outcome,
                "events": len(evs),
                "resumptions": st.resumptions,
                "writers": sorted({e.writer_id for e in evs}),
                "effects": {k: counts.get(k, 0) for k in keys},
                "verify": verify_run(settings, client, rid, tenant=TENANT).ok,
            }
        )
    expected = sum(len(o["lines"]) + 1 for o in orders)
    finished = sum(r["status"] == "finished" and r["outcome"] == "succeeded" for r in runs)
    each_once = bool(counts) and set(counts.values()) == {1}
    verified = sum(r["verify"] for r in runs)
    failures = []
    if finished != len(runs):
        failures.append(f"{len(runs) - finished} runs did not finish succeeded")
    if len(counts) != expected or not each_once:
        seen = sorted(set(counts.values()))
        failures.append(f"effects: {len(counts)} of {expected}, counts seen {seen}")
    if verified != len(runs):
        failures.append(f"{len(runs) - verified} runs fail verify")
    return {
        "ok": not failures,
        "failures": failures,
        "runs": runs,
        "killed": killed,
        "finished": finished,
        "resumptions": sum(r["resumptions"] for r in runs),
        "effects": {"expected": expected, "applied": len(counts), "each_once": each_once},
        "counts": counts,
        "refused": refused,
        "verified": verified,
    }


def _print(r: dict[str, Any]) -> None:
    runs = r["runs"]
    print()
    print(f"{'run':<30} {'order':<12} {'status':<9} {'resumed':>7} {'workers':>7} effects")
    for x in runs:
        eff = ",".join(str(c) for c in x["effects"].values()) or "-"
        print(
            f"{x['run_id']:<30} {x['order']:<12} {x['status']:<9} {x['resumptions']:>7} "
            f"{len(x['writers']):>7} {eff}"
        )
    print()
    print(
        f"workers killed (SIGKILL): {len(r['killed'])}; paused (SIGSTOP, SIGCONT): "
        f"{len(r.get('paused', []))}; resumptions (after a fault or the timer): {r['resumptions']}"
    )
    print(f"runs finished: {r['finished']}/{len(runs)} (each by whichever worker owned it)")
    e = r["effects"]
    print(f"effects: {e['applied']} of {e['expected']}, each once: {e['each_once']} (the ledger)")
    print(f"late requests the ledger refused by their fencing token: {r['refused']}")
    print(f"verify: {r['verified']} of {len(runs)} runs pass")
    print("OK: every run finished by itself, each effect once" if r["ok"] else "FAILED")
    for f in r["failures"]:
        print(f"  {f}")


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
