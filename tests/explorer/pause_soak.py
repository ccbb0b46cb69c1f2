"""The pause soak: a worker frozen inside an irreversible call, over and over, per receiver.

    python tests/explorer/pause_soak.py [--pauses 10] [--receivers fenced,deadline,...]
        [--parallel 1] [--minutes M]

Runs on any stack (the one ``RUNLOG_BOOTSTRAP_SERVERS`` and ``RUNLOG_REDIS_URL`` name), with
topics and a Redis key prefix of its own, removed at the end. Each pause is the sequence of
``tests/producers/test_calls_receiver_fence.py``: a worker (``workers/agent_worker.py``) holds its
``charge`` request before the receiver commits it and is SIGSTOPped; another worker takes
the run over once the lease expired and settles the call by the recovery rules; the first
one is SIGCONTed and its request goes on. The receiver (``workers.common.Ledger``) honours
what the tool declares. It prints, per receiver: pauses, runs finished, effects doubled,
effects missing from a finished run, late requests refused, retries on a non-final
absence (a tool that declares nothing), and exits 1 if any effect doubled or a retry
followed a non-final absence. ``--parallel N`` runs N pauses at once, each on a run of its
own (each waits for its own run's lease to expire, not for every lease of the soak); the
receivers take turns, and the table is printed every 100 pauses and at the end, so a soak
stopped by ``--minutes`` (no pause starts after that) still says exactly what it ran.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from workers.common import (  # noqa: E402
    Ledger,
    payloads,
    read_log,
    services_for,
    start_worker,
)

from runlog._settings import Settings  # noqa: E402
from runlog._topics import delete_topics, ensure_topics  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.schemas._keys import lease_key, live_key, new_run_id, session_of  # noqa: E402
from runlog.schemas._vocabulary import EventType  # noqa: E402

RECEIVERS = ("fenced", "deadline", "dedupes_by_key", "none")
DEADLINE_WINDOW_S = "6"
"""The deadline receiver's commit window: past a takeover (lease 1.5 s plus a start), so
recovery meets the absence before the deadline and waits it out."""


def wait_run_lease_gone(ledger: Ledger, s: Settings, rid: str, timeout: float = 30.0) -> None:
    """Wait until the run's lease is free: no lease key, or its owner's session is gone."""
    key = lease_key(s.redis_key_prefix, "default", rid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ledger.redis.get(key)
        if value is None:
            return
        session = session_of(value.decode())
        if session is not None and not ledger.redis.exists(live_key(s.redis_key_prefix, session)):
            return
        time.sleep(0.02)
    raise AssertionError(f"the lease of {rid} did not expire")


LOCK = threading.Lock()


def one_pause(s: Settings, receiver: str, ledger: Ledger, tally: Counter[str]) -> None:
    rid = new_run_id()
    extra = ["--receiver", receiver]
    if receiver == "deadline":
        extra += ["--commit-window-s", DEADLINE_WINDOW_S]
    tmp = Path(tempfile.mkdtemp(prefix="pause-soak-"))
    old = start_worker(s, tmp, "old", "--run-id", rid, "--charge-mode", "block-before", *extra)
    try:
        key = old.wait_flag("in-tool")
        old.kill(signal.SIGSTOP)
        try:
            wait_run_lease_gone(ledger, s, rid)
            new = start_worker(s, tmp, "new", "--run-id", rid, "--reconcile", "ledger", *extra)
            new.finish()
        finally:
            old.kill(signal.SIGCONT)
        old.go()
        old.finish()
    finally:
        if old.proc.poll() is None:
            old.proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    events = [r.event for r in read_log(s, rid)]
    finished = any(ev.type is EventType.RUN_FINISHED for ev in events)
    absences = [
        r for r in payloads(events, EventType.RECONCILIATION_ATTEMPTED) if r.outcome == "absent"
    ]
    n = ledger.count(key)
    refused = int(ledger.redis.hget(ledger.refusals, key) or 0)
    with LOCK:
        tally["pauses"] += 1
        tally["refused"] += refused
        tally["effects"] += n
        tally["finished"] += finished
        tally["doubled"] += n > 1
        tally["missing"] += finished and n == 0
        tally["retried_not_final"] += receiver == "none" and any(
            r.action == "retry" for r in absences
        )
        tally["escalated"] += any(r.action == "escalate" for r in absences)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pauses", type=int, default=10, help="pauses per receiver")
    ap.add_argument("--receivers", default=",".join(RECEIVERS))
    ap.add_argument("--parallel", type=int, default=1, help="pauses at once (runs of their own)")
    ap.add_argument("--minutes", type=float, default=0, help="start no pause after this long")
    opts = ap.parse_args()
    prefix = f"t-pause-soak-{uuid.uuid4().hex[:8]}"
    s = Settings().model_copy(
        update={
            "topic_prefix": prefix,
            "redis_key_prefix": prefix,
            "partitions": 3,
            "lease_ttl_ms": 1500,
        }
    )
    ensure_topics(s).raise_for_drift()
    client = redis_client(s)
    failed = False
    receivers = opts.receivers.split(",")
    ledgers = {
        r: Ledger(client, s.redis_key_prefix, None if r == "none" else r)  # type: ignore[arg-type]
        for r in receivers
    }
    tallies: dict[str, Counter[str]] = {r: Counter() for r in receivers}
    stop_at = time.monotonic() + opts.minutes * 60 if opts.minutes else float("inf")
    t0 = time.monotonic()

    def one(receiver: str) -> None:
        if time.monotonic() > stop_at:
            return
        try:
            one_pause(s, receiver, ledgers[receiver], tallies[receiver])
        except AssertionError as exc:  # a worker that hung or exited early
            with LOCK:
                tallies[receiver]["broken"] += 1
            print(f"  {receiver}: {str(exc)[:600]}", file=sys.stderr, flush=True)

    def table() -> None:
        print(f"after {time.monotonic() - t0:.0f} s:")
        print(f"{'receiver':<16}" + "".join(f"{c:>19}" for c in COLUMNS))
        for r in receivers:
            print(f"{r:<16}" + "".join(f"{tallies[r][c]:>19}" for c in COLUMNS), flush=True)

    try:
        with services_for(s), ThreadPoolExecutor(max(1, opts.parallel)) as pool:
            work = [pool.submit(one, r) for _ in range(opts.pauses) for r in receivers]
            for i, f in enumerate(work, start=1):
                f.result()
                if i % 100 == 0:
                    table()
            table()
        for r in receivers:
            failed |= tallies[r]["doubled"] > 0 or tallies[r]["retried_not_final"] > 0
            failed |= tallies[r]["broken"] > 0
    finally:
        delete_topics(s, [s.events_topic, s.quarantine_topic, s.lifecycle_topic, s.keys_topic])
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    return 1 if failed else 0


COLUMNS = (
    "pauses",
    "effects",
    "finished",
    "doubled",
    "missing",
    "refused",
    "escalated",
    "retried_not_final",
    "broken",
)


if __name__ == "__main__":
    sys.exit(main())
