"""A run as its writer sees it: one owner, durable appends, the idempotent tool-call path.

Starting and resuming are the same call (``open_run_with``): acquire the lease, replay the
run's valid log into state, claim ownership with RUN_STARTED or RUN_RESUMED (confirmed by
reading the log back), then settle uncertain calls before anything else may act.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from runlog.errors import (
    AppendOutcomeUnknown,
    CallUncertain,
    ConfigError,
    Escalated,
    Fenced,
    KafkaUnavailable,
    RedisUnavailable,
    RunFinished,
    RunLocked,
    TenantMismatch,
    ToolFailed,
    UnknownRun,
    UnknownTool,
    ValidationFailed,
)
from runlog.log.fold import Folded, SnapshotSource, read_run
from runlog.log.reader import LogReader
from runlog.producers.bounds import BOUNDED_FIELDS, bound_payload, bound_result
from runlog.producers.context import CallContext, call_context
from runlog.producers.lease import METRICS, Held, Lease, LeaseManager
from runlog.producers.tools import Tool, ToolError
from runlog.producers.writer import Delivered, DeliveryFailed, EventWriter
from runlog.projections.run_state import RunState, accept
from runlog.schemas import codec
from runlog.schemas.canonical import canonical_json
from runlog.schemas.keys import (
    check_run_id,
    idempotency_key,
    key_scheme_of,
    new_run_id,
    partition_for,
    start_key,
)
from runlog.schemas.models import Event, Payload
from runlog.schemas.vocabulary import OWNERSHIP, EventType
from runlog.settings import Settings

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 900_000
"""Below the broker's default ``message.max.bytes`` (1 MiB) with room for headers."""

CLAIM_ATTEMPTS = 5


class Snapshots(SnapshotSource, Protocol):
    """A snapshot store the writer resumes from and keeps current after each append."""

    def maybe_write(self, run: Run) -> bool:
        """Snapshot ``run`` if it advanced an interval since its last one; never raises."""
        ...


@dataclass
class RunDeps:
    """What a run needs; wired once per process by the composition root."""

    settings: Settings
    writer: EventWriter
    leases: LeaseManager
    redis: redis.Redis
    reader_factory: Callable[[], LogReader]
    writer_id: str
    snapshots: Snapshots | None = None
    ids: codec.SchemaIds | None = None
    """Schema ids when a registry is configured: records are then in Confluent's format."""

    def start_key(self, tenant: str, run_id: str) -> str:
        return start_key(self.settings.redis_key_prefix, tenant, run_id)

    def partition_count(self) -> int:
        """The events topic's partition count, checked against the deployment's once.

        A fresh run is placed by hashing its id over this count; a topic that grew since
        would place it where readers that trust ``RUNLOG_PARTITIONS`` never look.
        """
        count = self.writer.partition_count(self.settings.events_topic)
        if count != self.settings.partitions:
            raise ConfigError(
                f"topic {self.settings.events_topic} has {count} partitions but "
                f"RUNLOG_PARTITIONS is {self.settings.partitions}: runlog refuses to "
                "start runs until they agree (README: growing a fleet)"
            )
        return count


@dataclass
class _Pending:
    event: Event
    future: Future[Delivered]


