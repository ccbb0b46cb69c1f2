"""``runlog snapshot plan``: choose a snapshot interval from measured replay economics.

Measures, on this stack:

* ``c``: replay cost per event on the intended path (fetch from Kafka, skip other runs,
  decode, validate, fold), from a synthetic run written to a scratch topic (or a given
  existing run);
* ``s``: snapshot write cost (body SET + durability wait + pointer swap), and the extra
  cost of deriving each snapshot from the log (open a reader + fold the interval's tail);
* ``load``: snapshot load cost (pointer + body + digest + parse).

Then, for N events, R recoveries (uniform over the run) and a worst-case recovery
objective RTO, the largest interval K whose worst-case recovery ``load + (K-1)·c`` meets
the RTO, and the replay economics: full replay ``R·N/2·c`` versus
``ceil(N/K)·s + R·K/2·c``, with the break-even recovery rate.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from runlog._settings import Settings
from runlog._topics import delete_topics, topic_specs
from runlog.log._clients import REDIS_ERRORS
from runlog.log._fold import fold_range, locate
from runlog.log._reader import LogReader
from runlog.log._snapshots import SnapshotStore


@dataclass
class Measured:
    events: int
    """Records of the measured run."""
    replay_ms_per_event: float
    replay_ms_total: float
    snapshot_put_ms: float
    snapshot_load_ms: float
    reader_open_ms: float
    """Fixed cost of opening a reader and seeking (paid per recovery and per derived write)."""
    state_bytes: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


def measure(
    settings: Settings, client: redis.Redis, tenant: str, run_id: str, *, repeats: int = 3
) -> Measured:
    replay_ms: list[float] = []
    open_ms: list[float] = []
    records = 0
    state = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        reader = LogReader(settings)
        try:
            partition = reader.partition_of(run_id)
            end = reader.high_watermark(partition)
            start = locate(reader, client, settings, tenant, run_id).start
            t1 = time.perf_counter()
            first = fold_range(reader, run_id, partition, start, end, to_seq=1)
            t2 = time.perf_counter()
            folded = fold_range(reader, run_id, partition, start, end)
            t3 = time.perf_counter()
        finally:
            reader.close()
        assert first is not None and folded is not None
        open_ms.append((t1 - t0 + t2 - t1) * 1000)
        replay_ms.append((t3 - t2) * 1000)
        records, state = folded.records, folded.state
    assert state is not None
    if records == 0:
        raise ValueError(f"run {run_id} has no records to measure")
    store = SnapshotStore(client, settings, interval=0, from_log=False)
    put_ms: list[float] = []
    load_ms: list[float] = []
    body_bytes = 0
    try:
        for _ in range(max(5, repeats)):
            t0 = time.perf_counter()
            snap = store.put(tenant, run_id, state, partition=partition, offset=end)
            put_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            store.load(tenant, run_id, partition=partition, count=False)
            load_ms.append((time.perf_counter() - t0) * 1000)
            body_bytes = len(client.get(snap.key) or b"")
    finally:
        with contextlib.suppress(*REDIS_ERRORS):
            store.delete(tenant, run_id)
    total = statistics.median(replay_ms)
    return Measured(
        events=records,
        replay_ms_per_event=total / records,
        replay_ms_total=total,
        snapshot_put_ms=statistics.median(put_ms),
        snapshot_load_ms=statistics.median(load_ms),
        reader_open_ms=statistics.median(open_ms),
        state_bytes=body_bytes,
        source="",
    )


def plan(
    m: Measured, *, events: int, recoveries: float, rto_ms: float, from_log: bool = True
) -> dict[str, Any]:
    """Full replay against snapshot-plus-tail, on measured numbers."""
    c, s, n, r = m.replay_ms_per_event, m.snapshot_put_ms, events, recoveries
    fixed = m.reader_open_ms + m.snapshot_load_ms
    budget = rto_ms - fixed
    full_worst = m.reader_open_ms + n * c
    out: dict[str, Any] = {
        "inputs": {
            "events_per_run": n,
            "recoveries_per_run": r,
            "rto_ms": rto_ms,
            "replay_ms_per_event": round(c, 4),
            "snapshot_write_ms": round(s, 3),
            "snapshot_load_ms": round(m.snapshot_load_ms, 3),
            "reader_open_ms": round(m.reader_open_ms, 3),
            "snapshot_derived_from_log": from_log,
        },
        "full_replay_worst_ms": round(full_worst, 1),
        "full_replay_meets_rto": full_worst <= rto_ms,
        "full_replay_cost_ms": round(r * n / 2 * c, 1),
    }
    if budget <= 0:
        out["interval"] = None
        out["verdict"] = (
            f"no interval meets {rto_ms} ms: opening a reader and loading a snapshot alone "
            f"take {fixed:.1f} ms"
        )
        return out
    k = max(1, min(n, int(budget / c) + 1))
    writes = math.ceil(n / k)
    per_write = s + ((m.reader_open_ms + k * c) if from_log else 0.0)
    snap_cost = writes * per_write + r * k / 2 * c
    saving_per_recovery = (n / 2 - k / 2) * c
    break_even = (writes * per_write / saving_per_recovery) if saving_per_recovery > 0 else None
    out.update(
        {
            "interval": k,
            "worst_case_recovery_ms": round(fixed + (k - 1) * c, 1),
            "snapshot_writes_per_run": writes,
            "snapshot_write_cost_per_run_ms": round(writes * per_write, 1),
            "tail_replay_cost_ms": round(r * k / 2 * c, 1),
            "snapshot_total_cost_ms": round(snap_cost, 1),
            "net_saving_ms": round(r * n / 2 * c - snap_cost, 1),
            "break_even_recoveries_per_run": None if break_even is None else round(break_even, 3),
        }
    )
    if full_worst <= rto_ms:
        out["verdict"] = (
            f"full replay of {n} events already meets {rto_ms} ms (worst {full_worst:.0f} ms); "
            + (
                f"snapshot every {k} only if more than {break_even:.2f} recoveries per run"
                if break_even is not None
                else "snapshots cannot pay off"
            )
        )
    else:
        out["verdict"] = (
            f"snapshot every {k} events: worst-case recovery {fixed + (k - 1) * c:.0f} ms "
            f"<= {rto_ms} ms"
        )
    return out


def scratch_settings(settings: Settings) -> Settings:
    prefix = f"plan-{uuid.uuid4().hex[:8]}"
    return settings.model_copy(
        update={"topic_prefix": prefix, "redis_key_prefix": prefix, "partitions": 1}
    )


def drop_scratch(settings: Settings, client: redis.Redis) -> list[str]:
    """Delete the scratch topics and keys; the topics that could not be deleted (with why)."""
    failed = delete_topics(settings, [spec.name for spec in topic_specs(settings)])
    with contextlib.suppress(*REDIS_ERRORS):
        keys = list(client.scan_iter(match=f"{settings.redis_key_prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    return failed
