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
``run:<id>``        JSON of the projection's own per-run state (small), ``applied_offset``
                    and ``run_state``: the scalars (status, seq, epoch, counters...) of
                    the run state every projection folds (serialised once per batch)
``calls:<id>``      hash: idempotency key -> JSON of one open call of the run state
``appr:<id>``       hash: approval id -> JSON of one approval of the run state
``msgs:<id>``       state only: list, the run's conversation, one JSON message per entry
``done:<id>``       state only: hash, idempotency key -> stored result of the completed call
``sum:<id>``        state only: hash summary of the run (plus the run index's fields)
``ix:*``            state only: the run index (``consumers._index``)
``open``            uncertain only: hash ``<run>\\x1f<key>`` -> JSON of an open uncertain call
``counters``        uncertain only: hash of queue counters (opened, reconciled, ...)
``log:<id>``        audit only: list of JSON entries, append-only
``pending``         notify only: hash, approval identity -> JSON of a request no one
                    decided yet (``projections._notify``)
==================  =======================================================================

Beside them, outside the key pattern a rebuild deletes:

``<prefix>:proj:<name>:gen:{<topic>:<partition>}``  the partition's generation: a rebuild
increments it, and a runner writes only while it holds the current one (checked in the
same MULTI/EXEC as its position, hence the same hash tag)
``<prefix>:proj:<name>:rebuild:<topic>``  present (with a TTL the rebuild keeps renewing)
while a rebuild runs: live runners wait instead of folding alongside it
``<prefix>:proj:<name>:incomplete:<topic>``  present, with no TTL, from the moment a
rebuild may start deleting until its refold reached the end: a rebuild that died left the
projection half deleted or half refolded; runners do not write on it, and the next rebuild
or the first runner to see it (with no rebuild marker left) refolds it from zero
``<prefix>:proj:notify:dlv:{<topic>:<partition>}``  notify only: hash, approval identity ->
JSON of its notification's delivery (status, attempts, last error, delivered_at). Kept by
a rebuild, so a rebuild never notifies again: the notification is owed once per request,
and whether it was delivered is a fact about the world, not a fold of the log
``<prefix>:proj:notify:out:{<topic>:<partition>}``  notify only: sorted set, the
notifications to deliver, scored by when their next attempt is due
``<prefix>:proj:notify:att:{<topic>:<partition>}:<identity>``  notify only: list, one JSON
per delivery attempt

One event writes what it changed: the open calls and the approval it touched (the run
state's rules say which, ``run_state.Step``), a message appended, a stored result, an
audit entry, a counter; the run's small JSONs once per batch. Nothing grows with the run.

Each run's JSON also holds ``applied_offset``, the offset of the last record of that run
folded into it. It is written in the same transaction as the state it describes, so it
goes back exactly when that state goes back (a Redis failover or an AOF that lost its last
second): a record at or below it is never folded into the run again, even after the
partition's position went back without the run's state.

Values are deterministic JSON (sorted keys, no spaces; in ``run:<id>`` the ``run_state``
field comes last), so a rebuild is byte-identical.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import Any, Generic, TypeVar

import redis

from runlog.consumers import _erasure as erasure
from runlog.projections._messages import Message
from runlog.projections._run_state import (
    Approval,
    OpenCall,
    RunState,
    Step,
    advance,
    jsonable,
)
from runlog.schemas._models import Event
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority
from runlog.schemas._vocabulary import EventType

S = TypeVar("S")

SEP = "\x1f"
APPLIED = "applied_offset"
"""Field of a run's stored JSON: offset of the last record of the run folded into it."""
RUN_STATE = "run_state"
"""Field of a run's stored JSON: the scalars of its run state (``scalars``)."""


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

    def sealed(self, partition: int) -> str:
        """Runs folded without their key (``sealed: no key``): run id -> first offset."""
        return f"{self.part(partition)}:sealed"

    def runs(self, partition: int) -> str:
        return f"{self.part(partition)}:runs"

    def run(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:run:{run_id}"

    def calls(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:calls:{run_id}"

    def approvals(self, partition: int, run_id: str) -> str:
        return f"{self.part(partition)}:appr:{run_id}"

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

    def pending(self, partition: int) -> str:
        return f"{self.part(partition)}:pending"

    def deliveries(self, partition: int) -> str:
        """Notification deliveries; outside ``pattern()``, so a rebuild keeps them."""
        return f"{self.root}:dlv:{{{self.topic}:{partition}}}"

    def outbox(self, partition: int) -> str:
        """Notifications to deliver, by due time; outside ``pattern()``."""
        return f"{self.root}:out:{{{self.topic}:{partition}}}"

    def attempts(self, partition: int, ident: str) -> str:
        """One notification's delivery attempts; outside ``pattern()``."""
        return f"{self.root}:att:{{{self.topic}:{partition}}}:{ident}"

    def gen(self, partition: int) -> str:
        """The partition's generation; outside ``pattern()``, so a rebuild keeps it."""
        return f"{self.root}:gen:{{{self.topic}:{partition}}}"

    def rebuild_marker(self) -> str:
        """Present while a rebuild of this projection runs (outside ``pattern()``)."""
        return f"{self.root}:rebuild:{self.topic}"

    def incomplete_marker(self) -> str:
        """Present, without a TTL, from a rebuild's first delete until its refold is
        complete (outside ``pattern()``): a projection not to be trusted or written."""
        return f"{self.root}:incomplete:{self.topic}"

    def pattern(self) -> str:
        """Matches every key of this projection on this topic (for rebuild and tests)."""
        return f"{self.root}:{{{self.topic}:*"


SEALED = "sealed"
SEALED_NO_KEY = "no key"
"""A run view's ``sealed`` field: the runner that folded it had no key store, so its content
reads erased in the projection (its log still holds it, sealed)."""


@dataclass(frozen=True)
class Decoded:
    """One record the runner could decode: the event and where it is."""

    event: Event
    partition: int
    offset: int
    forged: str | None = None
    """Why its tenant's MAC does not authenticate it (``schemas._tenant_mac``), else None."""
    sealed_no_key: bool = False
    """It holds sealed content and this runner has no key store: folded as erased."""


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
    calls: dict[str, set[str]] = field(default_factory=dict)
    """Run id -> keys of the run state's open calls the batch may have changed."""
    approvals: dict[str, set[str]] = field(default_factory=dict)
    """Run id -> ids of the run state's approvals the batch may have changed."""
    fresh: set[str] = field(default_factory=set)
    """Runs with nothing stored before this batch."""
    extra: dict[str, Any] = field(default_factory=dict)
    erased: dict[str, int] = field(default_factory=dict)
    """Runs whose content the batch erased (a valid CONTENT_ERASED), with its offset: their
    copies up to it purged on write (a record quarantined after it is kept as any rebuild,
    whatever its batches, keeps it)."""


MAX_CACHED_RUNS = 10_000
"""Per partition and projection: past it the runner's cache of run states starts over."""

_SPLIT = ("messages", "completed_calls", "open_calls", "approvals")
"""Run-state fields stored under their own keys, written per entry, never whole."""
_SCALARS = tuple(
    f.name
    for f in dataclasses.fields(RunState)
    if f.name not in _SPLIT
    and not f.metadata.get("transient")
    and not f.metadata.get("omit_default")
)
_OMITTED = tuple(
    (f.name, f.default)
    for f in dataclasses.fields(RunState)
    if f.name not in _SPLIT and f.metadata.get("omit_default")
)
"""Fields added after the first release: left out while at their default (as ``to_dict``)."""


def _iso(value: Any) -> Any:
    if isinstance(value, tuple):
        return jsonable(value)
    return value.isoformat() if isinstance(value, datetime) else value


def scalars(st: RunState) -> dict[str, Any]:
    """The run state without what grows with the run (stored in ``run:<id>``): every
    field left is a number, a string, None or a datetime (and, off their defaults, the
    fields added since the first release: a cancellation, a fork's lineage, timers), so
    this is ``jsonable``'s result without its walk."""
    out = {name: _iso(getattr(st, name)) for name in _SCALARS}
    for name, default in _OMITTED:
        value = getattr(st, name)
        if value != default:
            out[name] = jsonable(value)
    return out


def _flat(cls: type) -> Callable[[Any], dict[str, Any]]:
    """``jsonable`` for a dataclass whose fields are numbers, strings, None or datetimes
    (an open call, an approval), omitting ``OMIT_DEFAULT`` fields at their default."""
    fields = [
        (f.name, bool(f.metadata.get("omit_default")), f.default) for f in dataclasses.fields(cls)
    ]

    def to_json(value: Any) -> dict[str, Any]:
        out = {}
        for name, omit, default in fields:
            v = getattr(value, name)
            if omit and v == default:
                continue
            out[name] = _iso(v)
        return out

    return to_json


def message_json(msg: Message) -> dict[str, Any]:
    """``jsonable(msg)`` without its walk: the tool calls are plain dicts of strings, the
    tool result a flat dataclass of strings and a bool."""
    tr = msg.tool_result
    return {
        "role": msg.role,
        "content": msg.content,
        "trust": msg.trust,
        "tool_calls": [dict(c) for c in msg.tool_calls],
        "tool_result": None if tr is None else dict(vars(tr)),
    }


_ENTRY_JSON: dict[str, Callable[[Any], dict[str, Any]]] = {
    "call": _flat(OpenCall),
    "approval": _flat(Approval),
}


def load_run_state(
    scalar: dict[str, Any],
    calls: dict[Any, Any],
    approvals: dict[Any, Any],
    messages: list[Any] | None = None,
    completed: dict[Any, Any] | None = None,
) -> dict[str, Any]:
    """The ``RunState.to_dict`` shape from its stored parts (raw Redis replies)."""
    data = dict(scalar)
    data["open_calls"] = {text(k): json.loads(v) for k, v in sorted(calls.items())}
    data["approvals"] = {text(k): json.loads(v) for k, v in sorted(approvals.items())}
    data["messages"] = [json.loads(m) for m in messages or []]
    data["completed_calls"] = {text(k): text(v) for k, v in sorted((completed or {}).items())}
    return data


class Writes:
    """Serialised values shared by the projections of one transaction: when they fold one
    run state together, its JSON is made once and written to each."""

    def __init__(self) -> None:
        self._scalars: dict[int, str] = {}
        self._entries: dict[tuple[int, str], str] = {}

    def scalars(self, st: RunState) -> str:
        key = id(st)
        if key not in self._scalars:
            self._scalars[key] = dumps(scalars(st))
        return self._scalars[key]

    def entry(self, st: RunState, value: OpenCall | Approval, name: str) -> str:
        key = (id(value), name)
        if key not in self._entries:
            self._entries[key] = dumps(_ENTRY_JSON[name](value))
        return self._entries[key]


class Handler(ABC, Generic[S]):
    """The store half of a projection: load per-run states, fold a batch, queue writes.

    A projection is its pure fold (``projections/``) plus this declaration of how it is
    stored, both named in its one module of ``consumers/stores`` (``Projection``). Every
    projection folds the run state (the validator); the runner folds it once per record
    (``run_state.advance``) and hands the same ``Step`` to every projection whose copy is
    at the same point (``share``), so a record is validated once.

    The states of the runs a runner folded stay in memory between batches (``_cache``),
    so a batch loads only runs it has not seen and writes only what its records changed:
    the store work of one event does not grow with the length of its run. The cache holds
    exactly what Redis holds as long as this runner is the only writer of the partition
    and every batch it folded was committed; the runner calls ``forget`` whenever either
    may not hold (an assignment or revocation, a position another writer moved, a failed
    or unknown EXEC: a fold mutates the cached states before the commit).
    """

    name: str
    full: bool = False
    """Its run state keeps the conversation and the stored results (the state view)."""
    validator_key = "validator"
    """Field of a run JSON of an earlier store holding the whole run state."""

    def __init__(self, keys: ProjectionKeys, authority: DecisionAuthority = NO_AUTHORITY) -> None:
        self.keys = keys
        self.authority = authority
        """The decider keys the fold trusts: set on every run state this handler loads."""
        self._cache: dict[int, dict[str, tuple[S, int]]] = {}
        """Partition -> run id -> (state, applied offset), as committed."""
        self._whole: set[tuple[int, str]] = set()
        """(partition, run) loaded in an earlier shape: the next write stores all of it."""

    # The projection ------------------------------------------------------------------
    @abstractmethod
    def empty(self) -> S: ...

    @abstractmethod
    def validator(self, state: S) -> RunState:
        """The run state this projection's state folds."""

    @abstractmethod
    def share(self, state: S, validator: RunState) -> None:
        """Make ``state`` fold ``validator`` (an equal run state another projection holds)."""

    @abstractmethod
    def own(self, state: S) -> dict[str, Any]:
        """The projection's own small per-run fields (stored at ``run:<id>``)."""

    @abstractmethod
    def restore(self, own: dict[str, Any], validator: RunState) -> S:
        """Inverse of ``own`` (plus the run state)."""

    @abstractmethod
    def on_step(self, batch: Batch[S], state: S, rec: Decoded, step: Step) -> None:
        """Apply one record whose passage through the run state was ``step``."""

    def remember(self, state: S) -> Any:
        """What to keep of a run's state as loaded, for ``write_run`` (default nothing)."""
        return None

    def on_rejected(self, batch: Batch[S], state: S, rec: Rejected) -> None:
        """Default: the Redis quarantine record (written by the runner) is enough."""

    def write_run(self, pipe: Any, batch: Batch[S], run_id: str, state: S) -> None:
        """Extra writes for one changed run (beyond its JSONs, calls, approvals, runs set)."""

    def purge_keys(self, partition: int, run_id: str) -> list[tuple[str, str]]:
        """Keys besides the run state that hold copies of ``run_id``'s content, each with
        the run id whose values to scrub there ('' every value of the key): the run's
        quarantined records and what the projection adds (``consumers._erasure``)."""
        return [(self.keys.quarantine(partition), run_id)]

    def write_batch(self, pipe: Any, batch: Batch[S]) -> None:
        """Extra writes for the whole partition batch."""

    def load_extra(self, pipe: Any, partition: int, run_id: str) -> int:
        """Queue reads of what else a stored run needs (``restore_extra`` gets the replies);
        returns how many."""
        return 0

    def restore_extra(
        self, partition: int, run_id: str, data: dict[str, Any], replies: list[Any]
    ) -> None:
        """Fill ``data`` (the run state's ``to_dict`` shape) from ``load_extra``'s replies."""

    def loaded(self, partition: int, run_id: str, state: S, replies: list[Any]) -> None:
        """A run was restored; ``replies`` are its ``load_extra`` replies."""

    def done(self, state: S) -> bool:
        """True if no valid record can change the run any more: not worth caching."""
        return False

    # Loading ---------------------------------------------------------------------------
    def load_runs(
        self, client: redis.Redis, partition: int, run_ids: list[str]
    ) -> dict[str, tuple[S, int]]:
        """States and applied offsets of ``run_ids`` as stored (absent: empty, -1), read in
        two pipelined round trips (the runner's WATCH is on the positions, which every
        writer of these keys moves in the same transaction)."""
        out: dict[str, tuple[S, int]] = {}
        k = self.keys
        with client.pipeline(transaction=False) as pipe:
            for rid in run_ids:
                pipe.get(k.run(partition, rid))
            raws = pipe.execute()
        present = [(rid, raw) for rid, raw in zip(run_ids, raws, strict=True) if raw is not None]
        for rid, raw in zip(run_ids, raws, strict=True):
            if raw is None:
                fresh = self.empty()
                self.validator(fresh).authority = self.authority
                out[rid] = (fresh, -1)
        if not present:
            return out
        counts = []
        with client.pipeline(transaction=False) as pipe:
            for rid, _ in present:
                pipe.hgetall(k.calls(partition, rid))
                pipe.hgetall(k.approvals(partition, rid))
                counts.append(self.load_extra(pipe, partition, rid))
            replies = iter(pipe.execute())
        for (rid, raw), n in zip(present, counts, strict=True):
            calls, approvals = next(replies), next(replies)
            extra = [next(replies) for _ in range(n)]
            own: dict[str, Any] = json.loads(raw)
            # Views stored before the field existed: no record is known to be in them.
            offset = int(own.pop(APPLIED, -1))
            legacy = own.pop(self.validator_key, None)
            if legacy is not None:
                # An earlier store kept the whole run state inside this JSON: use it, and
                # write it apart on the next write (all of it, once).
                self._whole.add((partition, rid))
                data = dict(legacy)
                data.setdefault("open_calls", {})
                data.setdefault("approvals", {})
                data.setdefault("messages", [])
                data.setdefault("completed_calls", {})
                if self.full and own.get("version", 1) >= 2:
                    self.restore_extra(partition, rid, data, extra)
            else:
                data = load_run_state(own.pop(RUN_STATE, {}), calls, approvals)
                self.restore_extra(partition, rid, data, extra)
            state = self.restore(own, RunState.from_dict(data, self.authority))
            self.loaded(partition, rid, state, extra)
            out[rid] = (state, offset)
        return out

    # The generic part ----------------------------------------------------------------
    def forget(self, partition: int | None = None) -> None:
        """Drop cached states (of one partition, or all): the next batch reloads them."""
        if partition is None:
            self._cache.clear()
            self._whole.clear()
        else:
            self._cache.pop(partition, None)
            self._whole = {w for w in self._whole if w[0] != partition}

    def begin(self, client: redis.Redis, partition: int, run_ids: list[str]) -> Batch[S]:
        """The runs of a batch: from the cache, the others loaded."""
        cached = self._cache.get(partition, {})
        missing = [r for r in run_ids if r not in cached]
        loaded = self.load_runs(client, partition, missing) if missing else {}
        states: dict[str, S] = {}
        offsets: dict[str, int] = {}
        for rid in run_ids:
            states[rid], offsets[rid] = cached[rid] if rid in cached else loaded[rid]
        before = {rid: self.remember(st) for rid, st in states.items()}
        fresh = {rid for rid in loaded if loaded[rid][1] < 0}
        return Batch(
            partition=partition, states=states, before=before, offsets=offsets, fresh=fresh
        )

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
            self._whole.discard((batch.partition, rid))

    def takes(self, batch: Batch[S], rec: Decoded | Rejected) -> bool:
        """False if the run's state already holds ``rec`` (or it names no run).

        A run's records have increasing offsets, so one at or below the run's applied
        offset was folded before: skipping it keeps a record from counting twice when the
        partition's position went back but the run's state did not.
        """
        rid = rec.event.run_id if isinstance(rec, Decoded) else rec.run_id
        return rid is not None and rec.offset > batch.offsets.get(rid, -1)

    def step(self, batch: Batch[S], rec: Decoded, step: Step) -> None:
        """Apply a record whose ``step`` the runner already took on this run's state."""
        rid = rec.event.run_id
        self.on_step(batch, batch.states[rid], rec, step)
        if step.accepted and rec.event.type is EventType.RUN_FORKED:
            # A fork's first record carries a whole state (its parent's): written whole.
            self._whole.add((batch.partition, rid))
        elif step.accepted and rec.event.type is EventType.CONTENT_ERASED:
            # The fold erased the state's content: written whole over the stored copy, and
            # the projection's other copies of the run's content purged (``write``).
            self._whole.add((batch.partition, rid))
            batch.erased[rid] = rec.offset
        if step.accepted:
            if step.touched:
                batch.calls.setdefault(rid, set()).update(step.touched)
            if step.approval is not None:
                batch.approvals.setdefault(rid, set()).add(step.approval)
        batch.offsets[rid] = rec.offset
        batch.dirty.add(rid)

    def apply(self, batch: Batch[S], rec: Decoded | Rejected) -> bool:
        """Fold ``rec`` into its run on this projection's own run state; False if the
        run's state already holds it."""
        if not self.takes(batch, rec):
            return False
        if isinstance(rec, Decoded):
            state = batch.states[rec.event.run_id]
            self.step(batch, rec, advance(self.validator(state), rec.event, rec.forged))
        else:
            self.reject(batch, rec)
        return True

    def reject(self, batch: Batch[S], rec: Rejected) -> None:
        assert rec.run_id is not None
        self.on_rejected(batch, batch.states[rec.run_id], rec)
        batch.offsets[rec.run_id] = rec.offset
        batch.dirty.add(rec.run_id)

    def write(self, pipe: Any, batch: Batch[S], shared: Writes | None = None) -> None:
        shared = shared or Writes()
        p = batch.partition
        k = self.keys
        for rid in sorted(batch.dirty):
            state = batch.states[rid]
            st = self.validator(state)
            whole = (p, rid) in self._whole
            own = self.own(state)
            assert APPLIED not in own, f"{self.name} state uses the reserved field {APPLIED}"
            assert RUN_STATE not in own, f"{self.name} state uses the reserved field {RUN_STATE}"
            own[APPLIED] = batch.offsets[rid]
            # The run state's scalars are the same bytes in every projection of the batch:
            # serialised once, spliced in as the last field.
            pipe.set(k.run(p, rid), f'{dumps(own)[:-1]},"{RUN_STATE}":{shared.scalars(st)}}}')
            keys = st.open_calls if whole else batch.calls.get(rid, ())
            gone = sorted(key for key in keys if key not in st.open_calls)
            if gone:
                pipe.hdel(k.calls(p, rid), *gone)
            calls = {
                key: shared.entry(st, st.open_calls[key], "call")
                for key in sorted(keys)
                if key in st.open_calls
            }
            if calls:
                pipe.hset(k.calls(p, rid), mapping=calls)
            ids = st.approvals if whole else batch.approvals.get(rid, ())
            approvals = {
                a: shared.entry(st, st.approvals[a], "approval")
                for a in sorted(ids)
                if a in st.approvals
            }
            if approvals:
                pipe.hset(k.approvals(p, rid), mapping=approvals)
            if rid in batch.fresh:
                pipe.sadd(k.runs(p), rid)
            self.write_run(pipe, batch, rid, state)
            if rid in batch.erased:
                for key, owner in self.purge_keys(p, rid):
                    erasure.queue_scrub(pipe, key, owner, upto=batch.erased[rid])
        self.write_batch(pipe, batch)


def load_state_view(
    client: redis.Redis, keys: ProjectionKeys, partition: int, run_id: str
) -> dict[str, Any] | None:
    """The stored state view of a run, whole (the run state's parts put back together)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.get(keys.run(partition, run_id))
        pipe.hgetall(keys.calls(partition, run_id))
        pipe.hgetall(keys.approvals(partition, run_id))
        pipe.lrange(keys.messages(partition, run_id), 0, -1)
        pipe.hgetall(keys.completed(partition, run_id))
        pipe.hget(keys.sealed(partition), run_id)
        raw, calls, approvals, msgs, done, sealed = pipe.execute()
    if raw is None:
        return None
    view: dict[str, Any] = json.loads(raw)
    if sealed is not None:
        # Folded by a runner without keys: its content reads erased here, not in the log.
        view[SEALED] = SEALED_NO_KEY
    if "state" in view:
        # Stored by an earlier store: the run state inside (version 1: all of it; 2: all
        # but the conversation and the stored results).
        if view.get("version", 1) >= 2:
            view["state"]["messages"] = [json.loads(m) for m in msgs]
            view["state"]["completed_calls"] = {text(k): text(v) for k, v in sorted(done.items())}
        return view
    scalar = view.pop(RUN_STATE, {})
    view["state"] = load_run_state(scalar, calls, approvals, msgs, done)
    return view


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Projection:
    """One projection, declared whole in its module of ``consumers/stores``: its name, its
    pure fold and its store half. ``consumers/stores/__init__.py`` registers it with one
    line; the runner, rebuild and queries iterate that registry."""

    name: str
    fold: ModuleType
    """Its pure fold (a module of ``projections/``: no Kafka, Redis, clock or I/O)."""
    handler: type[Handler[Any]]
    """Its store half: how its per-run states are loaded, folded and written."""
    in_all: bool = True
    """Run by ``runlog project all`` (notify runs on its own, with a hook)."""
