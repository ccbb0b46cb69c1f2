"""The batch applier: decode a partition's records, quarantine what cannot be folded, fold
the rest into every projection and write effects and positions in one MULTI/EXEC; with
what that commit passes through: the positions and generations this runner read and wrote
(``PositionStore``, with ``verdict``, the one rule of whether a stored position may be
written on) and the waiting out of transient failures (``Retrier``).
"""

from __future__ import annotations

import base64
import enum
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from confluent_kafka import KafkaError, Producer

from runlog._settings import Settings
from runlog.consumers import _erasure as erasure
from runlog.consumers._store import Batch, Decoded, Handler, Rejected, Writes, dumps
from runlog.consumers.runner._core import (
    BACKOFF_CAP_S,
    BACKOFF_START_S,
    RunnerStats,
    Stopped,
    transient_redis_error,
)
from runlog.errors import KafkaUnavailable, NoKeys, RegistryUnavailable, SchemaError
from runlog.log._authority import tenant_keys_for
from runlog.log._clients import REDIS_ERRORS
from runlog.log._keys import KeyStore, keys_for, learn
from runlog.log._registry import ids_for
from runlog.projections._run_state import advance
from runlog.schemas._codec import SchemaIds, decode
from runlog.schemas._keys import decode_key
from runlog.schemas._sealing import NoKeyOpener, Opener
from runlog.schemas._tenant_mac import NO_TENANT_KEYS, TenantKeys
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

T = TypeVar("T")


class KeyMismatch(SchemaError):
    """A record's Kafka key is not the run id inside its event: it violates the layout."""


class _Refused(Exception):
    """The stored position refuses this batch (``Verdict.REGRESSED`` or ``FENCED``)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.value)
        self.verdict = verdict


def _keys_or_none(settings: Settings) -> KeyStore | None:
    """The runner's key store, or None: a runner without keys folds a sealed record's
    structure with its content erased and marks the run ``sealed: no key`` (it never stops
    on one: every other run of its partitions would stop with it). Said at start when
    encryption is on, where every new record is sealed."""
    try:
        store = keys_for(settings)
    except NoKeys as exc:
        log.warning(
            "encryption is on but this projection service has no key store (%s): sealed "
            "records are folded with their content erased and their runs marked "
            "'sealed: no key' (runlog project status counts them)",
            exc,
        )
        return None
    if store is None:
        log.info(
            "no key store (RUNLOG_KEK unset): a sealed record is folded with its content "
            "erased and its run marked 'sealed: no key'"
        )
    return store


_KEYS: dict[bytes, str] = {}
"""Record keys already checked (``decode_key``) -> their run ids: a run's key repeats on
every record of the run, its check need not."""

_MAX_KEYS = 100_000


def _run_key(raw: Any) -> str:
    if type(raw) is bytes:
        known = _KEYS.get(raw)
        if known is not None:
            return known
    run_id = decode_key(raw)
    if type(raw) is bytes:
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        _KEYS[raw] = run_id
    return run_id


def _record_of(
    msg: Any,
    ids: SchemaIds | None,
    tenants: TenantKeys,
    keys: Opener | None,
    unkeyed: NoKeyOpener,
) -> Decoded | Rejected:
    """One record decoded and checked, or why it cannot be folded. Without ``keys``,
    ``unkeyed`` (one per applier, reset here) reads sealed content as erased and tells
    whether the record held any."""
    partition, offset = msg.partition(), msg.offset()
    try:
        run_key: str | None = _run_key(msg.key())
    except SchemaError as exc:
        # A key that names no run: quarantined, never folded under some run.
        return Rejected(None, partition, offset, type(exc).__name__, str(exc))
    unkeyed.asked = False
    try:
        ev = decode(msg.value(), ids, keys if keys is not None else unkeyed)
        if ev.type is EventType.CONTENT_ERASED:  # the one type a key store learns from
            learn(keys, ev)
        if run_key != ev.run_id:
            raise KeyMismatch(f"record key {run_key!r} is not its event's run id {ev.run_id!r}")
    except SchemaError as exc:
        return Rejected(run_key, partition, offset, type(exc).__name__, str(exc))
    value = msg.value() or b""
    forged = tenants.check(ev.tenant, msg.key(), value, msg.headers()) if tenants.keys else None
    return Decoded(ev, partition, offset, forged, keys is None and unkeyed.asked)


def _run_of(rec: Decoded | Rejected) -> str | None:
    return rec.event.run_id if isinstance(rec, Decoded) else rec.run_id


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


class Retrier:
    """Calls that wait out transient failures: capped exponential backoff, counted in
    ``stats.retries``, given up only when ``stop`` is set (``Stopped``)."""

    def __init__(self, stop: threading.Event, stats: RunnerStats) -> None:
        self.stop = stop
        self.stats = stats

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` until it succeeds; transient errors back off, capped. Others propagate."""
        delay = BACKOFF_START_S
        while True:
            try:
                return fn()
            except REDIS_ERRORS as exc:
                if not transient_redis_error(exc):
                    raise
                err: Exception = exc
            except (KafkaUnavailable, RegistryUnavailable) as exc:
                # A schema registry that does not answer is an outage, not a verdict on the
                # record: wait for it. A registry that answers "no such id" is the verdict
                # (``UnknownSchemaId``, a ``SchemaError``): the record is quarantined.
                err = exc
            self.stats.retries += 1
            log.warning("%s failed (%s); retrying in %.2fs", what, err, delay)
            if self.stop.wait(delay):
                raise Stopped(f"stopped while retrying {what}") from err
            delay = min(delay * 2, BACKOFF_CAP_S)


