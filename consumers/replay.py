"""Replay jobs: the state of one run at any sequence, reading only that run's part of the log.

Where the read starts, best first:

1. ``snapshot``: a stored snapshot at or below the wanted sequence (validated, and its
   tail must continue it; otherwise it is a cache miss and the next source is used);
2. ``index``: the run's start index in Redis (``<run tag>:start`` = ``partition:offset``,
   written by the writer when RUN_STARTED is acknowledged);
3. ``time``: the creation time embedded in a runlog run id, via ``offsets_for_times``;
4. ``scan``: the partition from its beginning (the only case whose cost grows with the
   other runs in the partition), with a progress bar on stderr.

Kafka cannot filter by key on the broker, so records of other runs between the start and
the end are fetched but skipped by key without decoding.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TextIO

import redis

from runlog.consumers import metrics
from runlog.log.reader import LogReader, LogRecord, start_index
from runlog.projections.run_state import RunState, apply, is_valid
from runlog.schemas.keys import run_id_time_ms
from runlog.settings import Settings

if TYPE_CHECKING:
    from runlog.consumers.snapshots import SnapshotStore

Source = Literal["snapshot", "index", "time", "scan"]
Progress = Callable[[int, int], None]

BATCH = 500


def locate(
    reader: LogReader, client: redis.Redis, settings: Settings, tenant: str, run_id: str
) -> tuple[int | None, Source]:
    """Where a full replay of the run starts, and how that was found (None: the beginning)."""
    hint = start_index(client, settings.redis_key_prefix, tenant, run_id)
    if hint is not None:
        return hint, "index"
    if run_id_time_ms(run_id) is not None:
        return reader.start_offset(run_id, reader.partition_of(run_id)), "time"
    return None, "scan"


@dataclass
class Folded:
    state: RunState
    records: int = 0
    """Records of the run folded (valid and fenced)."""
    first_offset: int | None = None
    last_offset: int | None = None
    fenced: list[LogRecord] = field(default_factory=list)
    """Records the fold rejected, in log order."""
    kept: list[LogRecord] = field(default_factory=list)
    """Every record folded, when asked for (verification needs them)."""


def fold_range(
    reader: LogReader,
    run_id: str,
    partition: int,
    start: int | None,
    end: int,
    *,
    base: RunState | None = None,
    to_seq: int | None = None,
    keep: bool = False,
    progress: Progress | None = None,
) -> Folded | None:
    """Fold ``run_id``'s records in ``[start, end)`` on top of ``base`` (a snapshot) or nothing.

    Stops once the state reaches ``to_seq``. With ``base``, returns None when the log does
    not continue it (position past the end, or a first record that is not its next valid
    event): the caller treats that as a cache miss.
    """
    if base is not None and start is not None and start > end:
        return None
    out = Folded(state=base if base is not None else RunState())
    if to_seq is not None and out.state.seq >= to_seq:
        return out
    records: Iterator[LogRecord] = reader.read(run_id, partition=partition, start=start, end=end)
    try:
        for rec in records:
            if out.first_offset is None:
                out.first_offset = rec.offset
                if base is not None and not is_valid(out.state, rec.event):
                    return None
            before = out.state.fenced_writes
            apply(out.state, rec.event)
            if out.state.fenced_writes != before:
                out.fenced.append(rec)
            if keep:
                out.kept.append(rec)
            out.records += 1
            out.last_offset = rec.offset
            if progress is not None:
                progress(rec.offset, end)
            if to_seq is not None and out.state.seq >= to_seq:
                break
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()
    return out


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
            "seq": st.seq,
            "epoch": st.epoch,
            "status": st.status,
            "outcome": st.outcome,
            "turns": st.turns,
            "messages": len(st.messages),
            "compactions": st.compactions,
            "resumptions": st.resumptions,
            "fenced_writes": st.fenced_writes,
            "completed_calls": len(st.completed_calls),
            "open_calls": len(st.open_calls),
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


def progress_bar(stream: TextIO = sys.stderr, width: int = 40) -> Progress:
    """A carriage-return progress bar over offsets (used only for full scans)."""
    last = [-1.0]

    def show(offset: int, end: int) -> None:
        frac = 1.0 if end <= 0 else min(1.0, (offset + 1) / end)
        if frac - last[0] < 0.01 and frac < 1.0:
            return
        last[0] = frac
        filled = int(frac * width)
        stream.write(f"\rscanning [{'#' * filled}{'.' * (width - filled)}] {frac:6.1%}")
        if frac >= 1.0:
            stream.write("\n")
        stream.flush()

    return show


def replay(
    settings: Settings,
    client: redis.Redis,
    run_id: str,
    *,
    tenant: str = "default",
    to_seq: int | None = None,
    snapshots: SnapshotStore | None = None,
    reader: LogReader | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """The state of ``run_id`` after its ``to_seq``-th valid event (default: the head)."""
    own = reader is None
    rd = LogReader(settings) if reader is None else reader
    t0 = time.perf_counter()
    try:
        partition = rd.partition_of(run_id)
        end = rd.high_watermark(partition)
        folded: Folded | None = None
        source: Source = "scan"
        start: int | None = None
        snap_seq: int | None = None
        miss: str | None = None
        if snapshots is not None:
            loaded = snapshots.load(tenant, run_id, partition=partition, max_seq=to_seq)
            if loaded is not None:
                base, start = loaded
                snap_seq = base.seq
                folded = fold_range(rd, run_id, partition, start, end, base=base, to_seq=to_seq)
                if folded is None:
                    miss = "discontinuous"
                    snapshots.discontinuous(tenant, run_id, snap_seq)
                else:
                    source = "snapshot"
                    metrics.gauge("snapshot_seq_gap", folded.state.seq - snap_seq)
        if folded is None:
            start, source = locate(rd, client, settings, tenant, run_id)
            bar = progress if source == "scan" else None
            folded = fold_range(rd, run_id, partition, start, end, to_seq=to_seq, progress=bar)
            assert folded is not None  # no base to contradict
            snap_seq = None
        ms = (time.perf_counter() - t0) * 1000
        metrics.incr("events_replayed", folded.records)
        metrics.timing("replay_duration_ms", ms)
        return ReplayResult(
            run_id=run_id,
            tenant=tenant,
            state=folded.state,
            partition=partition,
            source=source,
            start_offset=start,
            end_offset=end,
            records=folded.records,
            fenced=len(folded.fenced),
            duration_ms=ms,
            snapshot_seq=snap_seq,
            snapshot_miss=miss,
        )
    finally:
        if own:
            rd.close()
