"""Locate a run and fold a range of its log: the one way every reader does both.

Where a read starts, best first:

1. ``snapshot``: a stored snapshot at or below the wanted sequence, used only if the log
   continues it (its tail's first record is its next valid event); otherwise it is a cache
   miss, reported to the store, and the next source is used;
2. ``index``: the run's start index in Redis (``partition:offset`` of its RUN_STARTED,
   written when that record was acknowledged);
3. ``time``: the creation time embedded in a runlog run id, via ``offsets_for_times``;
4. ``scan``: the partition from its beginning (the only case whose cost grows with the
   other runs in the partition).

Before all of them, for a caller about to claim the run (``tail``), a process's log tail
that has read the run's partition from its beginning may say the run has no record below
the offset it has read to (``LogTail.unseen_below``): that is the scan's own conclusion,
from records already read, and the run is new with nothing to fold, its read ending there.
What the run may have from that offset on, the claim's read-back finds (it reads from the
read's end), as it finds a record written after any read's head. Any record of the run, or
a tail that cannot say, and the read goes as above.

For the same caller, a read from a snapshot ends after the run's last record that such a
tail holds, rather than at the partition's head: the tail says which offsets of the range
are the run's, and the records after its last one are other runs' (a run resumed on a busy
partition would otherwise fetch every record written since its snapshot). The read's
``end`` stays the head, where the claim's read-back starts.

An index or a time is a hint, never proof of where the run starts: a read from it that
finds nothing of the run, or whose first record of the run is not the run's start, is
read again from the partition's beginning (``fold_run``). A run is "new" only when the
whole partition holds none of its records, so an id whose embedded time lies after the
run's first event (a caller-chosen id shaped like a minted one, a clock ahead) or an
index that Redis lost never lets a writer start a run a second time.

Whether a record counts is the fold's own rule (``runlog.projections._run_state.accept``),
asked here and nowhere else on the read path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import redis

from runlog._settings import Settings
from runlog.errors import ConfigError, RedisUnavailable
from runlog.log._authority import authority_for
from runlog.log._clients import REDIS_ERRORS
from runlog.log._reader import LogReader, LogRecord
from runlog.projections._run_state import RunState, accept, is_valid
from runlog.schemas._keys import run_id_time_ms, start_key

if TYPE_CHECKING:
    from runlog.log._tail import LogTail

Source = Literal["snapshot", "index", "time", "scan", "tail"]
Progress = Callable[[int, int], None]


class SnapshotSource(Protocol):
    """What a reader needs of a snapshot store (``runlog.log._snapshots`` is one)."""

    def load(
        self, tenant: str, run_id: str, *, partition: int, max_seq: int | None = None
    ) -> tuple[RunState, int] | None:
        """``(state, offset its tail starts at)`` of the newest usable snapshot, or None."""
        ...

    def discontinuous(self, tenant: str, run_id: str, seq: int) -> None:
        """The log does not continue the snapshot at ``seq``: never offer it again."""
        ...


def start_index(
    client: redis.Redis, settings: Settings, tenant: str, run_id: str, *, partition: int
) -> int | None:
    """Offset of the run's RUN_STARTED from its start index, or None if not indexed.

    The index is an optimisation: without it readers use the run id's time or a scan. An
    index naming another partition than the run hashes to raises ``ConfigError``: key
    hashing no longer finds the run's records, so nothing may be read or written for it.
    """
    try:
        raw = client.get(start_key(settings.redis_key_prefix, tenant, run_id))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"start index of {run_id}: {exc}") from exc
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    indexed_partition, offset = (int(x) for x in text.split(":")[:2])
    if indexed_partition != partition:
        raise ConfigError(
            f"run {run_id} started in partition {indexed_partition} but hashes to {partition} "
            "now: the events topic's partition count changed (see `runlog topics check`)"
        )
    return offset


@dataclass(frozen=True)
class Location:
    partition: int
    start: int | None
    """Offset to read from (None: the partition's beginning)."""
    source: Source


def locate(
    reader: LogReader, client: redis.Redis, settings: Settings, tenant: str, run_id: str
) -> Location:
    """Where a full read of the run starts, and how that was found."""
    partition = reader.partition_of(run_id)
    hint = None if reader.prefetch is None else reader.prefetch.start_of(tenant, run_id)
    if hint is None:
        hint = start_index(client, settings, tenant, run_id, partition=partition)
    if hint is not None:
        return Location(partition, hint, "index")
    if run_id_time_ms(run_id) is not None:
        return Location(partition, reader.start_offset(run_id, partition), "time")
    return Location(partition, None, "scan")


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
    not continue it (a position past the end, or a first record that is not its next valid
    event: a record skipped or re-read); the caller treats that as a cache miss. A late
    fenced write right after the position also lands there: a needless full replay, never
    a wrong state.
    """
    if base is not None and start is not None and start > end:
        return None
    # The decider keys this reader trusts are an input of the fold (never stored in it):
    # a snapshot's state folds on under this reader's keys too.
    authority = authority_for(reader.settings)
    if base is not None:
        base.authority = authority
    out = Folded(state=base if base is not None else RunState(authority=authority))
    if to_seq is not None and out.state.seq >= to_seq:
        return out
    records = reader.read(run_id, partition=partition, start=start, end=end)
    try:
        for rec in records:
            if out.first_offset is None:
                out.first_offset = rec.offset
                if base is not None and (rec.forged or not is_valid(out.state, rec.event)):
                    return None
            if not accept(out.state, rec.event, rec.forged):
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
        records.close()  # stop the generator now: it unassigns the reader's partition
    return out


def _own_end(tail: LogTail, partition: int, run_id: str, start: int, stop: int) -> int:
    """Where a read of ``run_id`` from ``start`` may end: after its last record in
    ``[start, stop)`` that the process's log tail holds, or ``stop`` when it cannot say."""
    if stop <= start:
        return stop
    offsets = tail.offsets_of(partition, run_id.encode(), start, stop - 1, wait_s=OWN_END_WAIT_S)
    if offsets is None:
        return stop
    return offsets[-1] + 1 if offsets else start


OWN_END_WAIT_S = 0.02
"""How long a resume waits for the log tail to reach the head before reading it all: a
live tail is a fetch behind, and one still reading its partitions from their beginning (a
worker just started, adopting runs) must not hold every resume up."""


def fold_run(
    reader: LogReader,
    client: redis.Redis,
    settings: Settings,
    tenant: str,
    run_id: str,
    end: int,
    *,
    to_seq: int | None = None,
    keep: bool = False,
    progress: Progress | None = None,
) -> tuple[Folded, Location]:
    """Fold the run's records before ``end`` from where it starts, and say where that was.

    The located start is checked against what it finds: no record of the run, or a first
    record the fold rejects on an empty state (the read began after the run's start), and
    the partition is read from its beginning instead. Only a read from the beginning may
    conclude that the run has no history.
    """
    where = locate(reader, client, settings, tenant, run_id)
    while True:
        folded = fold_range(
            reader,
            run_id,
            where.partition,
            where.start,
            end,
            to_seq=to_seq,
            keep=keep,
            progress=progress if where.source == "scan" else None,
        )
        assert folded is not None  # no base to contradict
        if where.source == "scan" or to_seq == 0 or _starts_the_run(folded):
            return folded, where
        where = Location(where.partition, None, "scan")


def _starts_the_run(folded: Folded) -> bool:
    """The read found the run, and its first record of the run is the run's valid start."""
    first = folded.first_offset
    if first is None:
        return False
    return not (folded.fenced and folded.fenced[0].offset == first)


@dataclass
class RunRead:
    """A run's state read from the log, and where the read came from."""

    folded: Folded
    partition: int
    source: Source
    start: int | None
    end: int
    """High watermark when the read began (exclusive); for a read the log tail answered
    (``source`` "tail"), the offset the tail had read to."""
    snapshot_seq: int | None = None
    snapshot_miss: str | None = None
    """Why an available snapshot was not used, if one was rejected."""

    @property
    def state(self) -> RunState:
        return self.folded.state


def read_run(
    reader: LogReader,
    client: redis.Redis,
    settings: Settings,
    tenant: str,
    run_id: str,
    *,
    snapshots: SnapshotSource | None = None,
    to_seq: int | None = None,
    end: int | None = None,
    keep: bool = False,
    progress: Progress | None = None,
    tail: LogTail | None = None,
    partition: int | None = None,
) -> RunRead:
    """The run's state after its ``to_seq``-th valid event (default: up to ``end``/the head).

    A snapshot is tried first; a full read from the located start follows when there is
    none or the log does not continue it. ``progress`` is shown only for full scans.
    ``tail``: the process's log tail, asked first whether the run has no record below what
    it has read; only for a caller that reads the run back from the read's ``end`` before
    acting on it (a claim), with ``partition``, the run's partition as the caller placed it.
    A read of the log itself locates the run again (the reader checks the partition count).
    """
    if tail is not None and partition is not None and end is None:
        upto = tail.unseen_below(partition, run_id.encode())
        if upto is not None:
            new = Folded(state=RunState(authority=authority_for(reader.settings)))
            return RunRead(new, partition, "tail", 0, upto)
    partition = reader.partition_of(run_id)
    stop = reader.high_watermark(partition) if end is None else end
    miss: str | None = None
    if snapshots is not None:
        loaded = snapshots.load(tenant, run_id, partition=partition, max_seq=to_seq)
        if loaded is not None:
            base, start = loaded
            snap_seq = base.seq
            upto = (
                stop
                if tail is None or to_seq is not None
                else _own_end(tail, partition, run_id, start, stop)
            )
            folded = fold_range(
                reader, run_id, partition, start, upto, base=base, to_seq=to_seq, keep=keep
            )
            if folded is not None:
                return RunRead(folded, partition, "snapshot", start, stop, snapshot_seq=snap_seq)
            miss = "discontinuous"
            snapshots.discontinuous(tenant, run_id, snap_seq)
    full, where = fold_run(
        reader,
        client,
        settings,
        tenant,
        run_id,
        stop,
        to_seq=to_seq,
        keep=keep,
        progress=progress,
    )
    return RunRead(full, partition, where.source, where.start, stop, snapshot_miss=miss)