class Verdict(enum.Enum):
    """What a stored (position, generation) means for this runner's next write."""

    CURRENT = "current"
    """The position this runner read or wrote last, under its generation: write on it."""
    MOVED = "moved"
    """Another writer moved the position forward: this runner's cached states are stale."""
    REGRESSED = "regressed"
    """Below what this runner applied (Redis lost writes, a key deleted): writing on top
    would skip the records in between for good, so refetch from it instead."""
    FENCED = "fenced"
    """A rebuild moved the generation: this runner must not write until it ends."""


class PositionStore:
    """Each projection's position and generation per partition: what Redis holds, and what
    this runner read or wrote last (the stored position may only be at or above it)."""

    def __init__(self, client: redis.Redis, handlers: list[Handler[Any]], retrier: Retrier):
        self.redis = client
        self.handlers = handlers
        self.retrier = retrier
        self._expected: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the position this runner read or wrote last."""
        self._gens: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the generation this runner writes under."""

    def stored(self, partitions: Iterable[int]) -> dict[tuple[str, int], tuple[int, int]]:
        """(projection, partition) -> (stored position or -1, generation or 0)."""
        parts = sorted(partitions)
        if not parts:
            return {}

        def read() -> list[Any]:
            # One MGET per partition: a partition's keys share a hash tag (one slot of a
            # Redis Cluster), different partitions' keys do not.
            with self.redis.pipeline(transaction=False) as pipe:
                for p in parts:
                    keys = [k for h in self.handlers for k in (h.keys.pos(p), h.keys.gen(p))]
                    # MGET as a raw command: redis-py's cluster pipeline refuses its mget()
                    # helper (made for keys of any slot), but these share one.
                    pipe.execute_command("MGET", *keys)  # type: ignore[no-untyped-call]
                return [v for values in pipe.execute() for v in values]

        raws = iter(self.retrier.retry("reading positions", read))
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for p in parts:
            for h in self.handlers:
                pos, gen = next(raws), next(raws)
                out[(h.name, p)] = (
                    int(pos) if pos is not None else -1,
                    int(gen) if gen is not None else 0,
                )
        return out

    def lowest(self, partitions: Iterable[int]) -> dict[int, int]:
        """Lowest stored position over the projections, per partition (-1: none)."""
        parts = sorted(partitions)
        return self._lowest(parts, self.stored(parts))

    def adopt(self, partitions: Iterable[int]) -> dict[int, int]:
        """Read positions and generations, take them as this runner's; lowest each."""
        parts = sorted(partitions)
        got = self.stored(parts)
        for key, (pos, gen) in got.items():
            self._expected[key] = pos
            self._gens[key] = gen
        return self._lowest(parts, got)

    def _lowest(
        self, parts: list[int], got: dict[tuple[str, int], tuple[int, int]]
    ) -> dict[int, int]:
        return {p: min(got[(h.name, p)][0] for h in self.handlers) for p in parts}

    def write_under(self, generations: dict[tuple[str, int], int]) -> None:
        """Write under these generations (a rebuild's, which it fenced live runners with)."""
        self._gens.update(generations)

    def verdict(self, name: str, partition: int, pos: int, gen: int) -> Verdict:
        """Whether this runner may write projection ``name``'s ``partition`` on the stored
        ``pos`` and ``gen``: the one check of the batch commit and of the idle check."""
        me = (name, partition)
        if gen != self._gens.get(me, 0):
            return Verdict.FENCED
        expected = self._expected.get(me, -1)
        if pos < expected:
            return Verdict.REGRESSED
        return Verdict.CURRENT if pos == expected else Verdict.MOVED

    def wrote(self, name: str, partition: int, pos: int) -> None:
        """Projection ``name``'s ``partition`` is at ``pos`` now (written or read so)."""
        self._expected[(name, partition)] = pos


