"""Replay jobs: the state of one run at any sequence, reading only that run's part of the log.

Where the read starts (snapshot, start index, the run id's time, or a scan) and which
records count are decided by ``runlog.log._fold``, the same code the writer resumes with.
Kafka cannot filter by key on the broker, so records of other runs between the start and
the end are fetched but skipped by key without decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from runlog._settings import Settings
from runlog.log import _metrics as metrics
from runlog.log._fold import Progress, SnapshotSource, Source, read_run
from runlog.log._reader import LogReader
from runlog.projections._run_state import RunState
from runlog.projections._state_view import facts


@dataclass
class ReplayResult:
    run_id: str
    tenant: str
    state: RunState
    partition: int
    source: Source
    start_offset: int | None
    end_offset: int
    """High watermark when the replay began (exclusive)."""
    records: int
    """Records of this run folded on top of the starting state."""
    fenced: int
    duration_ms: float
    snapshot_seq: int | None = None
    snapshot_miss: str | None = None
    """Why an available snapshot was not used, if one was rejected."""

    def summary(self) -> dict[str, Any]:
        st = self.state
        return {
            "run_id": self.run_id,
            "tenant": self.tenant,
            **facts(st, "seq", "epoch", "status", "outcome", "turns", "messages", "compactions"),
            **facts(st, "resumptions", "fenced_writes", "completed_calls", "open_calls"),
            "pending_approvals": len(st.pending_approvals),
            "digest": st.digest(),
            "read": {
                "source": self.source,
                "partition": self.partition,
                "start_offset": self.start_offset,
                "end_offset": self.end_offset,
                "records": self.records,
                "snapshot_seq": self.snapshot_seq,
                "snapshot_miss": self.snapshot_miss,
                "duration_ms": round(self.duration_ms, 3),
            },
        }


def replay(
    settings: Settings,
    client: redis.Redis,
    run_id: str,
    *,
    tenant: str = "default",
    to_seq: int | None = None,
    snapshots: SnapshotSource | None = None,
    reader: LogReader | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """The state of ``run_id`` after its ``to_seq``-th valid event (default: the head)."""
    own = reader is None
    rd = LogReader(settings) if reader is None else reader
    t0 = time.perf_counter()
    try:
        got = read_run(
            rd,
            client,
            settings,
            tenant,
            run_id,
            snapshots=snapshots,
            to_seq=to_seq,
            progress=progress,
        )
        if got.snapshot_seq is not None:
            metrics.gauge("snapshot_seq_gap", got.state.seq - got.snapshot_seq)
        ms = (time.perf_counter() - t0) * 1000
        metrics.incr("events_replayed", got.folded.records)
        metrics.timing("replay_duration_ms", ms)
        return ReplayResult(
            run_id=run_id,
            tenant=tenant,
            state=got.state,
            partition=got.partition,
            source=got.source,
            start_offset=got.start,
            end_offset=got.end,
            records=got.folded.records,
            fenced=len(got.folded.fenced),
            duration_ms=ms,
            snapshot_seq=got.snapshot_seq,
            snapshot_miss=got.snapshot_miss,
        )
    finally:
        if own:
            rd.close()
