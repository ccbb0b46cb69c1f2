"""``runlog bench scale``: long runs and many runs, each figure beside its reference.

Long runs (one process, the run written through runlog with ``emit`` + ``barrier`` in
batches of 100, as a busy agent writes):

* ``conversation``: 100 model calls over a conversation growing to ~200k tokens, each
  ``MODEL_TURN`` recording only its own output and each tool result only what is new (a
  token counted as 4 characters): bytes on the log per token, against what a history holds
  when every model call records its whole prompt again (computed from the same sizes: the
  Temporal history cap of 50 MB is where such a run ends);
* ``long_run``: an agent loop (user message, model turn, tool call started and completed;
  a ``CONTEXT_COMPACTED`` every 25 turns) to ``events`` records, snapshots on at the
  interval ``runlog snapshot plan``'s formula chooses for a 100 ms recovery: the append
  cost of the first and of the last thousand events (their ratio), the snapshot body's
  size at the end;
* ``resume``: ``open_run`` of a closed run at 4,000 events and at ``events``, without a
  snapshot (full replay) and with one (interval chosen for 50 ms at 4,000 and 100 ms at
  the long run): p50 and p99.

Many runs:

* ``opens_at_once``: ``open_run`` of new runs by 50 and by 500 threads of one process
  released together: p50 and p99;
* ``timers``: ``waiting`` runs started through the fleet (one ``runlog worker``), each
  sleeping on a durable timer due in the same second: once all wait, the leases held, the
  bytes per waiting run in Redis (every key under the scratch prefix) and on the lifecycle
  topic, the worker's resident memory per waiting run, the start-up of a second worker
  beside that lifecycle topic (the first one stopped: waiting holds no worker); then
  every timer's fire, from its due time to the run's RUN_FINISHED: p50, p99, how many
  fired more than once.

Everything runs on scratch topics and keys (deleted afterwards). Figures go to
``scale.json`` in the output directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers import _snapshot_plan as sp
from runlog.errors import RunlogError
from runlog.log._kafka import reader_config
from runlog.log._snapshots import SnapshotStore
from runlog.producers._engine import Engine
from runlog.producers._handle import engine_of
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import lease_key
from runlog.schemas._vocabulary import EventType
from tools.benchmarks.common import TENANT, Scratch, machine, percentile

CHARS_PER_TOKEN = 4
TEMPORAL_HISTORY_CAP_BYTES = 50 * 1024 * 1024
REFERENCES = {
    "append_ratio": "<= 1.2 (issue 45)",
    "resume_4k_p99_ms": "<= 50 ms (issue 45); before: 136 ms full replay, 185 ms with snapshot",
    "resume_long_p99_ms": "<= 100 ms at 100,000 events (issue 45)",
    "snapshot_vs_replay": "snapshot path never slower than the replay it replaces",
    "opens_p99_ms": "<= 100 ms (issue 45); before: p50 34 ms, p99 989 ms with 50 at once",
    "timers": "all fire once, p99 delay stated (issue 45); Cloudflare: 50,000 live instances",
    "million": "append cost flat in the run's length, ratio <= 1.2 (issue 45); Temporal: "
    "a history ends at 51,200 events",
    "waiting": "100,000 waiting runs, no worker and no lease held (issue 45); Cloudflare "
    "Workflows: 50,000 live instances an account",
    "lifecycle": "a worker starting beside 1,000,000 lifecycle records (issue 45)",
    "stepping": "10,000 runs open at once in one worker process, stepping (issue 45)",
    "temporal_cap": "Temporal: 51,200 events or 50 MB; a 209k-token run ended at call 53 of 100",
}


# --------------------------------------------------------------------------- the workload


def _loop_turn(run: Engine, turn: int, *, compact_every: int = 25) -> None:
    """One turn of an agent loop: 4 records (5 with a compaction), emitted (not awaited)."""
    call = f"t{turn}"
    key = f"k{turn:031d}"
    args = '{"invoice":4711}'
    run.emit(EventType.USER_MESSAGE, {"content": f"turn {turn}: reconcile the next invoice"})
    run.emit(
        EventType.MODEL_TURN,
        {
            "text": "I will look the invoice up in the ledger.",
            "tool_calls": [
                {"call_id": call, "name": "ledger", "args_json": args, "idempotency_key": key}
            ],
            "usage": {"input_tokens": 1200, "output_tokens": 40},
        },
    )
    started = run.state.seq + 1
    run.emit(
        EventType.TOOL_CALL_STARTED,
        {
            "call_id": call,
            "name": "ledger",
            "args_json": args,
            "idempotency_key": key,
            "attempt": 1,
            "risk": "safe",
        },
    )
    run.emit(
        EventType.TOOL_CALL_COMPLETED,
        {
            "call_id": call,
            "name": "ledger",
            "started_seq": started,
            "content": '{"invoice": 4711, "lines": 12, "status": "open"}',
            "idempotency_key": key,
            "source": "live",
        },
    )
    if turn % compact_every == compact_every - 1:
        run.emit(EventType.CONTEXT_COMPACTED, {"summary": f"turns to {turn}", "kept_turns": 4})


def _write_loop(
    deps: Any, events: int, *, interval: int = 0, batch: int = 100
) -> tuple[str, list[tuple[int, float, float]], tuple[int, float]]:
    """A closed run of about ``events`` records: its id, [(seq reached, seconds per record
    of the batch with its snapshot write, without it)], (snapshot writes, their seconds)."""
    samples: list[tuple[int, float, float]] = []
    writes, snap_s = 0, 0.0
    with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
        if deps.snapshots is not None:
            deps.snapshots.set_interval(TENANT, run.run_id, interval)
        turn = 0
        while run.state.seq < events:
            t0 = time.perf_counter()
            before = run.state.seq
            while run.state.seq - before < batch - 5 and run.state.seq < events:
                _loop_turn(run, turn)
                turn += 1
            run.barrier()
            appended = time.perf_counter() - t0
            if deps.snapshots is not None:  # as ``append`` does after each durable append
                t1 = time.perf_counter()
                if deps.snapshots.maybe_write(engine_of(run)):
                    snap_s += time.perf_counter() - t1
                    writes += 1
            n = run.state.seq - before
            samples.append((run.state.seq, (time.perf_counter() - t0) / n, appended / n))
        return str(run.run_id), samples, (writes, snap_s)


def _append_rounds(
    deps: Any, long_id: str, interval: int, rounds: int, n: int = 1_000, *, snapshots: bool = True
) -> Any:
    """Seconds per record of ``n`` appends to the long run and to a new run, alternated
    ``rounds`` times (the same batches, snapshot writes included): on a machine whose load
    drifts, a ratio inside each round says whether the cost grows with the run's length,
    where its first and last thousand events, minutes apart, compare two loads."""
    out: dict[str, list[float]] = {"long": [], "new": []}
    for _ in range(rounds):
        for which in ("new", "long"):
            with open_run_with(
                deps, long_id if which == "long" else None, tenant=TENANT, recover=False
            ) as run:
                if deps.snapshots is not None and which == "new":
                    deps.snapshots.set_interval(TENANT, run.run_id, interval)
                t0 = time.perf_counter()
                start = run.state.seq
                turn = start * 10  # call ids of their own
                while run.state.seq - start < n:
                    before = run.state.seq
                    while run.state.seq - before < 95:
                        _loop_turn(run, turn)
                        turn += 1
                    run.barrier()
                    if deps.snapshots is not None and snapshots:
                        deps.snapshots.maybe_write(engine_of(run))
                out[which].append((time.perf_counter() - t0) / (run.state.seq - start))
    return out


def _window_cost(
    samples: list[tuple[int, float, float]], lo: int, hi: int, *, snapshots: bool = True
) -> float:
    """Median seconds per record of the batches that ended in ``(lo, hi]`` (with their
    snapshot writes, or without)."""
    got = [with_s if snapshots else bare for seq, with_s, bare in samples if lo < seq <= hi]
    return statistics.median(got) if got else float("nan")


def conversation(deps: Any, *, calls: int = 100, tokens: int = 200_000) -> dict[str, Any]:
    """100 model calls, the conversation growing to ``tokens``; bytes on the log per token."""
    from confluent_kafka import Consumer, TopicPartition

    new_tokens = tokens // calls
    chunk = ("ledger line 4711: amount 1024.50 EUR, open. " * 200)[: new_tokens * CHARS_PER_TOKEN]
    prompt_bytes = 0  # what a model call's whole input would weigh, growing
    resend_total = 0
    resend_cap_call: int | None = None
    with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
        run_id, part = str(run.run_id), run.partition
        for i in range(calls):
            call, key = f"m{i}", f"m{i:031d}"
            # the model's input is the whole conversation: recorded as its token count only
            run.append(
                EventType.MODEL_TURN,
                {
                    "text": f"call {i}: checking the next ledger page.",
                    "tool_calls": [
                        {"call_id": call, "name": "read", "args_json": "{}", "idempotency_key": key}
                    ],
                    "usage": {"input_tokens": prompt_bytes // CHARS_PER_TOKEN, "output_tokens": 12},
                },
            )
            started = run.state.seq + 1
            run.append(
                EventType.TOOL_CALL_STARTED,
                {
                    "call_id": call,
                    "name": "read",
                    "args_json": "{}",
                    "idempotency_key": key,
                    "attempt": 1,
                    "risk": "safe",
                },
            )
            run.append(
                EventType.TOOL_CALL_COMPLETED,
                {
                    "call_id": call,
                    "name": "read",
                    "started_seq": started,
                    "content": chunk,
                    "idempotency_key": key,
                    "source": "live",
                },
            )
            resend_total += prompt_bytes + len(chunk)  # its prompt again, then the new part
            prompt_bytes += len(chunk) + 40
            if resend_cap_call is None and resend_total > TEMPORAL_HISTORY_CAP_BYTES:
                resend_cap_call = i + 1
        events = run.state.seq
    consumer = Consumer(reader_config(deps.settings))
    size = 0
    try:
        consumer.assign([TopicPartition(deps.settings.events_topic, part, 0)])
        _, high = consumer.get_watermark_offsets(
            TopicPartition(deps.settings.events_topic, part), timeout=10
        )
        pos = 0
        while pos < high:
            for msg in consumer.consume(500, timeout=1):
                if msg.error() is not None:
                    continue
                pos = (msg.offset() or 0) + 1
                if msg.key() == run_id.encode():
                    size += len(msg.value() or b"") + len(msg.key() or b"")
                    raw = msg.headers() or []
                    pairs = raw.items() if isinstance(raw, dict) else raw
                    size += sum(len(k) + len(v or b"") for k, v in pairs)
    finally:
        consumer.close()
    conv_tokens = prompt_bytes // CHARS_PER_TOKEN
    return {
        "model_calls": calls,
        "events": events,
        "conversation_tokens": conv_tokens,
        "log_bytes": size,
        "log_bytes_per_token": size / conv_tokens,
        "resend_history_bytes": resend_total,
        "resend_bytes_per_token": resend_total / conv_tokens,
        "resend_hits_50mb_at_call": resend_cap_call,
    }


# --------------------------------------------------------------------------- resumes


def _resumes(deps: Any, run_id: str, n: int, failed: list[str] | None = None) -> list[float]:
    """Seconds of each of ``n`` opens of a closed run; an open that fails (a replay so long
    that the process's liveness lapsed, and the lease with it) goes to ``failed``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            run = open_run_with(deps, run_id, tenant=TENANT)
        except RunlogError as exc:
            if failed is None:
                raise
            failed.append(f"{type(exc).__name__} after {time.perf_counter() - t0:.1f} s: {exc}")
            continue
        out.append(time.perf_counter() - t0)
        run.close()
    return out


def _caught_up(tail: Any, deps: Any, partitions: int, timeout_s: float = 120) -> None:
    """Until the log tail has read every partition to its head (a worker's tail, live)."""
    reader = deps.reader_factory()
    try:
        heads = {p: reader.high_watermark(p) for p in range(partitions)}
    finally:
        reader.close()
    deadline = time.monotonic() + timeout_s
    for p, head in heads.items():
        while head > 0 and tail.offsets_of(p, b"", head - 1, head - 1, wait_s=1.0) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the log tail did not reach the head of partition {p}")


def long_runs(
    base: Settings,
    *,
    events: int,
    repeats: int,
    echo: Callable[[str], None],
    base_events: int = 4_000,
    calls: int = 100,
) -> dict[str, Any]:
    """``base_events``: the shorter run resumed (4,000 in the issue); ``calls``: model calls
    of the conversation."""
    out: dict[str, Any] = {}
    scratch = Scratch.create(base)
    plain = Services(scratch.settings)
    snap = Services(scratch.settings.model_copy(update={"snapshot_interval": 500}))
    try:
        pdeps, sdeps = plain.run_deps(), snap.run_deps()
        echo(f"scale: conversation of {calls} model calls ...")
        out["conversation"] = conversation(pdeps, calls=calls, tokens=2_000 * calls)
        echo(f"scale: a {base_events}-event run, and the snapshot interval the formula gives ...")
        rid4k, _, _ = _write_loop(pdeps, base_events)
        # The formula's fixed cost is what every resume pays before its replay: the open of
        # a run of a few events (pooled reader, lease, claim), not a fresh reader's.
        tiny, _, _ = _write_loop(pdeps, 5, batch=10)
        fixed_ms = statistics.median(_resumes(pdeps, tiny, 5)) * 1000
        m4k = dataclasses.replace(
            sp.measure(scratch.settings, pdeps.redis, TENANT, rid4k), reader_open_ms=fixed_ms
        )
        plan4k = sp.plan(m4k, events=base_events, recoveries=1, rto_ms=50.0)
        # A body holds the whole state, which grows with the run: its load at the long run's
        # length, scaled from the shorter run's (the formula's input is the load it will pay).
        load_long = m4k.snapshot_load_ms * max(1.0, events / max(1, m4k.events))
        m_long = dataclasses.replace(m4k, snapshot_load_ms=load_long)
        plan_long = sp.plan(m_long, events=events, recoveries=1, rto_ms=100.0)
        k4k = int(plan4k.get("interval") or 500)
        k_long = int(plan_long.get("interval") or 500)
        out["plan"] = {
            "measured_on_events": m4k.events,
            "replay_ms_per_event": m4k.replay_ms_per_event,
            "snapshot_load_ms": m4k.snapshot_load_ms,
            "snapshot_load_ms_long_scaled": load_long,
            "open_fixed_ms": fixed_ms,
            "interval_4k_50ms": k4k,
            "interval_long_100ms": k_long,
            "verdict_4k": plan4k["verdict"],
            "verdict_long": plan_long["verdict"],
        }
        snap4k, _, _ = _write_loop(sdeps, base_events, interval=k4k)
        echo(f"scale: a {events}-event run, snapshot every {k_long} ...")
        t0 = time.perf_counter()
        long_id, samples, (snap_writes, snap_s) = _write_loop(sdeps, events, interval=k_long)
        wrote = time.perf_counter() - t0
        first, last = _window_cost(samples, 0, 1000), _window_cost(samples, events - 1000, events)
        bare_first = _window_cost(samples, 0, 1000, snapshots=False)
        bare_last = _window_cost(samples, events - 1000, events, snapshots=False)
        store = sdeps.snapshots
        assert isinstance(store, SnapshotStore)
        body = sdeps.redis.get(
            sdeps.redis.hget(store.pointer_key(TENANT, long_id), "current") or b"-"
        )
        out["long_run"] = {
            "events": samples[-1][0],
            "write_s": wrote,
            "events_per_s": samples[-1][0] / wrote,
            "first_1000_us_per_event": first * 1e6,
            "last_1000_us_per_event": last * 1e6,
            "append_ratio_last_over_first": last / first,
            "appends_only_ratio_last_over_first": bare_last / bare_first,
            "snapshot_interval": k_long,
            "snapshot_writes": snap_writes,
            "snapshot_write_ms_mean": snap_s / max(1, snap_writes) * 1000,
            "snapshot_body_bytes": len(body or b""),
        }
        echo("scale: 1,000 appends to the long run against a new run, alternated ...")
        rounds = _append_rounds(sdeps, long_id, k_long, 3 if repeats >= 10 else 1)
        per_round = [a / b for a, b in zip(rounds["long"], rounds["new"], strict=True)]
        out["long_run"]["alternated_us_per_event_long"] = [x * 1e6 for x in rounds["long"]]
        out["long_run"]["alternated_us_per_event_new"] = [x * 1e6 for x in rounds["new"]]
        out["long_run"]["alternated_ratio_long_over_new"] = statistics.median(per_round)
        bare = _append_rounds(sdeps, long_id, k_long, len(per_round), snapshots=False)
        out["long_run"]["alternated_ratio_without_snapshot_writes"] = statistics.median(
            [a / b for a, b in zip(bare["long"], bare["new"], strict=True)]
        )
        # Those rounds appended to the long run without the snapshot writes a writer makes at
        # its durable points: its tail is now longer than the interval, which no live writer
        # leaves. The write the next durable point would make, before the resumes time it.
        with open_run_with(sdeps, long_id, tenant=TENANT, recover=False) as caught_up:
            store.maybe_write(engine_of(caught_up))
        echo("scale: resumes ...")
        # As a worker does: its log tail follows its partitions whole, so a resume from a
        # snapshot stops reading after the run's last record instead of at the partition's
        # head (the 4,000-event runs share partitions with the long one written after them).
        for services in (plain, snap):
            tail = services.run_deps().tail
            assert tail is not None
            for p in range(scratch.settings.partitions):
                tail.follow_whole(p)
            _caught_up(tail, services.run_deps(), scratch.settings.partitions)
        res: dict[str, Any] = {}
        nan = float("nan")
        for label, plain_id, snap_id in (
            (str(base_events), rid4k, snap4k),
            (str(events), long_id, long_id),
        ):
            n = repeats if label == str(base_events) else max(3, repeats // 6)
            failed: list[str] = []
            full = _resumes(pdeps, plain_id, n, failed)
            with_snap = _resumes(sdeps, snap_id, repeats, failed)
            res[label] = {
                "replay_p50_ms": percentile(full, 50) * 1000 if full else nan,
                "replay_p99_ms": percentile(full, 99) * 1000 if full else nan,
                "failed": failed,
                "snapshot_p50_ms": percentile(with_snap, 50) * 1000,
                "snapshot_p99_ms": percentile(with_snap, 99) * 1000,
                "samples": [len(full), len(with_snap)],
            }
        out["resume"] = res
    finally:
        snap.close()
        plain.close()
        scratch.cleanup()
    return out


# --------------------------------------------------------------------------- many runs


def _opens(deps: Any, n: int) -> tuple[list[float], list[str]]:
    """``n`` threads released together, each opening a new run: seconds each, and errors."""
    gate = threading.Barrier(n)
    times: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one() -> None:
        gate.wait()
        t0 = time.perf_counter()
        try:
            run = open_run_with(deps, None, tenant=TENANT, recover=False)
            took = time.perf_counter() - t0
            run.close()
            with lock:
                times.append(took)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with lock:
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, errors


def opens_at_once(base: Settings, counts: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in counts:
        scratch = Scratch.create(base)
        services = Services(scratch.settings)
        try:
            deps = services.run_deps()
            open_run_with(deps, None, tenant=TENANT, recover=False).close()  # warm clients
            t0 = time.perf_counter()
            times, errors = _opens(deps, n)
            out[str(n)] = {
                "p50_ms": percentile(times, 50) * 1000,
                "p99_ms": percentile(times, 99) * 1000,
                "max_ms": max(times) * 1000,
                "all_s": time.perf_counter() - t0,
                "opened": len(times),
                "errors": dict(Counter(errors)),
            }
        finally:
            services.close()
            scratch.cleanup()
    return out


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _redis_bytes(client: Any, prefix: str) -> tuple[int, int, Counter[str]]:
    """(keys, bytes by MEMORY USAGE, keys by kind) under ``prefix``."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=2000))
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
    sizes = pipe.execute() if keys else []
    kinds: Counter[str] = Counter()
    for k in keys:
        name = (k.decode() if isinstance(k, bytes) else k)[len(prefix) + 1 :]
        # a run's keys are "{<tenant>:<run id>}:<kind>"; the process's own are "<kind>:..."
        kinds[
            name.rsplit("}", 1)[1].lstrip(":") or "run" if "}" in name else name.split(":")[0]
        ] += 1
    return len(keys), sum(int(s or 0) for s in sizes), kinds


def _lifecycle_bytes(settings: Settings) -> tuple[int, int, int]:
    """(records, bytes of keys and values, distinct keys) on the lifecycle topic."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(reader_config(settings))
    records = size = 0
    keys: set[bytes] = set()
    try:
        tps = []
        highs = {}
        for p in range(settings.partitions):
            tp = TopicPartition(settings.lifecycle_topic, p)
            lo, hi = consumer.get_watermark_offsets(tp, timeout=10)
            if hi > lo:
                tps.append(TopicPartition(settings.lifecycle_topic, p, lo))
                highs[p] = hi
        consumer.assign(tps)
        left = set(highs)
        deadline = time.monotonic() + 120
        while left and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                if msg.error() is not None:
                    continue
                records += 1
                size += len(msg.key() or b"") + len(msg.value() or b"")
                keys.add(msg.key() or b"")
                if (msg.offset() or 0) + 1 >= highs[msg.partition() or 0]:
                    left.discard(msg.partition() or 0)
    finally:
        consumer.close()
    return records, size, len(keys)


def timers(
    base: Settings,
    out_dir: Path,
    *,
    waiting: int,
    echo: Callable[[str], None],
    margin_s: float | None = None,
    fire: bool = True,
    people: int = 0,
) -> dict[str, Any]:
    """``waiting`` runs on durable timers due in one second, through a real worker.
    ``fire`` False: the timers are due a day ahead, and the part ends once the runs wait
    and a fresh worker has started beside them (what waiting costs, not what firing does).
    ``people``: that many of the ``waiting`` runs wait for a person (an approval nobody
    gives) instead of a timer; only with ``fire`` False."""
    if people and fire:
        raise ValueError("runs waiting on people do not fire: people needs fire=False")
    import asyncio

    from runlog import aio
    from runlog.fleet import _lifecycle as lifecycle
    from tools.benchmarks.fleet import Follower, WorkerProcs

    scratch = Scratch.create(base)
    s = scratch.settings
    workers = WorkerProcs(s, out_dir)
    res: dict[str, Any] = {"waiting_runs": waiting, "waiting_on_people": people}
    try:
        workers.spawn("timers", 64)
        wpid = workers.procs["timers"].pid
        lifecycle.writer_for(s).write("r-warm-" + os.urandom(4).hex(), None)
        rss0 = _rss_kib(wpid)
        keys0 = _redis_bytes(_redis(s), s.redis_key_prefix)
        follower = Follower(s, only=frozenset({EventType.RUN_FINISHED, EventType.RUN_RESUMED}))
        # Long enough for every run to start and wait, and for a second worker's start-up.
        due = time.time() + (20 + waiting * 0.01 if margin_s is None else margin_s)
        if not fire:
            due = time.time() + 86_400
        order = {"until": due}

        async def start_all() -> list[str]:
            sem = asyncio.Semaphore(200)

            async def one(agent: str) -> str:
                async with sem:
                    return await aio.start(agent, order, tenant=TENANT, settings=s)

            # ``people`` of them on people, spread evenly among the ones on timers.
            agents = [
                "bench.ask"
                if (i * people) // waiting != ((i + 1) * people) // waiting
                else "bench.nap"
                for i in range(waiting)
            ]
            return list(await asyncio.gather(*(one(a) for a in agents)))

        t0 = time.monotonic()
        rids = asyncio.run(start_all())
        # A run waits once it recorded its timer or its question to a person.
        marks = (EventType.TIMER_STARTED.value, EventType.APPROVAL_REQUESTED.value)
        want = set(rids)
        limit = t0 + 120 + waiting * 0.05
        while True:
            follower.poll(0.2)
            waiting_now = sum(
                any(follower.counts.get(r, Counter())[m] >= 1 for m in marks) for r in want
            )
            if waiting_now == len(want):
                break
            if time.time() > due - 8 or time.monotonic() > limit:
                raise RuntimeError(f"only {waiting_now} of {waiting} runs waiting before due")
        res["all_waiting_s"] = time.monotonic() - t0
        time.sleep(1.0)  # the last leases' releases
        client = _redis(s)
        leases = sum(client.exists(lease_key(s.redis_key_prefix, TENANT, r)) for r in rids[:200])
        res["leases_held_of_200_sampled"] = int(leases)
        res["leases_sampled"] = min(200, len(rids))
        nkeys, rbytes, kinds = _redis_bytes(client, s.redis_key_prefix)
        res["redis_keys"] = nkeys - keys0[0]
        res["redis_bytes_per_waiting_run"] = (rbytes - keys0[1]) / waiting
        res["redis_keys_by_kind"] = dict(kinds)
        lrec, lbytes, lkeys = _lifecycle_bytes(s)
        res["lifecycle_records"] = lrec
        res["lifecycle_bytes_per_waiting_run"] = lbytes / max(1, lkeys)
        res["worker_rss_kib_per_waiting_run"] = (_rss_kib(wpid) - rss0) / waiting
        res["worker_rss_mib"] = _rss_kib(wpid) / 1024
        # Waiting holds no worker: stop this one, time a fresh one's start beside the topic.
        workers.stop()
        t1 = time.monotonic()
        workers.procs.clear()
        workers.spawn("timers-2", 64)
        res["second_worker_startup_s"] = time.monotonic() - t1
        res["second_worker_lifecycle_records"] = lrec
        if not fire:
            follower.close()
            client.close()
            return res
        # Every timer falls due within the same second; each run finishes right after. A
        # fire is a dispatch of the run after its due time: its RUN_RESUMED then.
        finished: dict[str, float] = {}
        deadline = due + 300
        while len(finished) < len(want) and time.time() < deadline:
            for rid in follower.poll(0.2) & want:
                for ev in follower.events[rid]:
                    if ev.type is EventType.RUN_FINISHED:
                        finished.setdefault(rid, ev.occurred_at.timestamp())
        delays = [t - due for t in finished.values()]
        fires: Counter[int] = Counter()
        early: int = 0
        for r in want:
            resumed = [
                ev.occurred_at.timestamp()
                for ev in follower.events.get(r, [])
                if ev.type is EventType.RUN_RESUMED
            ]
            fires[sum(t >= due for t in resumed)] += 1
            early += any(t < due for t in resumed)
        res["fired"] = len(finished)
        res["fires_per_run"] = {str(k): v for k, v in sorted(fires.items())}
        res["fired_twice"] = sum(v for k, v in fires.items() if k > 1)
        res["redispatched_before_due"] = early
        res["timers_started_twice"] = sum(
            follower.counts.get(r, Counter())[EventType.TIMER_STARTED.value] > 1 for r in want
        )
        if delays:
            res["fire_p50_s"] = percentile(delays, 50)
            res["fire_p99_s"] = percentile(delays, 99)
            res["fire_max_s"] = max(delays)
        follower.close()
        client.close()
    finally:
        workers.stop()
        with contextlib.suppress(Exception):
            lifecycle.close_writers(s.bootstrap_servers)
        scratch.cleanup()
    return res


def _redis(settings: Settings) -> Any:
    from runlog.log._clients import redis_client

    return redis_client(settings)


# --------------------------------------------------------------------------- larger sizes


def million_run(base: Settings, *, events: int, echo: Callable[[str], None]) -> dict[str, Any]:
    """One run written to ``events`` records without snapshots (a body of a million-event
    run's state is tens of MB a write), held open throughout (a reopen would replay it
    all): the append cost of its first and last thousand, 1,000 appends to it against
    1,000 to a new run alternated, and its state's size at the end."""
    import orjson

    # Minutes of one thread writing as fast as it can: on a loaded machine the process's
    # 2-second liveness key lapsed between renewals and the writer was fenced. 10 s here.
    scratch = Scratch.create(base, liveness_ttl_ms=max(base.liveness_ttl_ms, 10_000))
    plain = Services(scratch.settings)
    try:
        deps = plain.run_deps()
        echo(f"scale: a {events}-event run without snapshots ...")
        samples: list[tuple[int, float, float]] = []
        rounds: dict[str, list[float]] = {"long": [], "new": []}
        t0 = time.perf_counter()
        with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
            turn = 0
            while run.state.seq < events:
                t1 = time.perf_counter()
                before = run.state.seq
                turn = _appends(run, 95, turn)
                per = (time.perf_counter() - t1) / (run.state.seq - before)
                samples.append((run.state.seq, per, per))
            wrote = time.perf_counter() - t0
            for _ in range(3):
                with open_run_with(deps, None, tenant=TENANT, recover=False) as new:
                    t1 = time.perf_counter()
                    start = new.state.seq
                    _appends(new, 1_000, 0)
                    rounds["new"].append((time.perf_counter() - t1) / (new.state.seq - start))
                t1 = time.perf_counter()
                start = run.state.seq
                turn = _appends(run, 1_000, turn)
                rounds["long"].append((time.perf_counter() - t1) / (run.state.seq - start))
            state_bytes = len(orjson.dumps(run.state.to_dict()))
        last = samples[-1][0]
        first_c = _window_cost(samples, 0, 1000, snapshots=False)
        last_c = _window_cost(samples, last - 1000, last, snapshots=False)
        per_round = [a / b for a, b in zip(rounds["long"], rounds["new"], strict=True)]
        return {
            "events": last,
            "write_s": wrote,
            "events_per_s": last / wrote,
            "first_1000_us_per_event": first_c * 1e6,
            "last_1000_us_per_event": last_c * 1e6,
            "ratio_last_over_first": last_c / first_c,
            "alternated_ratio_long_over_new": statistics.median(per_round),
            "alternated_us_per_event_long": [x * 1e6 for x in rounds["long"]],
            "alternated_us_per_event_new": [x * 1e6 for x in rounds["new"]],
            "state_bytes": state_bytes,
        }
    finally:
        plain.close()
        scratch.cleanup()


def _appends(run: Engine, n: int, turn: int) -> int:
    """About ``n`` records of the agent loop, then a barrier (batches of ~100): the next
    turn's number."""
    start = run.state.seq
    while run.state.seq - start < n:
        before = run.state.seq
        while run.state.seq - before < 95:
            _loop_turn(run, turn)
            turn += 1
        run.barrier()
    return turn


class _PatientWorkers:
    """``runlog worker`` processes that may take minutes to catch up (a lifecycle topic of
    a million records) and run at a concurrency of thousands."""

    def __init__(self, settings: Settings, out: Path) -> None:
        from tools.benchmarks.fleet import WorkerProcs

        self.inner = WorkerProcs(settings, out)

    def spawn(self, name: str, concurrency: int, *, deadline_s: float = 600) -> float:
        """Start a worker; seconds until it says it caught up with the lifecycle topic."""
        import subprocess
        import sys

        from tools.benchmarks.common import worker_env

        w = self.inner
        log_path = w.out / f"scale-{name}.log"
        seen = log_path.stat().st_size if log_path.exists() else 0
        env = worker_env(
            w.settings, RUNLOG_WORKER_SESSION_TIMEOUT_MS=str(w.settings.worker_session_timeout_ms)
        )
        t0 = time.monotonic()
        w.procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runlog.cli",
                "worker",
                "--agents",
                "tools.benchmarks.fleet_agents",
                "--concurrency",
                str(concurrency),
                "--id",
                f"{name}-{os.getpid()}",
                "--drain-s",
                "1",
            ],
            env=env,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )
        while b"caught up" not in log_path.read_bytes()[seen:]:
            if w.procs[name].poll() is not None or time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"worker {name} did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.inner.stop()
        self.inner.procs.clear()


def lifecycle_startup(
    base: Settings, out_dir: Path, *, records: int, echo: Callable[[str], None]
) -> dict[str, Any]:
    """A worker's start-up beside a lifecycle topic of ``records`` records: the history of
    ``records / 4`` runs (requested, open, waiting on a timer, then finished: a tombstone),
    one run in ten left waiting on a timer a day ahead, as compaction has not yet removed
    anything. Against a worker's start-up beside an empty topic, in the same sitting."""
    from datetime import timedelta

    from confluent_kafka import Producer

    from runlog.fleet._lifecycle import Record
    from runlog.producers._writer import producer_config
    from runlog.schemas._keys import new_run_id, partition_for

    scratch = Scratch.create(base)
    s = scratch.settings
    workers = _PatientWorkers(s, out_dir)
    res: dict[str, Any] = {"lifecycle_records": records}
    try:
        res["startup_empty_s"] = workers.spawn("life-empty", 64)
        workers.stop()
        echo(f"scale: writing {records} lifecycle records ...")
        producer = Producer(producer_config(s, {"linger.ms": 20}))
        topic_name = s.lifecycle_topic
        now = codec_now()
        later = now + timedelta(days=1)
        recs = {
            st: Record(
                st, TENANT, "bench.nap", due_at=later if st == "waiting_until" else None
            ).encode()
            for st in ("requested", "open", "waiting_until")
        }
        t0 = time.perf_counter()
        written = waiting = 0
        i = 0
        while written < records:
            rid = new_run_id()
            key = rid.encode()
            part = partition_for(rid, s.partitions)
            left_waiting = i % 10 == 9
            values: list[bytes | None] = [recs["requested"], recs["open"], recs["waiting_until"]]
            if not left_waiting:
                values.append(None)
            for v in values[: records - written]:
                while True:
                    try:
                        producer.produce(topic_name, value=v, key=key, partition=part)
                        break
                    except BufferError:
                        producer.poll(0.05)
                written += 1
            waiting += left_waiting
            i += 1
            if i % 10_000 == 0:
                producer.poll(0)
        if producer.flush(120) != 0:
            raise RuntimeError("lifecycle records not all acknowledged")
        res["write_s"] = time.perf_counter() - t0
        res["runs"] = i
        res["left_waiting"] = waiting
        res["startup_s"] = workers.spawn("life-full", 64)
        pid = workers.inner.procs["life-full"].pid
        res["worker_rss_mib"] = _rss_kib(pid) / 1024
    finally:
        workers.stop()
        scratch.cleanup()
    return res


def codec_now() -> Any:
    from runlog.schemas import _codec as codec

    return codec.now_utc()


def open_stepping(
    base: Settings,
    out_dir: Path,
    *,
    runs: int,
    echo: Callable[[str], None],
    every_s: float = 10,
    hold_s: float = 60,
) -> dict[str, Any]:
    """``runs`` runs open at once in one worker (concurrency ``runs``), each appending every
    ``every_s`` until a common end: how many were open at the same time, the appends per
    second the worker kept while they were, its memory per open run."""
    import asyncio

    from runlog import aio
    from tools.benchmarks.fleet import Follower

    scratch = Scratch.create(base)
    s = scratch.settings
    workers = _PatientWorkers(s, out_dir)
    res: dict[str, Any] = {"runs": runs, "every_s": every_s}
    tick = EventType.MEMORY_WRITTEN.value
    try:
        workers.spawn("stepping", runs)
        pid = workers.inner.procs["stepping"].pid
        rss0 = _rss_kib(pid)
        follower = Follower(s, only=frozenset({EventType.RUN_FINISHED}))
        # Long enough for every run to start (about 4 ms each here) and hold a while.
        until = time.time() + 20 + runs * 0.01 + hold_s
        order = {"steps": 100_000, "every_s": every_s, "until": until}

        async def start_all() -> None:
            sem = asyncio.Semaphore(200)

            async def one() -> str:
                async with sem:
                    return await aio.start("bench.hold", order, tenant=TENANT, settings=s)

            await asyncio.gather(*(one() for _ in range(runs)))

        echo(f"scale: {runs} runs open in one worker ...")
        t0 = time.monotonic()
        asyncio.run(start_all())
        res["start_requests_s"] = time.monotonic() - t0
        # Sample: runs with at least one tick, and ticks in all, every second until the end.
        samples: list[tuple[float, int, int]] = []
        peak_rss = rss0
        while time.time() < until + 5:
            follower.poll(0.5)
            open_now = sum(1 for c in follower.counts.values() if c[tick] >= 1)
            total = sum(c[tick] for c in follower.counts.values())
            samples.append((time.monotonic(), open_now, total))
            peak_rss = max(peak_rss, _rss_kib(pid))
            if len(follower.events) >= runs:  # every run finished
                break
        all_open = [t for t, n, _ in samples if n >= runs]
        res["all_open_after_s"] = (all_open[0] - t0) if all_open else None
        res["max_runs_ticking"] = max((n for _, n, _ in samples), default=0)
        # Appends per second from when every run had ticked to the common end.
        if all_open:
            a = next(x for x in samples if x[0] >= all_open[0])
            b = max(
                (x for x in samples if time.time() - (time.monotonic() - x[0]) <= until),
                key=lambda x: x[0],
                default=a,
            )
            if b[0] > a[0]:
                res["appends_per_s_all_open"] = (b[2] - a[2]) / (b[0] - a[0])
                res["expected_appends_per_s"] = runs / every_s
        res["worker_rss_kib_per_open_run"] = (peak_rss - rss0) / runs
        res["worker_rss_peak_mib"] = peak_rss / 1024
        deadline = time.monotonic() + 120
        while len(follower.events) < runs and time.monotonic() < deadline:
            follower.poll(0.5)
        res["finished"] = len(follower.events)
        follower.close()
    finally:
        workers.stop()
        with contextlib.suppress(Exception):
            from runlog.fleet import _lifecycle as lifecycle

            lifecycle.close_writers(s.bootstrap_servers)
        scratch.cleanup()
    return res


# --------------------------------------------------------------------------- the report


PARTS = ("long", "opens", "timers", "waiting", "million", "lifecycle", "stepping")
"""The parts of ``run``, in order; ``parts`` picks some."""


def run(
    base: Settings,
    *,
    out: Path,
    quick: bool,
    echo: Callable[[str], None] = print,
    events: int | None = None,
    waiting: int | None = None,
    waiting_many: int | None = None,
    million: int | None = None,
    lifecycle_records: int | None = None,
    stepping: int | None = None,
    parts: frozenset[str] | None = None,
) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": "quick" if quick else "full", "machine": machine(base)}
    out.mkdir(parents=True, exist_ok=True)
    want = frozenset(PARTS) if parts is None else parts
    name = "scale.json" if parts is None else f"scale-{'-'.join(sorted(want))}.json"
    t0 = time.perf_counter()

    def part(key: str, measure: Callable[[], dict[str, Any]]) -> None:
        """One part, its figures saved at once: a part that fails (a session lost on an
        overloaded machine) is reported, and the others still run."""
        try:
            res[key] = measure()
        except Exception as exc:  # noqa: BLE001 - reported beside the other parts' figures
            res.setdefault("failed", {})[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
            echo(f"scale: {key} failed: {res['failed'][key]}")
        (out / name).write_text(json.dumps(res, indent=2, sort_keys=True, default=str) + "\n")

    if "long" in want:
        part(
            "long",
            lambda: long_runs(
                base,
                events=events or (10_000 if quick else 100_000),
                repeats=10 if quick else 30,
                echo=echo,
            ),
        )
    if "opens" in want:
        echo("scale: opens at once ...")
        part("opens_at_once", lambda: opens_at_once(base, (50, 500)))
    if "timers" in want:
        echo("scale: runs waiting on timers ...")
        part(
            "timers",
            lambda: timers(base, out, waiting=waiting or (300 if quick else 10_000), echo=echo),
        )
    if "waiting" in want:
        n = waiting_many or (1_000 if quick else 100_000)
        echo(f"scale: {n} runs waiting, half on timers a day ahead, half on people ...")
        part(
            "waiting",
            lambda: timers(base, out, waiting=n, echo=echo, fire=False, people=n // 2),
        )
    if "million" in want:
        part(
            "million",
            lambda: million_run(
                base, events=million or (20_000 if quick else 1_000_000), echo=echo
            ),
        )
    if "lifecycle" in want:
        part(
            "lifecycle",
            lambda: lifecycle_startup(
                base,
                out,
                records=lifecycle_records or (20_000 if quick else 1_000_000),
                echo=echo,
            ),
        )
    if "stepping" in want:
        part(
            "stepping",
            lambda: open_stepping(
                base,
                out,
                runs=stepping or (200 if quick else 10_000),
                echo=echo,
                # 10,000 runs every 30 s: 333 appends/s, a pace one worker keeps.
                every_s=10 if quick else 30,
                hold_s=20 if quick else 90,
            ),
        )
    res["elapsed_s"] = time.perf_counter() - t0
    (out / name).write_text(json.dumps(res, indent=2, sort_keys=True, default=str) + "\n")
    return res


def report(res: dict[str, Any]) -> str:
    """Every figure beside its reference; a section not measured is left out."""
    ref = REFERENCES
    nan = float("nan")
    lines = [f"runlog bench scale ({res['mode']}), {res['machine']['cores']} cores"]
    long = res.get("long")
    if long:
        c = long["conversation"]
        cap = c["resend_hits_50mb_at_call"]
        lines += [
            "long runs",
            f"  conversation: {c['model_calls']} model calls, {c['conversation_tokens']} tokens, "
            f"{c['events']} events, {c['log_bytes'] / 1e6:.2f} MB on the log",
            f"    log bytes per token {c['log_bytes_per_token']:.2f}; every prompt re-recorded: "
            f"{c['resend_history_bytes'] / 1e6:.1f} MB, {c['resend_bytes_per_token']:.0f} "
            f"bytes/token, 50 MB {'at call ' + str(cap) if cap else 'not reached'}"
            f"   [{ref['temporal_cap']}]",
        ]
        lr, p = long["long_run"], long["plan"]
        lines += [
            f"  long run: {lr['events']} events at {lr['events_per_s']:.0f} events/s; snapshot "
            f"every {lr['snapshot_interval']}: {lr['snapshot_writes']} writes of "
            f"{lr['snapshot_write_ms_mean']:.0f} ms, last body {lr['snapshot_body_bytes']} bytes",
            f"    append: first 1000 {lr['first_1000_us_per_event']:.0f} us/event, last 1000 "
            f"{lr['last_1000_us_per_event']:.0f} us/event, ratio "
            f"{lr['append_ratio_last_over_first']:.2f} (appends alone, without the snapshot "
            f"writes: {lr['appends_only_ratio_last_over_first']:.2f})   [{ref['append_ratio']}]",
            f"    1000 appends to the long run / to a new run, alternated (median of rounds): "
            f"{lr['alternated_ratio_long_over_new']:.2f}; without the snapshot writes "
            f"{lr['alternated_ratio_without_snapshot_writes']:.2f}   [{ref['append_ratio']}]",
            f"  formula inputs: replay {p['replay_ms_per_event'] * 1000:.1f} us/event, snapshot "
            f"load {p['snapshot_load_ms']:.1f} ms "
            f"({p.get('snapshot_load_ms_long_scaled', nan):.1f} ms scaled to the long run), "
            f"open {p['open_fixed_ms']:.1f} ms -> interval "
            f"{p['interval_4k_50ms']} for 50 ms, {p['interval_long_100ms']} for 100 ms",
        ]
        # By length (a report read back from JSON has its keys sorted as strings).
        resumes = sorted(long["resume"].items(), key=lambda kv: int(kv[0]))
        for i, (n, r) in enumerate(resumes):
            tag = ref["resume_4k_p99_ms"] if i == 0 else ref["resume_long_p99_ms"]
            lines.append(
                f"  resume at {n} events: full replay p50 {r['replay_p50_ms']:.1f} p99 "
                f"{r['replay_p99_ms']:.1f} ms; from a snapshot p50 {r['snapshot_p50_ms']:.1f} "
                f"p99 {r['snapshot_p99_ms']:.1f} ms   [{tag}; {ref['snapshot_vs_replay']}]"
            )
            for why in r.get("failed", []):
                lines.append(f"    an open failed: {why}")
    opens = res.get("opens_at_once")
    if opens or any(res.get(k) for k in ("timers", "waiting", "million", "lifecycle", "stepping")):
        lines.append("many runs")
    for n, o in (opens or {}).items():
        errs = sum(o["errors"].values())
        lines.append(
            f"  open_run of a new run, {n} threads at once: p50 {o['p50_ms']:.0f} ms, p99 "
            f"{o['p99_ms']:.0f} ms, {o['opened']} opened, {errs} failed   [{ref['opens_p99_ms']}]"
        )
    t = res.get("timers")
    if t:
        lines += [
            f"  {t['waiting_runs']} runs on durable timers: all waiting {t['all_waiting_s']:.1f} s "
            f"after the first start; leases held: {t['leases_held_of_200_sampled']} of "
            f"{t['leases_sampled']} sampled",
            f"    per waiting run: Redis {t['redis_bytes_per_waiting_run']:.0f} bytes, lifecycle "
            f"topic {t['lifecycle_bytes_per_waiting_run']:.0f} bytes, worker "
            f"{t['worker_rss_kib_per_waiting_run']:.2f} KiB "
            f"(worker RSS {t['worker_rss_mib']:.0f} MiB)",
            f"    a fresh worker's start-up beside {t['second_worker_lifecycle_records']} "
            f"lifecycle records (the first one stopped): {t['second_worker_startup_s']:.1f} s",
            f"    timers due in one second: {t['fired']} of {t['waiting_runs']} fired, "
            f"{t['fired_twice']} more than once ({t['redispatched_before_due']} runs also "
            f"dispatched again before due: a lease lost while starting); due to RUN_FINISHED p50 "
            f"{t.get('fire_p50_s', nan):.2f} s, p99 {t.get('fire_p99_s', nan):.2f} s"
            f"   [{ref['timers']}]",
        ]
    w = res.get("waiting")
    if w:
        lines += [
            f"  {w['waiting_runs']} runs waiting ({w.get('waiting_on_people', 0)} on people, "
            f"the rest on timers a day ahead): all waiting "
            f"{w['all_waiting_s']:.0f} s after the first start; leases held "
            f"{w['leases_held_of_200_sampled']} of {w['leases_sampled']} sampled   "
            f"[{ref['waiting']}]",
            f"    per waiting run: Redis {w['redis_bytes_per_waiting_run']:.0f} bytes, lifecycle "
            f"topic {w['lifecycle_bytes_per_waiting_run']:.0f} bytes, worker "
            f"{w['worker_rss_kib_per_waiting_run']:.2f} KiB (worker RSS "
            f"{w['worker_rss_mib']:.0f} MiB); a fresh worker beside "
            f"{w['second_worker_lifecycle_records']} lifecycle records: "
            f"{w['second_worker_startup_s']:.1f} s",
        ]
    m = res.get("million")
    if m:
        lines += [
            f"  a run of {m['events']} events without snapshots: {m['events_per_s']:.0f} "
            f"events/s; first 1000 {m['first_1000_us_per_event']:.0f} us/event, last 1000 "
            f"{m['last_1000_us_per_event']:.0f}, ratio {m['ratio_last_over_first']:.2f}; "
            f"alternated with a new run {m['alternated_ratio_long_over_new']:.2f}; its state "
            f"{m['state_bytes'] / 1e6:.1f} MB   [{ref['million']}]",
        ]
    lc = res.get("lifecycle")
    if lc:
        lines.append(
            f"  a worker's start-up beside {lc['lifecycle_records']} lifecycle records "
            f"({lc['runs']} runs, {lc['left_waiting']} left waiting): {lc['startup_s']:.1f} s, "
            f"against {lc['startup_empty_s']:.1f} s beside none; RSS "
            f"{lc['worker_rss_mib']:.0f} MiB   [{ref['lifecycle']}]"
        )
    st = res.get("stepping")
    if st:
        after = st.get("all_open_after_s")
        lines.append(
            f"  {st['runs']} runs in one worker, each appending every {st['every_s']:.0f} s: "
            f"{st['max_runs_ticking']} open and ticking at once"
            + (f" ({after:.0f} s after the first start)" if after is not None else "")
            + (
                f", {st['appends_per_s_all_open']:.0f} appends/s while all were open "
                f"(their pace: {st['expected_appends_per_s']:.0f})"
                if "appends_per_s_all_open" in st
                else ""
            )
            + f"; worker {st['worker_rss_kib_per_open_run']:.1f} KiB per open run, "
            f"{st['finished']} finished   [{ref['stepping']}]"
        )
    for key, why in res.get("failed", {}).items():
        lines.append(f"  {key}: failed: {why}")
    if "elapsed_s" in res:
        lines.append(f"elapsed {res['elapsed_s']:.0f} s")
    return "\n".join(lines)