class BatchApplier:
    """Applies one partition batch for all the runner's projections at once: decodes it,
    quarantines what cannot be folded, folds the rest and commits effects and positions.

    It never touches the consumer: a batch the stored position refuses is reported to the
    loop (``apply``), which refetches or pauses.
    """

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        handlers: list[Handler[Any]],
        *,
        positions: PositionStore,
        retrier: Retrier,
        stats: RunnerStats,
        group: str,
    ) -> None:
        self.settings = settings
        self.topic = settings.events_topic
        self.redis = client
        self.handlers = handlers
        self.positions = positions
        self.retrier = retrier
        self.stats = stats
        self.group = group
        self._ids = ids_for(settings)
        self._keys = _keys_or_none(settings)
        self._unkeyed = NoKeyOpener()  # this applier's thread alone decodes with it
        self._producer: Any = None
        self.rewrite_owed = False
        """A batch purged an erased run's content since Redis last rewrote its files."""

    def forget(self, partition: int) -> None:
        """This runner may no longer be the partition's only writer: drop cached states."""
        for h in self.handlers:
            h.forget(partition)

    def close(self) -> None:
        """Flush the quarantine producer, if one was made."""
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None

    def settle_erasures(self) -> None:
        """Rewrite Redis's AOF and RDB if a purge is owed one (``consumers._erasure``). Tried
        once: on a timeout it is logged and left to ``runlog forget``, which waits for the
        purge and rewrites them itself (and reports it), so the runner never stalls on it."""
        if self.rewrite_owed:
            self.rewrite_owed = False
            try:
                erasure.rewrite_persistence(self.redis)
            except REDIS_ERRORS as exc:  # never the runner's end: forget retries it
                log.warning("could not rewrite Redis's files after a purge: %s", exc)

    # Quarantine -------------------------------------------------------------------
    def _quarantine_producer(self) -> Any:
        if self._producer is None:
            self._producer = Producer(self.settings.durable_producer_config(), logger=log)
        return self._producer

    def _produce_quarantined(self, msgs: list[Any], errors: dict[int, Rejected]) -> None:
        """Copy the records to the quarantine topic and wait for every acknowledgement."""
        producer = self._quarantine_producer()
        failures: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failures.append(err)

        def send() -> None:
            failures.clear()
            for msg in msgs:
                rej = errors[msg.offset()]
                headers = list(msg.headers() or [])
                headers += [
                    ("runlog.quarantine.topic", self.topic.encode()),
                    ("runlog.quarantine.partition", str(msg.partition()).encode()),
                    ("runlog.quarantine.offset", str(msg.offset()).encode()),
                    ("runlog.quarantine.error", rej.error.encode()),
                    ("runlog.quarantine.group", self.group.encode()),
                ]
                producer.produce(
                    self.settings.quarantine_topic,
                    key=msg.key(),
                    value=msg.value(),
                    headers=headers,
                    on_delivery=on_delivery,
                )
            remaining = producer.flush(30)
            if remaining or failures:
                raise KafkaUnavailable(
                    f"quarantine topic {self.settings.quarantine_topic}: "
                    f"{remaining} unacknowledged, errors {[str(f) for f in failures]}"
                )

        self.retrier.retry("producing to the quarantine topic", send)

    # Applying ---------------------------------------------------------------------
    def apply(self, partition: int, msgs: list[Any]) -> Verdict:
        """Apply one partition's batch: ``CURRENT`` once written; ``REGRESSED`` (refetch
        from the stored position) or ``FENCED`` (a rebuild holds it) if it was not."""
        # Unset RUNLOG_TENANT_KEYS: no tenant is checked (what tenant_keys_for returns).
        tenants = tenant_keys_for(self.settings) if self.settings.tenant_keys else NO_TENANT_KEYS
        if self._ids is None:
            recs = [_record_of(m, None, tenants, self._keys, self._unkeyed) for m in msgs]
        else:
            # Decoding may ask the schema registry for an id this process has not seen;
            # while it does not answer, the batch waits (capped backoff), never skipped.
            recs = self.retrier.retry(
                f"decoding {self.topic}[{partition}] (schema registry {self._ids.url})",
                functools.partial(self._decode_all, msgs, tenants),
            )
        rejected = {r.offset: r for r in recs if isinstance(r, Rejected)}
        if rejected:
            low = self.positions.lowest([partition])[partition]
            todo = [m for m in msgs if m.offset() in rejected and m.offset() > low]
            if todo:
                self._produce_quarantined(todo, rejected)
        raw = {m.offset(): m for m in msgs}
        try:
            self.retrier.retry(
                f"applying {'+'.join(h.name for h in self.handlers)} to {self.topic}[{partition}]",
                functools.partial(self._commit, partition, recs, raw),
            )
        except _Refused as refused:
            return refused.verdict
        return Verdict.CURRENT

    def _decode_all(self, msgs: list[Any], tenants: TenantKeys) -> list[Decoded | Rejected]:
        return [_record_of(m, self._ids, tenants, self._keys, self._unkeyed) for m in msgs]

    def _commit(self, partition: int, recs: list[Decoded | Rejected], raw: dict[int, Any]) -> None:
        """Every projection's effects and position for one partition batch, in one
        MULTI/EXEC: one round of WATCH, reads and EXEC per partition, not per projection.
        Every key it touches carries the partition's hash tag (one Redis Cluster slot)."""
        watched = [k for h in self.handlers for k in (h.keys.pos(partition), h.keys.gen(partition))]
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)  # type: ignore[no-untyped-call]
                    values = iter(pipe.execute_command("MGET", *watched))  # type: ignore[no-untyped-call]
                    plans: list[tuple[Handler[Any], list[Decoded | Rejected], int]] = []
                    for handler in self.handlers:
                        stored, gen_raw = next(values), next(values)
                        pos = int(stored) if stored is not None else -1
                        gen = int(gen_raw) if gen_raw is not None else 0
                        verdict = self.positions.verdict(handler.name, partition, pos, gen)
                        if verdict in (Verdict.FENCED, Verdict.REGRESSED):
                            raise _Refused(verdict)
                        if verdict is Verdict.MOVED:
                            # Another writer moved the position: the cached states are stale.
                            handler.forget(partition)
                        todo = [r for r in recs if r.offset > pos]
                        plans.append((handler, todo, pos))
                    writes = self._fold_all(pipe, partition, plans)
                    shared = Writes()
                    pipe.multi()
                    for (handler, todo, _), (batch, took) in zip(plans, writes, strict=True):
                        if todo:
                            self._queue_writes(
                                pipe, partition, handler, batch, took, todo, raw, shared
                            )
                    if any(todo for _, todo, _ in plans):
                        pipe.execute()
                except redis.WatchError:
                    # Someone else (a zombie, a rebuild) moved a position: recompute.
                    self.stats.watch_conflicts += 1
                    self.forget(partition)
                    continue
                except BaseException:
                    # The folds mutated cached states, and the EXEC may or may not have
                    # happened: only Redis knows now.
                    self.forget(partition)
                    raise
            for (handler, todo, pos), (batch, took) in zip(plans, writes, strict=True):
                self.stats.skipped += len(recs) - len(todo)
                if not todo:
                    self.positions.wrote(handler.name, partition, pos)
                    continue
                if batch is not None:
                    handler.committed(batch)
                self.positions.wrote(handler.name, partition, todo[-1].offset)
                self.stats.applied[handler.name] += sum(1 for r in took if isinstance(r, Decoded))
                self.stats.quarantined += sum(1 for r in took if isinstance(r, Rejected))
                self.stats.skipped += len(todo) - len(took)
            if any(batch is not None and batch.erased for batch, _ in writes):
                # A run's content was purged: Redis's AOF and RDB still hold the values the
                # purge overwrote. Rewritten once the backlog is folded (``settle_erasures``):
                # a rebuild that meets a thousand erasures rewrites the files once.
                self.rewrite_owed = True
            return

    def _fold_all(
        self,
        pipe: Any,
        partition: int,
        plans: list[tuple[Handler[Any], list[Decoded | Rejected], int]],
    ) -> list[tuple[Batch[Any] | None, list[Decoded | Rejected]]]:
        """Fold every projection's ``todo`` into its runs; per projection, the batch and
        the records it took.

        Each run's state is folded once per record: the projections whose copies of it
        are at the same record (always, unless one was rebuilt or reset alone) share one
        copy, and each gets the same ``Step``. Others fold their own copy.
        """
        batches: list[Batch[Any] | None] = []
        for handler, todo, _ in plans:
            if not todo:
                batches.append(None)
                continue
            run_ids = sorted({rid for r in todo if (rid := _run_of(r)) is not None})
            batches.append(handler.begin(self.redis, partition, run_ids))
        active = [
            (h, todo, b) for (h, todo, _), b in zip(plans, batches, strict=True) if b is not None
        ]
        shared: set[str] = set()
        if len(active) > 1:
            # The copy to share: the one with the conversation, if a projection keeps it.
            order = sorted(active, key=lambda a: not a[0].full)
            for rid in order[0][2].states:
                holders = [(h, b) for h, _, b in order if rid in b.states]
                if len(holders) != len(order) or len({b.offsets[rid] for _, b in holders}) != 1:
                    continue
                first = holders[0][0].validator(holders[0][1].states[rid])
                for h, b in holders[1:]:
                    h.share(b.states[rid], first)
                shared.add(rid)
        # A record that names no run leaves no trace in any run's state; its quarantine
        # entry (keyed by offset) is what says it was applied.
        recorded: dict[int, set[int]] = {}
        for i, (handler, todo, _) in enumerate(active):
            orphans = [r for r in todo if isinstance(r, Rejected) and r.run_id is None]
            if orphans:
                present = pipe.hmget(
                    handler.keys.quarantine(partition), [str(r.offset) for r in orphans]
                )
                recorded[i] = {
                    r.offset for r, v in zip(orphans, present, strict=True) if v is not None
                }
        took: list[list[Decoded | Rejected]] = [[] for _ in active]
        # Usually every projection is at the same position: then they all have the same
        # records to do, and a shared run's record is taken by all of them or by none.
        uniform = len({pos for (_, todo, pos) in plans if todo}) == 1
        todos = [{r.offset for r in todo} for _, todo, _ in active]
        records = sorted({r.offset: r for _, todo, _ in active for r in todo}.items())
        for offset, rec in records:
            if uniform and isinstance(rec, Decoded) and rec.event.run_id in shared:
                ev = rec.event
                h0, _, b0 = active[0]
                if offset <= b0.offsets.get(ev.run_id, -1):
                    continue
                step = advance(h0.validator(b0.states[ev.run_id]), ev, rec.forged)
                for i, (h, _, b) in enumerate(active):
                    h.step(b, rec, step)
                    took[i].append(rec)
                continue
            takers = [
                i for i, (h, _, b) in enumerate(active) if offset in todos[i] and h.takes(b, rec)
            ]
            if isinstance(rec, Rejected):
                for i, (h, _, b) in enumerate(active):
                    if i in takers:
                        h.reject(b, rec)
                        took[i].append(rec)
                    elif (
                        rec.run_id is None
                        and offset in todos[i]
                        and offset not in recorded.get(i, ())
                    ):
                        took[i].append(rec)
                continue
            if not takers:
                continue
            ev = rec.event
            if ev.run_id in shared:
                if len(takers) != len(active):  # pragma: no cover - equal offsets, same records
                    raise RuntimeError(f"projections sharing run {ev.run_id} disagree at {offset}")
                h0, _, b0 = active[takers[0]]
                step = advance(h0.validator(b0.states[ev.run_id]), ev, rec.forged)
                for i in takers:
                    h, _, b = active[i]
                    h.step(b, rec, step)
                    took[i].append(rec)
            else:
                for i in takers:
                    h, _, b = active[i]
                    h.step(b, rec, advance(h.validator(b.states[ev.run_id]), ev, rec.forged))
                    took[i].append(rec)
        out: list[tuple[Batch[Any] | None, list[Decoded | Rejected]]] = []
        it = iter(took)
        for maybe in batches:
            out.append((None, []) if maybe is None else (maybe, next(it)))
        return out

    def _queue_writes(
        self,
        pipe: Any,
        partition: int,
        handler: Handler[Any],
        batch: Batch[Any] | None,
        took: list[Decoded | Rejected],
        todo: list[Decoded | Rejected],
        raw: dict[int, Any],
        shared: Writes,
    ) -> None:
        """One projection's effects and its position (inside the partition's MULTI)."""
        keys = handler.keys
        if batch is not None:
            handler.write(pipe, batch, shared)
        applied = sum(1 for r in took if isinstance(r, Decoded))
        bad = [r for r in took if isinstance(r, Rejected)]
        for r in bad:
            msg = raw[r.offset]
            pipe.hset(
                keys.quarantine(partition),
                str(r.offset),
                dumps(
                    {
                        "topic": self.topic,
                        "partition": partition,
                        "offset": r.offset,
                        "run_id": r.run_id,
                        "key_b64": _b64(msg.key()),
                        "value_b64": _b64(msg.value()),
                        "headers": [[k, _b64(v)] for k, v in (msg.headers() or [])],
                        "timestamp_ms": msg.timestamp()[1],
                        "error": r.error,
                        "message": r.message,
                    }
                ),
            )
        sealed: dict[str, int] = {}
        unopened = [d for d in took if isinstance(d, Decoded) and d.sealed_no_key]
        for d in unopened:
            sealed.setdefault(d.event.run_id, d.offset)
        if unopened:
            # HSETNX: the run is marked where it was first met, whatever batch it was in.
            for rid, offset in sealed.items():
                pipe.hsetnx(keys.sealed(partition), rid, offset)
            pipe.hincrby(keys.stats(partition), "sealed_no_key", len(unopened))
        if applied:
            pipe.hincrby(keys.stats(partition), "applied", applied)
        if bad:
            pipe.hincrby(keys.stats(partition), "quarantined", len(bad))
        pipe.set(keys.pos(partition), todo[-1].offset)
