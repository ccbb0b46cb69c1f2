"""Redis layout of the projections and the store half of each one.

Every key of a projection lives under ``<prefix>:proj:<name>:{<topic>:<partition>}``; the
braces are a Redis Cluster hash tag, so one partition's position and the effects of the
records it covers sit in one slot and can be written by one MULTI/EXEC.

Per (projection, topic, partition):

==================  =======================================================================
``pos``             offset of the last record applied (the tracking record)
``stats``           hash: ``applied`` (decoded records folded), ``quarantined``
``quarantine``      hash: offset -> JSON (original bytes base64, error class and message)
``runs``            set of run ids seen in the partition
``run:<id>``        JSON of the projection's per-run state (state: without the two below)
``msgs:<id>``       state only: list, the run's conversation, one JSON message per entry
``done:<id>``       state only: hash, idempotency key -> stored result of the completed call
``sum:<id>``        state only: hash summary of the run (plus the run index's fields)
``ix:*``            state only: the run index (``consumers.index``)
``open``            uncertain only: hash ``<run>\\x1f<key>`` -> JSON of an open uncertain call
``counters``        uncertain only: hash of queue counters (opened, reconciled, ...)
``log:<id>``        audit only: list of JSON entries, append-only
==================  =======================================================================

Beside them, outside the key pattern a rebuild deletes:

``<prefix>:proj:<name>:gen:{<topic>:<partition>}``  the partition's generation: a rebuild
increments it, and a runner writes only while it holds the current one (checked in the
same MULTI/EXEC as its position, hence the same hash tag)
``<prefix>:proj:<name>:rebuild:<topic>``  present (with a TTL the rebuild keeps renewing)
while a rebuild runs: live runners wait instead of folding alongside it

Each run's JSON also holds ``applied_offset``, the offset of the last record of that run
folded into it. It is written in the same transaction as the state it describes, so it
goes back exactly when that state goes back (a Redis failover or an AOF that lost its last
second): a record at or below it is never folded into the run again, even after the
partition's position went back without the run's state.

Values are canonical JSON (sorted keys, no spaces), so a rebuild is byte-identical.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis

from runlog.consumers import index
from runlog.projections import audit, state_view, uncertain
from runlog.projections.run_state import jsonable
from runlog.schemas.models import Event, ToolCallCompleted

S = TypeVar("S")

PROJECTIONS = ("state", "uncertain", "audit")
SEP = "\x1f"
APPLIED = "applied_offset"
"""Field of a run's stored JSON: offset of the last record of the run folded into it."""


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ProjectionKeys:
    prefix: str
    projection: str
    topic: str

    @property
    def root(self) -> str:
        return f"{self.prefix}:proj:{self.projection}"

    def part(self, partition: int) -> str:
        return f"{self.root}:{{{self.topic}:{partition}}}"

    def pos(self, partition: int) -> str:
        return f"{self.part(partition)}:pos"

    def stats(self, partition: int) -> str:
        return f"{self.part(partition)}:stats"

    def quarantine(self, partition: int) -> str:
        return f"{self.part(partition)}:quarantine"

    def runs(self, partition: int) -> str:
        return f"{self.part(partition)}:runs"

    def run(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:run:{run_id}"

    def summary(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:sum:{run_id}"

    def open(self, partition: int) -> str:
        return f"{self.part(partition)}:open"

    def counters(self, partition: int) -> str:
        return f"{self.part(partition)}:counters"

    def messages(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:msgs:{run_id}"

    def completed(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:done:{run_id}"

    def log(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:log:{run_id}"

    def gen(self, partition: int) -> str:
        """The partition's generation; outside ``pattern()``, so a rebuild keeps it."""
        return f"{self.root}:gen:{{{self.topic}:{partition}}}"

    def rebuild_marker(self) -> str:
        """Present while a rebuild of this projection runs (outside ``pattern()``)."""
        return f"{self.root}:rebuild:{self.topic}"

    def pattern(self) -> str:
        """Matches every key of this projection on this topic (for rebuild and tests)."""
        return f"{self.root}:{{{self.topic}:*"


@dataclass(frozen=True)
class Decoded:
    """One record the runner could decode: the event and where it is."""

    event: Event
    partition: int
    offset: int


@dataclass(frozen=True)
class Rejected:
    """One record that is quarantined; ``run_id`` is its Kafka key, if any."""

    run_id: str | None
    partition: int
    offset: int
    error: str
    message: str


@dataclass
class Batch(Generic[S]):
    """The per-run states of one partition batch, loaded once and written once."""

    partition: int
    states: dict[str, S]
    before: dict[str, Any]
    """What ``Handler.remember`` kept of each run's state as loaded."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Run id -> offset of the last record folded into its state (-1: none)."""
    dirty: set[str] = field(default_factory=set)
    extra: dict[str, Any] = field(default_factory=dict)


MAX_CACHED_RUNS = 10_000
"""Per partition and projection: past it the runner's cache of run states starts over."""


class Handler(ABC, Generic[S]):
    """The store half of a projection: load per-run states, fold a batch, queue writes.

    The states of the runs a runner folded stay in memory between batches (``_cache``),
    so a batch loads only runs it has not seen and writes only what its records changed:
    the store work of one event does not grow with the length of its run. The cache holds
    exactly what Redis holds as long as this runner is the only writer of the partition
    and every batch it folded was committed; the runner calls ``forget`` whenever either
    may not hold (an assignment or revocation, a position another writer moved, a failed
    or unknown EXEC: a fold mutates the cached states before the commit).
    """

    name: str

    def __init__(self, keys: ProjectionKeys) -> None:
        self.keys = keys
        self._cache: dict[int, dict[str, tuple[S, int]]] = {}
        """Partition -> run id -> (state, applied offset), as committed."""

    @abstractmethod
    def empty(self) -> S: ...

    @abstractmethod
    def loads(self, data: dict[str, Any]) -> S: ...

    @abstractmethod
    def dumps(self, state: S) -> dict[str, Any]: ...

    @abstractmethod
    def on_event(self, batch: Batch[S], state: S, rec: Decoded) -> None: ...

    def remember(self, state: S) -> Any:
        """What to keep of a run's state as loaded, for ``write_run`` (default nothing)."""
        return None

    def on_rejected(self, batch: Batch[S], state: S, rec: Rejected) -> None:
        """Default: the Redis quarantine record (written by the runner) is enough."""

    def write_run(self, pipe: Any, batch: Batch[S], run_id: str, state: S) -> None:
        """Extra writes for one changed run (beyond its JSON and the runs set)."""

    def write_batch(self, pipe: Any, batch: Batch[S]) -> None:
        """Extra writes for the whole partition batch."""

    def load_runs(
        self, client: redis.Redis, partition: int, run_ids: list[str]
    ) -> dict[str, tuple[S, int]]:
        """States and applied offsets of ``run_ids`` as stored (absent: empty, -1)."""
        out: dict[str, tuple[S, int]] = {}
        raws = client.mget([self.keys.run(partition, r) for r in run_ids])
        for rid, raw in zip(run_ids, raws, strict=True):
            if raw is None:
                out[rid] = (self.empty(), -1)
                continue
            data = json.loads(raw)
            # Views stored before the field existed: no record is known to be in them.
            offset = int(data.pop(APPLIED, -1))
            out[rid] = (self.loads(data), offset)
        return out

    def done(self, state: S) -> bool:
        """True if no valid record can change the run any more: not worth caching."""
        return False

    # The generic part ----------------------------------------------------------------
    def forget(self, partition: int | None = None) -> None:
        """Drop cached states (of one partition, or all): the next batch reloads them."""
        if partition is None:
            self._cache.clear()
        else:
            self._cache.pop(partition, None)

    def begin(self, client: redis.Redis, partition: int, run_ids: list[str]) -> Batch[S]:
        """The runs of a batch: from the cache, the others loaded (``client`` is a
        pipeline in WATCH, immediate mode)."""
        cached = self._cache.get(partition, {})
        missing = [r for r in run_ids if r not in cached]
        loaded = self.load_runs(client, partition, missing) if missing else {}
        states: dict[str, S] = {}
        offsets: dict[str, int] = {}
        for rid in run_ids:
            states[rid], offsets[rid] = cached[rid] if rid in cached else loaded[rid]
        before = {rid: self.remember(st) for rid, st in states.items()}
        return Batch(partition=partition, states=states, before=before, offsets=offsets)

    def committed(self, batch: Batch[S]) -> None:
        """The batch is in Redis: its states are now what Redis holds."""
        cache = self._cache.setdefault(batch.partition, {})
        if len(cache) + len(batch.states) > MAX_CACHED_RUNS:
            cache.clear()
        for rid, state in batch.states.items():
            if self.done(state):
                cache.pop(rid, None)
            else:
                cache[rid] = (state, batch.offsets[rid])

    def apply(self, batch: Batch[S], rec: Decoded | Rejected) -> bool:
        """Fold ``rec`` into its run; False if the run's state already holds it.

        A run's records have increasing offsets, so one at or below the run's applied
        offset was folded before: skipping it keeps a record from counting twice when the
        partition's position went back but the run's state did not.
        """
        rid = rec.event.run_id if isinstance(rec, Decoded) else rec.run_id
        if rid is None:
            return False
        if rec.offset <= batch.offsets.get(rid, -1):
            return False
        state = batch.states[rid]
        if isinstance(rec, Decoded):
            self.on_event(batch, state, rec)
        else:
            self.on_rejected(batch, state, rec)
        batch.offsets[rid] = rec.offset
        batch.dirty.add(rid)
        return True

    def write(self, pipe: Any, batch: Batch[S]) -> None:
        p = batch.partition
        for rid in sorted(batch.dirty):
            state = batch.states[rid]
            data = self.dumps(state)
            assert APPLIED not in data, f"{self.name} state uses the reserved field {APPLIED}"
            data[APPLIED] = batch.offsets[rid]
            pipe.set(self.keys.run(p, rid), dumps(data))
            pipe.sadd(self.keys.runs(p), rid)
            self.write_run(pipe, batch, rid, state)
        self.write_batch(pipe, batch)


@dataclass(frozen=True)
class _Loaded:
    """What the state projection's ``remember`` keeps of a run as loaded."""

    status: str | None
    """Its run-index status (``index.remember``)."""
    messages: int
    """Messages already in its ``msgs`` list."""
    compactions: int
    """A compaction since rewrites the list instead of appending to it."""


def load_state_view(
    client: redis.Redis, keys: ProjectionKeys, partition: int, run_id: str
) -> dict[str, Any] | None:
    """The stored state view of a run, whole (the conversation and results put back)."""
    raw = client.get(keys.run(partition, run_id))
    if raw is None:
        return None
    view: dict[str, Any] = json.loads(raw)
    state = view["state"]
    if view.get("version", 1) < 2:
        # Stored whole, before the conversation and results moved to their own keys.
        return view
    state["messages"] = [
        json.loads(m) for m in client.lrange(keys.messages(partition, run_id), 0, -1)
    ]
    done = client.hgetall(keys.completed(partition, run_id))
    state["completed_calls"] = {
        _text(k): _text(v) for k, v in sorted(done.items(), key=lambda kv: kv[0])
    }
    return view


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StateHandler(Handler[state_view.StateView]):
    """Stores a run's view as JSON *without* the two parts that grow with every event:
    the conversation (``msgs:<id>``, a list appended to) and the stored results of
    completed calls (``done:<id>``, a hash written per completion)."""

    name = "state"

    def __init__(self, keys: ProjectionKeys) -> None:
        super().__init__(keys)
        self._whole: set[tuple[int, str]] = set()
        """(partition, run) loaded in the older shape: the next write stores all of it."""

    def empty(self) -> state_view.StateView:
        return state_view.StateView()

    def loads(self, data: dict[str, Any]) -> state_view.StateView:
        return state_view.StateView.from_dict(data)

    def dumps(self, state: state_view.StateView) -> dict[str, Any]:
        return state.to_dict(slim=True)

    def load_runs(
        self, client: redis.Redis, partition: int, run_ids: list[str]
    ) -> dict[str, tuple[state_view.StateView, int]]:
        out: dict[str, tuple[state_view.StateView, int]] = {}
        for rid in run_ids:
            data = load_state_view(client, self.keys, partition, rid)
            if data is None:
                out[rid] = (self.empty(), -1)
                continue
            offset = int(data.pop(APPLIED, -1))
            if data.get("version", 1) < 2:
                self._whole.add((partition, rid))
            out[rid] = (self.loads(data), offset)
        return out

    def done(self, state: state_view.StateView) -> bool:
        return state.state.status == "finished"

    def remember(self, state: state_view.StateView) -> Any:
        st = state.state
        return _Loaded(index.remember(state), len(st.messages), st.compactions)

    def on_event(
        self, batch: Batch[state_view.StateView], state: state_view.StateView, rec: Decoded
    ) -> None:
        ev = rec.event
        if not state_view.fold_record(state, ev, rec.partition, rec.offset):
            return
        index.observe(batch.extra, state, ev)
        p = ev.payload
        if isinstance(p, ToolCallCompleted) and p.idempotency_key is not None:
            # Only this key's stored result changed; the others are already in Redis.
            batch.extra.setdefault("done", {}).setdefault(ev.run_id, set()).add(p.idempotency_key)

    def on_rejected(
        self, batch: Batch[state_view.StateView], state: state_view.StateView, rec: Rejected
    ) -> None:
        state_view.apply_quarantined(state, rec.partition, rec.offset, rec.error)

    def write_run(
        self, pipe: Any, batch: Batch[state_view.StateView], run_id: str, state: Any
    ) -> None:
        p, st = batch.partition, state.state
        was: _Loaded = batch.before[run_id]
        msgs = self.keys.messages(p, run_id)
        whole = (p, run_id) in self._whole
        if whole:
            # A view stored whole (an older store): its first write splits it. Should the
            # EXEC fail, the runner forgets the partition and the reload marks it again.
            self._whole.discard((p, run_id))
            pipe.delete(msgs)
            new = st.messages
        elif st.compactions != was.compactions:
            # A compaction replaced the conversation: rare, and bounded by what it kept.
            pipe.delete(msgs)
            new = st.messages
        else:
            new = st.messages[was.messages :]
        if new:
            pipe.rpush(msgs, *[dumps(jsonable(m)) for m in new])
        keys_done = sorted(
            st.completed_calls if whole else batch.extra.get("done", {}).get(run_id, ())
        )
        if keys_done:
            pipe.hset(
                self.keys.completed(p, run_id),
                mapping={k: st.completed_calls[k] for k in keys_done},
            )
        pipe.hset(self.keys.summary(p, run_id), mapping=state.summary())
        # The run index commits with the view and the position (same MULTI, same slot).
        keys = index.IndexKeys(self.keys.part(p))
        index.write(pipe, keys, run_id, state, was.status, batch.extra)


class UncertainHandler(Handler[uncertain.UncertainRun]):
    name = "uncertain"

    def empty(self) -> uncertain.UncertainRun:
        return uncertain.UncertainRun()

    def loads(self, data: dict[str, Any]) -> uncertain.UncertainRun:
        return uncertain.UncertainRun.from_dict(data)

    def dumps(self, state: uncertain.UncertainRun) -> dict[str, Any]:
        return state.to_dict()

    def on_event(
        self, batch: Batch[uncertain.UncertainRun], state: uncertain.UncertainRun, rec: Decoded
    ) -> None:
        changed: dict[str, set[str]] = batch.extra.setdefault("changed", {})
        delta = uncertain.apply_event(state, rec.event, changed.setdefault(rec.event.run_id, set()))
        totals: dict[str, int] = batch.extra.setdefault("counters", {})
        for name, n in delta.items():
            totals[name] = totals.get(name, 0) + n

    def write_run(
        self, pipe: Any, batch: Batch[uncertain.UncertainRun], run_id: str, state: Any
    ) -> None:
        # Only the calls this batch's events touched: the others are already in Redis.
        changed = batch.extra.get("changed", {}).get(run_id, set())
        key = self.keys.open(batch.partition)
        gone = sorted(f"{run_id}{SEP}{k}" for k in changed if k not in state.calls)
        if gone:
            pipe.hdel(key, *gone)
        for k in sorted(k for k in changed if k in state.calls):
            pipe.hset(key, f"{run_id}{SEP}{k}", dumps(state.calls[k].to_dict()))

    def write_batch(self, pipe: Any, batch: Batch[uncertain.UncertainRun]) -> None:
        for name, n in sorted(batch.extra.get("counters", {}).items()):
            if n:
                pipe.hincrby(self.keys.counters(batch.partition), name, n)


class AuditHandler(Handler[audit.AuditRun]):
    name = "audit"

    def empty(self) -> audit.AuditRun:
        return audit.AuditRun()

    def loads(self, data: dict[str, Any]) -> audit.AuditRun:
        return audit.AuditRun.from_dict(data)

    def dumps(self, state: audit.AuditRun) -> dict[str, Any]:
        return state.to_dict()

    def _entries(self, batch: Batch[audit.AuditRun], run_id: str) -> list[audit.Entry]:
        per_run: dict[str, list[audit.Entry]] = batch.extra.setdefault("entries", {})
        return per_run.setdefault(run_id, [])

    def on_event(self, batch: Batch[audit.AuditRun], state: audit.AuditRun, rec: Decoded) -> None:
        entries = audit.apply_event(state, rec.event, rec.partition, rec.offset)
        self._entries(batch, rec.event.run_id).extend(entries)

    def on_rejected(
        self, batch: Batch[audit.AuditRun], state: audit.AuditRun, rec: Rejected
    ) -> None:
        assert rec.run_id is not None
        entry = audit.quarantined_entry(rec.partition, rec.offset, rec.error, rec.message)
        self._entries(batch, rec.run_id).append(entry)

    def write_run(self, pipe: Any, batch: Batch[audit.AuditRun], run_id: str, state: Any) -> None:
        entries = batch.extra.get("entries", {}).get(run_id, [])
        if entries:
            pipe.rpush(self.keys.log(batch.partition, run_id), *[dumps(e) for e in entries])


def make_handler(name: str, prefix: str, topic: str) -> Handler[Any]:
    keys = ProjectionKeys(prefix, name, topic)
    if name == "state":
        return StateHandler(keys)
    if name == "uncertain":
        return UncertainHandler(keys)
    if name == "audit":
        return AuditHandler(keys)
    raise ValueError(f"unknown projection {name!r}; expected one of {', '.join(PROJECTIONS)}")