@dataclass
class Run:
    """An owned run. Use as a context manager: closing releases the lease."""

    deps: RunDeps
    lease: Lease
    state: RunState
    tools: dict[str, Tool]
    partition: int
    position: int
    """Offset just past the last record this run has read or written in its partition."""
    first_offset: int | None = None
    last_offset: int | None = None
    """Offset of this run's last acknowledged record."""
    _pending: list[_Pending] = field(default_factory=list)
    _poisoned: str | None = None
    _occurrences: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _log_view: RunState | None = None
    """Validity of this run's log up to ``position``, as every reader folds it: status,
    seq and epoch only (the rule needs no more). None until the claim is confirmed."""
    _confirm_reader: LogReader | None = None
    _key_scheme: int | None = None
    _since_turn: list[Event] | None = field(default_factory=list)
    """Valid events after the last MODEL_TURN; None when the replay did not see that far
    back (it started at a snapshot), so ``since_last_turn`` must read the log for it."""

    # Identity ---------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.lease.run_id

    @property
    def tenant(self) -> str:
        return self.lease.tenant

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pipelined appends (best effort) and release the lease."""
        try:
            if self._pending and self._poisoned is None:
                self.barrier()
        finally:
            self.lease.release()
            if self._confirm_reader is not None:
                self._confirm_reader.close()
                self._confirm_reader = None

    # Appending --------------------------------------------------------------------------
    def _fenced(self, why: str) -> Fenced:
        self._poisoned = why
        return Fenced(why, run_id=self.run_id, epoch=self.epoch, seq=self.state.seq)

    def _usable(self, event_type: EventType) -> None:
        if self._poisoned is not None:
            raise Fenced(
                f"run {self.run_id} can no longer append here: {self._poisoned}",
                run_id=self.run_id,
                epoch=self.epoch,
                seq=self.state.seq,
            )
        if self.state.status == "finished":
            raise RunFinished(
                f"run {self.run_id} finished with {self.state.outcome!r}",
                run_id=self.run_id,
                seq=self.state.seq,
            )
        if event_type in OWNERSHIP and self.state.status != "new":
            raise ValueError(f"{event_type.value} is appended by open_run only")

    def _guard(self) -> None:
        if self.lease.locally_valid():
            return
        try:
            ok = not self.lease.lost and self.lease.check()
        except RedisUnavailable as exc:
            raise self._fenced(f"no valid lease and Redis cannot confirm one: {exc}") from exc
        if not ok:
            raise self._fenced(f"lease of epoch {self.epoch} is no longer current")

    def _build(self, event_type: EventType, payload: Payload | dict[str, Any]) -> Event:
        # The payload is validated against its model (the caller's input); the envelope
        # is made here from values this writer owns, so it skips a second validation.
        return Event.model_construct(
            event_id=codec.new_event_id(),
            run_id=self.run_id,
            tenant=self.tenant,
            seq=self.state.seq + 1,
            epoch=self.epoch,
            type=event_type,
            schema_version=codec.registry().current[event_type],
            occurred_at=codec.now_utc(),
            writer_id=self.deps.writer_id,
            payload=codec.make_payload(event_type, payload),
        )

    def emit(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Pipeline an event without waiting; ``barrier()`` makes everything emitted durable.

        Nothing may act on an emitted event before the barrier returns.
        """
        et = EventType(event_type)
        with self._lock:
            self._usable(et)
            return self._emit(et, payload if payload is not None else kw, local=True)

    def _emit(self, et: EventType, payload: Payload | dict[str, Any], *, local: bool) -> Event:
        if et in BOUNDED_FIELDS:
            # Texts that report an effect come from the outside world: bounded here, on
            # every path, so recording an effect that happened can never fail to encode.
            raw = payload.model_dump() if isinstance(payload, Payload) else payload
            payload = bound_payload(et, raw)
        ev = self._build(et, payload)
        value = codec.encode(ev, self.deps.ids)
        if len(value) > MAX_EVENT_BYTES:
            raise ValidationFailed(
                f"{et.value} encodes to {len(value)} bytes, over the {MAX_EVENT_BYTES} limit"
            )
        self._guard()
        fut = self.deps.writer.send(
            self.deps.settings.events_topic,
            self.run_id.encode(),
            value,
            codec.headers(ev),
            partition=self.partition,
        )
        if local and accept(self.state, ev):
            self._note(ev)
        self._pending.append(_Pending(ev, fut))
        return ev

    def barrier(self) -> list[Delivered]:
        """Wait until every emitted event is acknowledged, then re-check ownership."""
        with self._lock:
            pending, self._pending = self._pending, []
            done: list[Delivered] = []
            timeout = self.deps.settings.delivery_timeout_ms / 1000 + 5
            for p in pending:
                try:
                    d = p.future.result(timeout=timeout)
                except DeliveryFailed as exc:
                    self._poisoned = f"append of seq {p.event.seq} failed: {exc}"
                    if exc.unknown:
                        raise AppendOutcomeUnknown(
                            f"broker did not confirm seq {p.event.seq} ({exc}); the next "
                            "open_run learns from the log whether it was written",
                            run_id=self.run_id,
                            epoch=self.epoch,
                            seq=p.event.seq,
                        ) from exc
                    raise KafkaUnavailable(f"append of seq {p.event.seq} refused: {exc}") from exc
                except FutureTimeout as exc:
                    self._poisoned = f"no delivery report for seq {p.event.seq}"
                    raise AppendOutcomeUnknown(
                        self._poisoned, run_id=self.run_id, epoch=self.epoch, seq=p.event.seq
                    ) from exc
                if d.partition != self.partition:
                    # Cannot happen while sends name the partition; if it ever does, the
                    # run's order is broken and no later append of it may be trusted.
                    self._poisoned = f"seq {p.event.seq} landed in partition {d.partition}"
                    raise ConfigError(
                        f"run {self.run_id} lives in partition {self.partition} but seq "
                        f"{p.event.seq} was written to partition {d.partition}"
                    )
                done.append(d)
                self.last_offset = d.offset
                if self.first_offset is None and p.event.seq == 1:
                    self.first_offset = d.offset
            if pending:
                try:
                    ok = self.lease.check()
                except RedisUnavailable as exc:
                    raise self._fenced(f"ownership unconfirmed after append: {exc}") from exc
                if not ok:
                    raise self._fenced(
                        f"ownership lost while seq {pending[-1].event.seq} was appended"
                    )
            return done

    def append(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Append one event and return it once acknowledged and ownership re-checked."""
        with self._lock:
            ev = self.emit(event_type, payload, **kw)
            self.barrier()
            self._after_durable()
            return ev

    def _mark_log_view(self) -> None:
        """The log up to ``position`` is exactly what this run's state was folded from."""
        st = self.state
        self._log_view = RunState(
            run_id=st.run_id,
            tenant=st.tenant,
            status=st.status,
            seq=st.seq,
            epoch=st.epoch,
            max_epoch_seen=st.max_epoch_seen,
        )

    def confirm_in_log(self, ev: Event) -> None:
        """Read this run's log up to ``ev`` (acknowledged) and raise ``Fenced`` unless every
        reader accepts it.

        The lease checks ask Redis, and Redis can go back in time (a restart from an AOF
        that lost its last second, a failover to a replica that never saw a takeover):
        a stale owner then passes them while its records are fenced in the log. Reading
        the log back to its own record is the one check that cannot be fooled, so an
        effect nobody could undo is started only after it.
        """
        if self._log_view is None or self.last_offset is None:
            raise self._fenced(f"seq {ev.seq} cannot be confirmed: no confirmed claim")
        end = self.last_offset + 1
        if self._confirm_reader is None:
            self._confirm_reader = self.deps.reader_factory()
        view, accepted = self._log_view, False
        for rec in self._confirm_reader.read(
            self.run_id, partition=self.partition, start=self.position, end=end
        ):
            if accept(view, rec.event) and rec.event.event_id == ev.event_id:
                accepted = True
            # The view answers "is it valid" through the one acceptance rule; what the
            # rule folds besides (messages, calls) lives in ``state``, not twice.
            view.messages.clear()
            view.completed_calls.clear()
            view.open_calls.clear()
            view.approvals.clear()
        self.position = max(self.position, end)
        if not accepted:
            raise self._fenced(
                f"seq {ev.seq} of epoch {self.epoch} is not valid in the log (a newer owner "
                f"of epoch {view.max_epoch_seen} claimed the run, though Redis says we own it)"
            )

    def _after_durable(self) -> None:
        if self.deps.snapshots is not None:
            self.deps.snapshots.maybe_write(self)

    def _note(self, ev: Event) -> None:
        if ev.type is EventType.MODEL_TURN:
            self._since_turn = []
        elif self._since_turn is not None:
            self._since_turn.append(ev)

    def since_last_turn(self) -> list[Event]:
        """The run's valid events after its last MODEL_TURN (all of them if it has none).

        What a worker re-executed after a crash needs in order not to record a fact twice
        that the log already holds, though the fold does not keep it (a guardrail trip, the
        RUN_FINISHED event itself).
        """
        with self._lock:
            if self._since_turn is None:
                if self._pending:
                    self.barrier()
                end = max(self.position, (self.last_offset or -1) + 1)
                reader = self.deps.reader_factory()
                try:
                    got = read_run(
                        reader,
                        self.deps.redis,
                        self.deps.settings,
                        self.tenant,
                        self.run_id,
                        end=end,
                        keep=True,
                    )
                finally:
                    reader.close()
                self._since_turn = []
                for ev in _valid_kept(got.folded):
                    self._note(ev)
            return list(self._since_turn)

    # Tools -----------------------------------------------------------------------------
    @property
    def key_scheme(self) -> int:
        """The idempotency-key scheme of this run: the one of the keys its log holds."""
        if self._key_scheme is None:
            st = self.state
            proposed = (c.get("idempotency_key") for msg in st.messages for c in msg.tool_calls)
            self._key_scheme = key_scheme_of(
                [*st.completed_calls, *st.open_calls, *(k for k in proposed if k)]
            )
        return self._key_scheme

    def idempotency_key(self, scope: str, name: str, args_json: str, ordinal: int) -> str:
        """The key of occurrence ``ordinal`` of (scope, tool, args) in this run's scheme."""
        return idempotency_key(self.tenant, scope, name, args_json, ordinal, scheme=self.key_scheme)

    def key_for(self, name: str, args: dict[str, Any], *, operation_id: str | None = None) -> str:
        """The key the next ``call_tool(name, args)`` will use (without consuming it)."""
        args_json = canonical_json(args)
        scope = operation_id or self.run_id
        ordinal = self._occurrences[(scope, name, args_json)]
        return self.idempotency_key(scope, name, args_json, ordinal)

    def call_tool(
        self,
        name: str,
        args: dict[str, Any],
        *,
        operation_id: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Invoke a tool at most once per logical action; see README "Side effects"."""
        tool = self.tools.get(name)
        if tool is None:
            raise UnknownTool(f"run {self.run_id} has no tool {name!r}; pass it to open_run")
        args_json = canonical_json(args)  # refuses bad arguments before STARTED
        scope = operation_id or self.run_id
        occurrence = (scope, name, args_json)
        ordinal = self._occurrences[occurrence]
        key = self.idempotency_key(scope, name, args_json, ordinal)
        self._occurrences[occurrence] += 1
        try:
            return self.execute(
                tool,
                args_json,
                key,
                call_id=call_id or f"call-{uuid.uuid4().hex[:12]}",
                operation_id=operation_id,
            )
        except BaseException:
            # No completed key (a proven failure, or unsettled: uncertain, escalated,
            # fenced): asking again must reach the same key. A fresh one would make a
            # retry-after-failure a *different* action, and a re-execution after a crash
            # would then recompute the failed key and run the effect a second time.
            self._occurrences[occurrence] -= 1
            raise

    def execute(
        self,
        tool: Tool,
        args_json: str,
        key: str,
        *,
        call_id: str,
        operation_id: str | None = None,
    ) -> str:
        """Run the call with key ``key`` unless the log already settles it."""
        from runlog.producers import recovery

        with self._lock:
            if key not in self.state.completed_calls:
                self._stop_if_conflict()
            if key in self.state.completed_calls:
                return self.state.completed_calls[key]
            if key in self.state.open_calls:
                recovery.recover_call(self, self.state.open_calls[key])
                return self._settled(key)
            return self.attempt(
                tool, args_json, key, call_id=call_id, attempt=1, operation_id=operation_id
            )

    def _stop_if_conflict(self) -> None:
        """A conflict stops the run: no effect of any call until a person decides.

        The run is stopped by the conflict's approval request, and also by a conflict
        whose request is not in the log yet (its writer died between the two appends):
        recovery then asks again, but nothing may run meanwhile.
        """
        conflict = [c for c in self.state.open_calls.values() if c.status == "conflict"]
        if self.state.status != "escalated" and not conflict:
            return
        pending = [a.approval_id for a in self.state.pending_approvals.values()]
        pending += [c.approval_id for c in conflict if c.approval_id is not None]
        raise Escalated(
            f"run {self.run_id} is stopped by a conflict awaiting a person",
            approval_id=pending[0] if pending else None,
            run_id=self.run_id,
        )

    def _settled(self, key: str) -> str:
        if key in self.state.completed_calls:
            return self.state.completed_calls[key]
        call = self.state.open_calls.get(key)
        if call is None:
            raise ToolFailed(f"call {key} failed", run_id=self.run_id, seq=self.state.seq)
        if call.status in ("escalated", "conflict"):
            raise Escalated(
                f"call {call.name} ({key}) awaits a person's decision",
                approval_id=call.approval_id,
                run_id=self.run_id,
                seq=call.started_seq,
            )
        raise CallUncertain(
            f"outcome of {call.name} ({key}) is unknown: {call.last_evidence or call.last_error}",
            run_id=self.run_id,
            seq=call.started_seq,
        )

    def attempt(
        self,
        tool: Tool,
        args_json: str,
        key: str,
        *,
        call_id: str,
        attempt: int,
        operation_id: str | None = None,
    ) -> str:
        """STARTED (durable) -> invoke with the key -> COMPLETED, or UNCERTAIN and recovery."""
        from runlog.producers import recovery

        self._stop_if_conflict()
        started = self.append(
            EventType.TOOL_CALL_STARTED,
            call_id=call_id,
            name=tool.name,
            args_json=args_json,
            idempotency_key=key,
            attempt=attempt,
            risk=tool.risk,
            operation_id=operation_id,
        )
        if tool.risk != "safe":
            self.confirm_in_log(started)
        t0 = time.monotonic()
        try:
            with call_context(
                CallContext(self.run_id, self.tenant, self.epoch, key, attempt, started.seq)
            ):
                result = tool(json.loads(args_json), idempotency_key=key)
        except ToolError as exc:
            if attempt > 1 and not self.state.open_calls[key].proven_absent:
                # Only a retry follows an attempt whose outcome nobody knows: this failure
                # proves that *this* attempt did nothing, not the earlier one. Closing the
                # call as failed would let a re-proposal run the key afresh with no one
                # asked, so it stays uncertain and the uncertain-call rules go on (unless
                # an authoritative lookup proved the earlier attempts absent: then this
                # failure is the whole truth).
                self.append(
                    EventType.TOOL_CALL_UNCERTAIN,
                    started_seq=started.seq,
                    call_id=call_id,
                    name=tool.name,
                    idempotency_key=key,
                    error=f"attempt {attempt} failed ({exc}); an earlier attempt's outcome "
                    "is still unknown",
                    detected_by="live",
                )
                recovery.recover_call(self, self.state.open_calls[key])
                return self._settled(key)
            # Proven failure: no key, so the action may be tried again later.
            self.append(
                EventType.TOOL_CALL_COMPLETED,
                call_id=call_id,
                name=tool.name,
                started_seq=started.seq,
                content=str(exc),
                is_error=True,
                idempotency_key=None,
                source="live",
                duration_ms=_elapsed_ms(t0),
            )
            raise ToolFailed(str(exc), run_id=self.run_id, seq=started.seq) from exc
        except Exception as exc:  # noqa: BLE001 - anything but a proven failure is uncertain
            self.append(
                EventType.TOOL_CALL_UNCERTAIN,
                started_seq=started.seq,
                call_id=call_id,
                name=tool.name,
                idempotency_key=key,
                error=f"{type(exc).__name__}: {exc}",
                detected_by="live",
            )
            recovery.recover_call(self, self.state.open_calls[key])
            return self._settled(key)
        # What is recorded is what every later call with this key returns, so the live
        # caller gets the same (possibly cut) text as a re-execution after a crash.
        content = bound_result(str(result), key, tool.on_large_result)
        self.append(
            EventType.TOOL_CALL_COMPLETED,
            call_id=call_id,
            name=tool.name,
            started_seq=started.seq,
            content=content,
            is_error=False,
            idempotency_key=key,
            source="live",
            duration_ms=_elapsed_ms(t0),
        )
        return self.state.completed_calls.get(key, content)

    # Approvals and the end ---------------------------------------------------------------
    def request_approval(self, reason: str, *, kind: str = "action", **fields: Any) -> str:
        approval_id = f"ap-{uuid.uuid4().hex[:12]}"
        self.append(
            EventType.APPROVAL_REQUESTED,
            approval_id=approval_id,
            kind=kind,
            reason=reason,
            **fields,
        )
        return approval_id

    def decide(self, approval_id: str, *, approved: bool, decided_by: str, note: str = "") -> None:
        """Record a person's decision; settles the call it concerns when the tool is here."""
        from runlog.producers import recovery

        if approval_id not in self.state.approvals:
            raise KeyError(f"run {self.run_id} has no approval request {approval_id!r}")
        self.append(
            EventType.APPROVAL_DECIDED,
            approval_id=approval_id,
            approved=approved,
            decided_by=decided_by,
            note=note,
        )
        key = self.state.approvals[approval_id].idempotency_key
        if key is not None and key in self.state.open_calls:
            recovery.recover_call(self, self.state.open_calls[key])

    def inbox_key(self) -> str:
        return decisions_key(self.deps, self.tenant, self.run_id)

    def poll_decisions(self) -> int:
        """Record decisions people submitted while this worker held the lease.

        An entry is removed only after its APPROVAL_DECIDED is durable, so a crash in
        between leaves it for the next owner, which finds it already decided and drops it.
        """
        key = self.inbox_key()
        try:
            entries = self.deps.redis.lrange(key, 0, -1)
        except redis.RedisError as exc:
            raise RedisUnavailable(f"decision inbox of {self.run_id}: {exc}") from exc
        recorded = 0
        for raw in entries:
            try:
                d = json.loads(raw)
                approval_id, approved = str(d["approval_id"]), bool(d["approved"])
                decided_by, note = str(d["decided_by"]), str(d.get("note", ""))
            except (ValueError, KeyError, TypeError) as exc:
                # Never lose it, never let it block the run: keep it aside for a person.
                log.warning("malformed decision for %s set aside: %r (%s)", self.run_id, raw, exc)
                self._redis(functools.partial(self.deps.redis.rpush, key + ":malformed", raw))
                self._redis(functools.partial(self.deps.redis.lrem, key, 1, raw))  # type: ignore[arg-type]
                continue
            approval = self.state.approvals.get(approval_id)
            if approval is not None and approval.approved is None:
                try:
                    self.decide(approval_id, approved=approved, decided_by=decided_by, note=note)
                except (ToolFailed, CallUncertain, Escalated) as exc:
                    # The decision is durable; what its retry led to is in the log too.
                    log.info("decision %s on %s settled as %s", approval_id, self.run_id, exc)
                recorded += 1
            self._redis(functools.partial(self.deps.redis.lrem, key, 1, raw))  # type: ignore[arg-type]
        return recorded

    def _redis(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except redis.RedisError as exc:
            raise RedisUnavailable(f"Redis for run {self.run_id}: {exc}") from exc

    def finish(self, outcome: str, summary: str = "") -> Event:
        """Append RUN_FINISHED and release the lease.

        On a run that already finished with ``outcome``, returns the recorded RUN_FINISHED:
        a worker killed just after its finish was acknowledged and re-executed from the
        top reaches the same call again. A different outcome raises ``RunFinished``.
        """
        try:
            if self.state.status == "finished" and self.state.outcome == outcome:
                for ev in reversed(self.since_last_turn()):
                    if ev.type is EventType.RUN_FINISHED:
                        return ev
            return self.append(EventType.RUN_FINISHED, outcome=outcome, summary=summary)
        finally:
            self.lease.release()

    # Reading back ----------------------------------------------------------------------
    def _read_back(self, reader: LogReader, end: int) -> set[str]:
        """Fold this run's records up to ``end``; returns the ids of the events accepted."""
        accepted: set[str] = set()
        for rec in reader.read(self.run_id, partition=self.partition, start=self.position, end=end):
            if accept(self.state, rec.event):
                accepted.add(rec.event.event_id)
                self._note(rec.event)
        self.position = max(self.position, end)
        return accepted


def toolset(tools: Iterable[Tool]) -> dict[str, Tool]:
    """The run's tools by name, with the compensation of each tool that declares one."""
    out: dict[str, Tool] = {}
    for t in tools:
        out[t.name] = t
        inverse = t.compensation()
        if inverse is not None:
            out[inverse.name] = inverse
    return out


def decisions_key(deps: RunDeps, tenant: str, run_id: str) -> str:
    return f"{deps.leases.run_tag(tenant, run_id)}:decisions"


def submit_decision(
    deps: RunDeps,
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    tenant: str = "default",
    tools: Iterable[Tool] = (),
) -> str:
    """Record a person's decision: directly if the run is free, else via its owner's inbox.

    Returns ``"recorded"`` or ``"queued"``. Taking the free run to record the decision is
    an ownership change like any other (a RUN_RESUMED with the reason).
    """
    try:
        run = open_run_with(
            deps,
            run_id,
            tenant=tenant,
            tools=tools,
            wait_s=0,
            recover=False,
            create=False,
            reason=f"decision by {decided_by}",
        )
    except RunLocked:
        entry = {
            "approval_id": approval_id,
            "approved": approved,
            "decided_by": decided_by,
            "note": note,
        }
        try:
            deps.redis.rpush(decisions_key(deps, tenant, run_id), json.dumps(entry, sort_keys=True))
        except redis.RedisError as exc:
            raise RedisUnavailable(f"decision inbox of {run_id}: {exc}") from exc
        return "queued"
    with run:
        run.decide(approval_id, approved=approved, decided_by=decided_by, note=note)
    return "recorded"


def _acquire(
    deps: RunDeps, tenant: str, run_id: str, wait_s: float, *, takeover: bool = False
) -> Lease:
    owner = f"{deps.writer_id}/{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    while True:
        got = deps.leases.try_acquire(
            tenant, run_id, owner, deps.settings.lease_ttl_ms, force=takeover
        )
        if isinstance(got, Lease):
            return got
        assert isinstance(got, Held)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RunLocked(
                f"run {run_id} is held by {got.holder} (lease expires in {got.ttl_ms} ms)",
                run_id=run_id,
            )
        time.sleep(min(remaining, max(0.02, min(got.ttl_ms / 1000, 0.05))))


def open_run_with(
    deps: RunDeps,
    run_id: str | None = None,
    *,
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    wait_s: float | None = None,
    agent: str = "",
    goal: str = "",
    reason: str = "",
    recover: bool = True,
    create: bool = True,
    takeover: bool = False,
) -> Run:
    """Start a new run or resume an existing one: the same call either way.

    ``create=False`` refuses to start a run that has no events (``UnknownRun``).
    ``takeover=True`` breaks a live lease at once instead of waiting for it to expire:
    for a supervisor that knows the owner died (it saw the process exit). If the owner
    was alive after all, fencing stops it at its next append.
    """
    from runlog.producers import recovery

    if run_id is None:
        return _start_fresh(deps, tenant, tools, agent=agent, goal=goal)
    rid = check_run_id(run_id)  # every caller, not only the facade: it spells Redis keys
    wait = deps.settings.lease_ttl_ms / 1000 + 1 if wait_s is None else wait_s
    lease = _acquire(deps, tenant, rid, wait, takeover=takeover)
    try:
        reader = deps.reader_factory()
        try:
            run = _replay(deps, reader, lease, tools)
            if not create and run.state.status == "new":
                raise UnknownRun(f"run {rid} has no events", run_id=rid)
            if run.state.status != "finished":
                _claim(run, reader, agent=agent, goal=goal, reason=reason)
        finally:
            reader.close()
        if recover and run.state.status != "finished":
            # Decisions people queued while another worker held the run settle its
            # escalated calls; without this only an action-approval wait ever read them.
            run.poll_decisions()
            recovery.recover(run)
        return run
    except BaseException:
        lease.release()
        raise


def _start_fresh(
    deps: RunDeps, tenant: str, tools: Iterable[Tool], *, agent: str, goal: str
) -> Run:
    """Start a run under an id minted here: nothing to replay and no race to lose.

    The id holds 64 random bits and nobody else knows it yet, so no other writer can have
    appended to it: RUN_STARTED is folded locally and needs no read-back (the reader's
    consumer would cost more than the whole append).
    """
    rid = new_run_id()
    partition = partition_for(rid, deps.partition_count())
    lease = _acquire(deps, tenant, rid, 0)
    try:
        run = Run(
            deps=deps,
            lease=lease,
            state=RunState(),
            tools=toolset(tools),
            partition=partition,
            position=0,
        )
        with run._lock:
            run._emit(EventType.RUN_STARTED, {"agent": agent, "goal": goal}, local=True)
            (delivered,) = run.barrier()
        run.position = delivered.offset + 1
        run._mark_log_view()
        _index_start(run, delivered)
        log.info("run %s started at epoch %s", rid, run.epoch)
        return run
    except BaseException:
        lease.release()
        raise


def _replay(deps: RunDeps, reader: LogReader, lease: Lease, tools: Iterable[Tool]) -> Run:
    rid, tenant = lease.run_id, lease.tenant
    got = read_run(
        reader, deps.redis, deps.settings, tenant, rid, snapshots=deps.snapshots, keep=True
    )
    if got.snapshot_miss is not None:
        log.warning("snapshot of %s does not continue into the log; full replay", rid)
    state = got.state
    if state.tenant and state.tenant != tenant:
        raise TenantMismatch(
            f"run id {rid} belongs to another tenant; choose another run id",
            run_id=rid,
        )
    run = Run(
        deps=deps,
        lease=lease,
        state=state,
        tools=toolset(tools),
        partition=got.partition,
        position=got.end,
        first_offset=got.folded.first_offset,
        _since_turn=None if got.source == "snapshot" else [],
    )
    kept = _valid_kept(got.folded)
    if any(ev.type is EventType.MODEL_TURN for ev in kept):
        run._since_turn = []
    for ev in kept:
        run._note(ev)
    if state.max_epoch_seen >= lease.epoch:
        # Redis forgot epochs the log remembers (restart without persistence): go above them.
        lease.raise_floor(state.max_epoch_seen)
        if lease.lost:
            raise Fenced(f"lease of {rid} lost while raising its epoch", run_id=rid)
    return run


def _valid_kept(folded: Folded) -> list[Event]:
    fenced = {rec.offset for rec in folded.fenced}
    return [rec.event for rec in folded.kept if rec.offset not in fenced]


def _elapsed_ms(t0: float) -> int:
    return int((time.monotonic() - t0) * 1000)


def _claim(run: Run, reader: LogReader, *, agent: str, goal: str, reason: str) -> None:
    """Append the ownership event and confirm, by reading the log back, that it counts.

    A previous owner's append can land between our replay and our claim; the log then
    rejects our claim (wrong expected seq) and we claim again above what we now know.
    The claim is not folded locally: the state comes from reading the log back.
    """
    for _ in range(CLAIM_ATTEMPTS):
        st = run.state
        if st.status == "new":
            ev = run._emit(EventType.RUN_STARTED, {"agent": agent, "goal": goal}, local=False)
        else:
            gap = None
            if st.last_event_at is not None:
                gap = int((codec.now_utc() - st.last_event_at).total_seconds() * 1000)
            payload = {
                "previous_epoch": st.epoch,
                "expected_prev_seq": st.seq,
                "gap_ms": gap,
                "reason": reason or "resumed by a new owner",
            }
            ev = run._emit(EventType.RUN_RESUMED, payload, local=False)
        (delivered,) = run.barrier()
        accepted = run._read_back(reader, delivered.offset + 1)
        # Our own event must be the one the log accepted: after Redis lost its data, a
        # writer holding the same epoch number could otherwise confirm our claim for us.
        if ev.event_id in accepted:
            run._mark_log_view()
            if ev.type is EventType.RUN_STARTED:
                _index_start(run, delivered)
            else:
                METRICS["takeovers"] += 1
            log.info("run %s claimed at epoch %s seq %s", run.run_id, run.epoch, ev.seq)
            return
        METRICS["claims_lost"] += 1
        if run.state.tenant and run.state.tenant != run.tenant:
            raise TenantMismatch(
                f"run id {run.run_id} was started by another tenant meanwhile",
                run_id=run.run_id,
            )
        if run.state.status == "finished":
            # The previous owner's RUN_FINISHED landed first: nothing left to own.
            log.info("run %s finished before our claim; returning it as finished", run.run_id)
            return
        log.warning("claim of %s at seq %s lost a race; claiming again", run.run_id, ev.seq)
        if run.state.max_epoch_seen > run.epoch:
            raise run._fenced(f"a newer owner (epoch {run.state.max_epoch_seen}) claimed the run")
        if run.state.epoch >= run.epoch:
            # Same epoch number in the log (Redis forgot it): move above it, then claim.
            run.lease.raise_floor(run.state.max_epoch_seen)
            if run.lease.lost:
                raise run._fenced("lease lost while moving above a colliding epoch")
    raise run._fenced(f"could not claim the run after {CLAIM_ATTEMPTS} attempts")


def _index_start(run: Run, delivered: Delivered) -> None:
    try:
        run.deps.redis.set(
            run.deps.start_key(run.tenant, run.run_id),
            f"{delivered.partition}:{delivered.offset}",
            nx=True,
        )
    except redis.RedisError as exc:
        # Only an optimisation: readers fall back to the run id's time or a scan.
        log.warning("could not index the start of %s: %s", run.run_id, exc)
