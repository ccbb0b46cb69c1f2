"""The engine of a run, private to the package: one owner and the append pipeline.

``Engine`` is what the handles users hold (``runlog.Run``, ``runlog.aio.AsyncRun``, in
``runlog.producers._handle``) drive: the lease guard, encoding and sending, acknowledgements
and the durability barrier, the log confirmation, the cancel flag, the keys, and the entry
points of the tool-call path (``runlog.producers._calls``) and of approvals
(``runlog.producers._approvals``). The modules that drive a run use its public members, its
interface within the package; users never see it. Opening a run is
``runlog.producers._opening``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from runlog._settings import Settings
from runlog.errors import (
    AppendOutcomeUnknown,
    Cancelled,
    ConfigError,
    Fenced,
    KafkaUnavailable,
    RedisUnavailable,
    RunFinished,
    RunlogError,
    ValidationFailed,
)
from runlog.log._authority import tenant_keys_for
from runlog.log._fold import Folded, SnapshotSource, read_run
from runlog.log._keys import sealer_for
from runlog.log._reader import LogReader
from runlog.log._tail import LogTail
from runlog.producers import _approvals as approvals
from runlog.producers import _calls as calls
from runlog.producers import _timers as timers
from runlog.producers._bounds import BOUNDED_FIELDS, bound_payload
from runlog.producers._drain import HandingOver
from runlog.producers._lease import Lease, LeaseManager
from runlog.producers._ops import Steps, drive, peek
from runlog.producers._tools import Tool
from runlog.producers._writer import Ack, AckGroup, Delivered, DeliveryFailed, EventWriter, Outcome
from runlog.projections._run_state import (
    SETTLEMENT,
    RunState,
    accept,
    accepted_in_order,
    requested_before,
)
from runlog.schemas import _codec as codec
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import (
    idempotency_key,
    key_scheme_of,
    start_key,
)
from runlog.schemas._models import Event, Payload
from runlog.schemas._sealing import Sealer, subject_of
from runlog.schemas._signing import Signature
from runlog.schemas._vocabulary import OWNERSHIP, EventType

log = logging.getLogger(__name__)

CANCELLED = "cancelled"
"""The outcome of a run a person cancelled (``runlog cancel``)."""
TERMINATED = "terminated"
"""The outcome of a run a person terminated (``runlog terminate``)."""

OWN_KEPT = 10_000
"""Own records kept for a confirmation by the log tail; past it, confirmations read."""

CANCEL_FLAG_FRESH_S = 0.05
"""How old a read of the cancel flag (a barrier's, or an earlier step's own) may be for a
step's check to use it (``Engine.cancel_check``): the longest a person's cancellation can
go unseen by a step."""

MAX_EVENT_BYTES = 900_000
"""Below the broker's default ``message.max.bytes`` (1 MiB) with room for headers."""


class Snapshots(SnapshotSource, Protocol):
    """A snapshot store the writer resumes from and keeps current after each append."""

    def maybe_write(self, run: Engine) -> bool:
        """Snapshot ``run`` if it advanced an interval since its last one; never raises."""
        ...

    def due(self, run: Engine) -> bool:
        """Whether ``maybe_write`` may write now, answered without I/O (True when unsure)."""
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
    tail: LogTail | None = None
    """The process's follower of the events topic (confirmations without a read-back)."""
    draining: threading.Event = field(default_factory=threading.Event)
    """Set by a worker that drains: its dispatched runs hand over at their next step."""
    topic: str = field(init=False)
    """``settings.events_topic``, read once: every append names it."""

    def __post_init__(self) -> None:
        self.topic = self.settings.events_topic

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
                "start runs until they agree (docs/howto/production.md: growing a fleet)"
            )
        return count


@dataclass(slots=True)
class _Pending:
    event: Event
    ack: Ack


class Owned:
    """A run's identity as its owner holds it (its lease)."""

    lease: Lease

    @property
    def run_id(self) -> str:
        return self.lease.run_id

    @property
    def tenant(self) -> str:
        return self.lease.tenant

    @property
    def epoch(self) -> int:
        """The fencing token."""
        return self.lease.epoch


@dataclass
class Engine(Owned):
    """An owned run's engine. A context manager: closing releases the lease."""

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
    pending: list[_Pending] = field(default_factory=list)
    acks: AckGroup = field(default_factory=AckGroup)
    poisoned: str | None = None
    occurrences: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    attempted: set[str] = field(default_factory=set)
    """Keys this owner sent a request for, so under its own token: a fenced receiver's
    lookup with that token raises no floor above them (``producers._calls``)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    _log_view: RunState | None = None
    """Validity of this run's log up to ``position``, as every reader folds it: status,
    seq and epoch only (the rule needs no more). None until the claim is confirmed."""
    _own: dict[int, Event] = field(default_factory=dict)
    """This writer's acknowledged records at offsets the view does not cover yet."""
    _view_last: str | None = None
    """Event id of the last own record the view was extended over, when it accepted it."""
    _confirm_reader: LogReader | None = None
    _key_scheme: int | None = None
    sleeps: int = 0
    """``sleep`` calls made through this handle: the next one names timer ``_sleeps``."""
    dispatched: bool = False
    """Opened by a worker of the fleet: a ``sleep`` not yet due unwinds to the worker
    (``TimerPending``) instead of waiting in this thread."""
    since_turn: list[Event] | None = field(default_factory=list)
    """Valid events after the last MODEL_TURN; None when the replay did not see that far
    back (it started at a snapshot), so ``since_last_turn`` must read the log for it."""
    cancel_raised: bool = False
    """``Cancelled`` was raised into this owner's agent (once); its clean-up steps run,
    and the run ends cancelled when finished or closed."""
    cancel_flag: tuple[bool, float] | None = None
    """The run's cancel flag as the last read found it, and when (``time.monotonic``): the
    last barrier's ownership check (one ``MGET`` with the lease) or a step's own ``GET``
    (None: no read yet). A step's check takes it while it is at most
    ``CANCEL_FLAG_FRESH_S`` old (``cancel_check``)."""
    _cancel_flag_key: str | None = None
    inbox: list[bytes] | None = None
    """The run's decision inbox as read once its claim counted, by a batch that reads many
    in one round trip (``opening.open_claimed``): the next ``poll_decisions`` takes it
    instead of reading (None: it reads)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pipelined appends (best effort) and release the lease.

        A run whose agent was told it is cancelled (``Cancelled``) ends cancelled here."""
        try:
            if self.ends_cancelled():
                try:
                    self.finish(CANCELLED)
                except RunlogError as exc:
                    # The request stays in the log: the next owner ends the run.
                    log.warning("run %s: could not end cancelled: %s", self.run_id, exc)
            elif self.pending and self.poisoned is None:
                self.barrier()
        finally:
            self.lease.release()
            if self._confirm_reader is not None:
                self._confirm_reader.close()
                self._confirm_reader = None

    def hand_over(self) -> None:
        """Let the run go at a step's boundary (a draining worker): what was emitted is
        made durable, then the lease is released as a handover (``LeaseManager.hand_over``):
        the next owner takes it at once and its RUN_RESUMED names this owner."""
        try:
            if self.pending and self.poisoned is None:
                self.barrier()
        finally:
            self.deps.leases.hand_over(self.lease)
            if self._confirm_reader is not None:
                self._confirm_reader.close()
                self._confirm_reader = None

    # Appending --------------------------------------------------------------------------
    def fenced(self, why: str) -> Fenced:
        self.poisoned = why
        return Fenced(why, run_id=self.run_id, epoch=self.epoch, seq=self.state.seq)

    def _usable(self, event_type: EventType) -> None:
        if self.poisoned is not None:
            raise Fenced(
                f"run {self.run_id} can no longer append here: {self.poisoned}",
                run_id=self.run_id,
                epoch=self.epoch,
                seq=self.state.seq,
            )
        if self.state.status == "finished" and not (
            # A person took the finished run to settle its open calls (``runlog reconcile``):
            # recovery's records about a call are valid at that epoch, nothing else is (a
            # retry's STARTED is refused here, so no tool is invoked on an ended run).
            event_type in SETTLEMENT and self.state.settling_epoch == self.epoch
        ):
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
            raise self.fenced(f"no valid lease and Redis cannot confirm one: {exc}") from exc
        if not ok:
            raise self.fenced(f"lease of epoch {self.epoch} is no longer current")

    def _build(self, event_type: EventType, payload: Payload | dict[str, Any]) -> Event:
        return codec.build_event(
            event_type,
            payload,
            run_id=self.run_id,
            tenant=self.tenant,
            seq=self.state.seq + 1,
            epoch=self.epoch,
            writer_id=self.deps.writer_id,
            trusted=True,
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
        with self.lock:
            self._usable(et)
            return self.send(et, payload if payload is not None else kw, local=True)

    def emit_confirmed(
        self, event_type: EventType | str, payload: Payload | dict[str, Any]
    ) -> Event:
        """``emit`` by a caller that confirmed the lease in Redis itself just before
        (``AsyncRun``, which awaits that check where ``_guard`` would block its loop)."""
        et = EventType(event_type)
        with self.lock:
            self._usable(et)
            return self.send(et, payload, local=True, guard=False)

    def send(
        self,
        et: EventType,
        payload: Payload | dict[str, Any],
        *,
        local: bool,
        guard: bool = True,
    ) -> Event:
        if et in BOUNDED_FIELDS:
            # Texts that report an effect come from the outside world: bounded here, on
            # every path, so recording an effect that happened can never fail to encode.
            raw = payload.model_dump() if isinstance(payload, Payload) else payload
            payload = bound_payload(et, raw)
        ev = self._build(et, payload)
        if et is EventType.APPROVAL_REQUESTED:
            first = requested_before(self.state, ev)
            if first is not None:
                raise ValueError(
                    f"approval {first.approval_id} of run {self.run_id} was requested at seq "
                    f"{first.requested_seq}; its first request stands: ask under a new id"
                )
        value = codec.encode(ev, self.deps.ids, self._sealer(ev))
        if len(value) > MAX_EVENT_BYTES:
            raise ValidationFailed(
                f"{et.value} encodes to {len(value)} bytes, over the {MAX_EVENT_BYTES} limit"
            )
        if guard:
            self._guard()
        ack = self.acks.new()
        headers = codec.headers(ev)
        if self.deps.settings.tenant_keys:  # unset: no tenant is keyed, no header
            mac = tenant_keys_for(self.deps.settings).header(ev.tenant, self.run_id.encode(), value)
            if mac is not None:
                headers.append(mac)
        self.deps.writer.submit(
            self.deps.topic,
            self.run_id.encode(),
            value,
            headers,
            ack,
            self.partition,
        )
        if local and accept(self.state, ev):
            self.note(ev)
        self.pending.append(_Pending(ev, ack))
        return ev

    def _sealer(self, ev: Event) -> Sealer | None:
        """The sealer of the run's data subject (``RUNLOG_ENCRYPTION=on``), else None: the
        subject the RUN_STARTED names, or a fork's RUN_FORKED (its parent's), then the
        fold's ``subject``; else the run itself."""
        if self.deps.settings.encryption != "on":
            return None
        first = ev.type in (EventType.RUN_STARTED, EventType.RUN_FORKED)
        subject = ev.payload if first else self.state
        return sealer_for(self.deps.settings, ev.tenant, subject_of(subject, self.run_id))

    def barrier(self) -> list[Delivered]:
        """Wait until every emitted event is acknowledged, then re-check ownership."""
        with self.lock:
            done, pending = self.acknowledged()
            if pending:
                try:
                    ok, flag = self.lease.check_with(self.cancel_flag_key)
                except RedisUnavailable as exc:
                    raise self.unconfirmed(exc) from exc
                self.owned_after(pending, ok, flag)
            return done

    def acknowledged(self) -> tuple[list[Delivered], list[_Pending]]:
        """A barrier's first half: every emitted event's acknowledgement waited for and
        accounted (``delivered``), with the appends it covered; the ownership check after
        them is the caller's (``owned_after``). Under ``lock``."""
        pending = self.take_pending()
        try:
            self.deps.writer.wait(self.acks, [p.ack for p in pending], self.delivery_wait_s)
        except BaseException:
            self.interrupted(pending)
            raise
        return [self.delivered(p, p.ack.outcome) for p in pending], pending

    def unconfirmed(self, exc: Exception) -> Fenced:
        """The barrier's ownership check could not be asked: the run is fenced."""
        return self.fenced(f"ownership unconfirmed after append: {exc}")

    def owned_after(self, pending: list[_Pending], ok: bool, flag: bytes | None) -> None:
        """A barrier's second half: the verdict of the ownership check made after the
        acknowledgements (``Lease.check_with``: the lease and the cancel flag), which
        raises ``Fenced`` when the lease is no longer this owner's."""
        self.still_owned(ok, pending)
        self.cancel_flag = (flag is not None, time.monotonic())

    # The barrier's steps, shared with the asyncio driver (which awaits where this waits).
    @property
    def delivery_wait_s(self) -> float:
        return self.deps.settings.delivery_timeout_ms / 1000 + 5

    def take_pending(self) -> list[_Pending]:
        """The appends a barrier is about to wait for (its wait sends them at once)."""
        pending, self.pending = self.pending, []
        return pending

    def interrupted(self, unchecked: list[_Pending]) -> None:
        """A wait interrupted (a task cancelled, ^C) leaves these appends unchecked: the
        next barrier checks them, so a failed one is never taken as written."""
        self.pending[:0] = unchecked

    def delivered(self, p: _Pending, outcome: Outcome | None) -> Delivered:
        """Account for one append's acknowledgement, or poison the run with its failure
        (None: no report within the wait, so the outcome is unknown)."""
        if isinstance(outcome, DeliveryFailed):
            self.poisoned = f"append of seq {p.event.seq} failed: {outcome}"
            if outcome.unknown:
                raise AppendOutcomeUnknown(
                    f"broker did not confirm seq {p.event.seq} ({outcome}); the next "
                    "open_run learns from the log whether it was written",
                    run_id=self.run_id,
                    epoch=self.epoch,
                    seq=p.event.seq,
                ) from outcome
            raise KafkaUnavailable(f"append of seq {p.event.seq} refused: {outcome}") from outcome
        if not isinstance(outcome, Delivered):
            self.poisoned = f"no delivery report for seq {p.event.seq}"
            raise AppendOutcomeUnknown(
                self.poisoned, run_id=self.run_id, epoch=self.epoch, seq=p.event.seq
            ) from outcome
        d = outcome
        if d.partition != self.partition:
            # Cannot happen while sends name the partition; if it ever does, the
            # run's order is broken and no later append of it may be trusted.
            self.poisoned = f"seq {p.event.seq} landed in partition {d.partition}"
            raise ConfigError(
                f"run {self.run_id} lives in partition {self.partition} but seq "
                f"{p.event.seq} was written to partition {d.partition}"
            )
        self.last_offset = d.offset
        if self.first_offset is None and p.event.seq == 1:
            self.first_offset = d.offset
        self._advance_view(d.offset, p.event)
        if d.offset >= self.position and len(self._own) < OWN_KEPT:
            self._own[d.offset] = p.event
        return d

    def still_owned(self, ok: bool, pending: list[_Pending]) -> None:
        if not ok:
            raise self.fenced(f"ownership lost while seq {pending[-1].event.seq} was appended")

    def _advance_view(self, offset: int, ev: Event) -> None:
        """Extend the confirmed log view over this writer's own record at ``offset`` when
        it directly follows what the view covers: no other record, so no other owner's
        claim, can stand between them, and the log's fold of it is this writer's own."""
        view = self._log_view
        if view is None or offset != self.position:
            return  # something else was written in between: only a read can tell what
        accepted = accept(view, ev)
        _clear_folded(view)
        self.position = offset + 1
        self._view_last = ev.event_id if accepted else None

    def confirmed_locally(self, ev: Event) -> bool:
        """``ev`` is acknowledged and the log view was extended over it without a read
        (see ``_advance_view``), or over every record from the view to it, all this
        process's own (``EventWriter.own_offsets``): every reader accepts it, known at once
        (no wait, so the caller need not leave its thread or loop for it); else
        ``confirm_in_log`` asks the log tail or reads."""
        if self._view_last == ev.event_id:
            return True
        end = self.last_offset
        if self._log_view is None or end is None:
            return False
        found = self.deps.writer.own_offsets(
            self.deps.settings.events_topic,
            self.partition,
            self.run_id.encode(),
            self.position,
            end,
        )
        return self._confirmed_by(ev, found)

    def append(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Append one event and return it once acknowledged and ownership re-checked.

        A step of the agent's: a person's cancellation is raised here first (``Cancelled``,
        once), as at ``call_tool`` and as ``AsyncRun.append`` does; RUN_FINISHED is exempt
        (a cancelled run's end is recorded by it)."""
        with self.lock:
            if EventType(event_type) is not EventType.RUN_FINISHED:
                self.check_cancelled()
            return self.record(event_type, payload, **kw)

    def record(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """``append`` without the step's cancel check: the rules' own appends
        (``ops.perform``), e.g. a call's completion, which must be recorded whatever a
        person asked meanwhile."""
        with self.lock:
            ev = self.emit(event_type, payload, **kw)
            self.barrier()
            self._after_durable()
            return ev

    def mark_log_view(self) -> None:
        """The log up to ``position`` is exactly what this run's state was folded from."""
        st = self.state
        self._log_view = RunState(
            run_id=st.run_id,
            tenant=st.tenant,
            status=st.status,
            seq=st.seq,
            epoch=st.epoch,
            max_epoch_seen=st.max_epoch_seen,
            authority=st.authority,
        )
        if st.status == "finished":
            # Taken to settle an ended run's open calls: the rule for a record after the
            # finish asks about those calls, their approvals and the settling epoch.
            view = self._log_view
            view.open_calls = copy.deepcopy(st.open_calls)
            view.approvals = copy.deepcopy(st.approvals)
            view.settling_epoch, view.erased = st.settling_epoch, st.erased

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
            raise self.fenced(f"seq {ev.seq} cannot be confirmed: no confirmed claim")
        if self._confirmed_by_tail(ev):
            return
        end = self.last_offset + 1
        if self._confirm_reader is None:
            self._confirm_reader = self.deps.reader_factory()
        view, accepted = self._log_view, False
        try:
            for rec in self._confirm_reader.read(
                self.run_id, partition=self.partition, start=self.position, end=end
            ):
                if accept(view, rec.event, rec.forged) and rec.event.event_id == ev.event_id:
                    accepted = True
                _clear_folded(view)
        except KafkaUnavailable as exc:
            # Unconfirmed is not refused: the tool must not run, and this writer cannot know
            # what the log holds any more. The next open_run learns it from the log.
            self.poisoned = f"seq {ev.seq} could not be confirmed in the log: {exc}"
            raise AppendOutcomeUnknown(
                self.poisoned, run_id=self.run_id, epoch=self.epoch, seq=ev.seq
            ) from exc
        self._moved_to(end)
        if not accepted:
            raise self.fenced(
                f"seq {ev.seq} of epoch {self.epoch} is not valid in the log (a newer owner "
                f"of epoch {view.max_epoch_seen} claimed the run, though Redis says we own it)"
            )

    def _confirmed_by_tail(self, ev: Event) -> bool:
        """``ev`` (the last acknowledged record) is valid as far as the process's own
        acknowledgements or its log tail show: every record of this run between the
        confirmed view and ``ev`` is this run's own, so the log's fold of them is the one
        below. False when neither can say or they show another writer's record: the caller
        reads the log.

        The process's writer knows first: when every offset in the range is one its
        producer had acknowledged (other runs of this process, the usual case of many runs
        in one worker), the range holds those records and no other, known without waiting
        for anything (``EventWriter.own_offsets``). Else the tail answers once it has read
        past ``ev``: a fetch, shared by every confirmation waiting on the partition."""
        view, end = self._log_view, self.last_offset
        if view is None or end is None:
            return False
        key = self.run_id.encode()
        found = self.deps.writer.own_offsets(
            self.deps.settings.events_topic, self.partition, key, self.position, end
        )
        if found is None:
            tail = self.deps.tail
            if tail is None:
                return False
            tail.follow(self.partition, self.position)
            found = tail.offsets_of(self.partition, key, self.position, end)
        return self._confirmed_by(ev, found)

    def _confirmed_by(self, ev: Event, found: list[int] | None) -> bool:
        """Extend the confirmed view over this run's records at the offsets ``found`` (every
        record of the run from the view to its last acknowledged one), when they are all
        this writer's own and the fold accepts ``ev`` among them."""
        view, end = self._log_view, self.last_offset
        if found is None or view is None or end is None:
            return False
        if any(off not in self._own for off in found):
            return False
        events = [self._own[off] for off in found]
        if all(e.event_id != ev.event_id for e in events):
            return False  # the read gives the verdict and its reason
        # Folded into the view itself when no fold can refuse (a run's own next records,
        # the usual case); else into a copy, so a refusal leaves the view as it was.
        trial = view if accepted_in_order(view, events) else copy.deepcopy(view)
        accepted = False
        for off in found:
            if accept(trial, self._own[off]) and self._own[off].event_id == ev.event_id:
                accepted = True
            _clear_folded(trial)
        if not accepted:
            return False  # the read gives the verdict and its reason
        self._log_view = trial
        self._moved_to(end + 1)
        return True

    def _moved_to(self, position: int) -> None:
        """The view now covers the log up to ``position``."""
        self.position = max(self.position, position)
        self._own = {off: ev for off, ev in self._own.items() if off >= self.position}

    def _after_durable(self) -> None:
        if self.deps.snapshots is not None:
            self.deps.snapshots.maybe_write(self)

    def note(self, ev: Event) -> None:
        if ev.type is EventType.MODEL_TURN:
            self.since_turn = []
        elif self.since_turn is not None:
            self.since_turn.append(ev)

    def since_last_turn(self) -> list[Event]:
        """The run's valid events after its last MODEL_TURN (all of them if it has none).

        What a worker re-executed after a crash needs in order not to record a fact twice
        that the log already holds, though the fold does not keep it (a guardrail trip, the
        RUN_FINISHED event itself).
        """
        with self.lock:
            if self.since_turn is None:
                if self.pending:
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
                self.since_turn = []
                for ev in valid_kept(got.folded):
                    self.note(ev)
            return list(self.since_turn)

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

    @property
    def key_scope(self) -> str:
        """The default scope of this run's keys: the run, or for a fork its lineage's root
        (so an action is the same logical action in every timeline; ``producers._forks``)."""
        lineage = self.state.lineage
        return self.run_id if lineage is None else lineage.key_scope

    def key_for(self, name: str, args: dict[str, Any], *, operation_id: str | None = None) -> str:
        """The key the next ``call_tool(name, args)`` will use (without consuming it)."""
        return self.next_call(name, args, operation_id)[2]

    def next_call(
        self, name: str, args: dict[str, Any], operation_id: str | None
    ) -> tuple[tuple[str, str, str], str, str]:
        """``(occurrence, args_json, key)`` of the next call of ``name`` with ``args``: the
        key names the occurrence's ordinal among the same (scope, tool, arguments), so a
        re-executed loop reaches the same keys. Raises on arguments JSON cannot carry."""
        args_json = canonical_json(args)
        occurrence = (operation_id or self.key_scope, name, args_json)
        ordinal = self.occurrences[occurrence]
        return occurrence, args_json, self.idempotency_key(*occurrence, ordinal)

    def call_tool(
        self,
        name: str,
        args: dict[str, Any],
        *,
        operation_id: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Invoke a tool at most once per logical action; see docs/concepts/effects.md."""
        return drive(
            self, calls.call_tool(self, name, args, operation_id=operation_id, call_id=call_id)
        )

    # Approvals and the end ---------------------------------------------------------------
    def request_approval(
        self,
        reason: str,
        *,
        kind: str = "action",
        deadline_s: float | None = None,
        **fields: Any,
    ) -> str:
        """Ask a person; returns the approval id that ``runlog approve``/``reject`` names.

        ``deadline_s``: the decision is due that many seconds from now (recorded as the
        request's ``due_at``; ``runlog approvals --overdue`` names it once it passed)."""
        return drive(
            self,
            approvals.request_approval(self, reason, kind=kind, deadline_s=deadline_s, **fields),
        )

    def decide(
        self,
        approval_id: str,
        *,
        approved: bool,
        decided_by: str,
        note: str = "",
        signature: Signature | None = None,
        answer: str | None = None,
    ) -> None:
        """Record a person's decision; settles the call it concerns when the tool is here.

        Signed with this process' decider key (``RUNLOG_DECIDER_KEY_FILE``) unless
        ``signature`` (a decider's, made elsewhere) is given. When the readers trust
        decider keys, an unsigned or untrusted decision raises ``NotADecider``.
        """
        drive(
            self,
            calls.decide(
                self,
                approval_id,
                approved=approved,
                decided_by=decided_by,
                note=note,
                signature=signature,
                answer=answer,
            ),
        )

    def poll_decisions(self) -> int:
        """Record the decisions people queued while this worker held the run."""
        return drive(self, approvals.poll_decisions(self, calls.decide))

    def recover(self) -> None:
        """Settle every open call its tools allow settling now (``open_run`` does this)."""
        drive(self, calls.recover(self))

    def sleep(self, seconds: float) -> None:
        """A durable timer: the run continues ``seconds`` from the first time this call
        was reached, however often the agent is re-executed meanwhile.

        The k-th ``sleep`` of a run records TIMER_STARTED once (its ``due_at``); a re-executed
        agent reaching it again waits only for what is left. In a worker of the fleet the
        wait holds nothing: the run's lease and slot are released and the run is dispatched
        again when it is due (``docs/concepts/fleet.md``). Elsewhere it waits in this thread.

        A step: a person's cancellation is raised here first (``Cancelled``, once), also when
        the timer was recorded before, so a sleeping run that is cancelled and dispatched
        again stops here instead of going back to sleep.
        """
        self.check_cancelled()
        with self.lock:
            nxt = timers.next_timer(self.state, self.sleeps)
            self.sleeps += 1
            if nxt.recorded is not None:
                due = nxt.recorded.due_at
            else:
                fields = timers.payload(nxt.ordinal, seconds, timers.SLEEP)
                self.record(EventType.TIMER_STARTED, fields)  # checked above
                due = self.state.timers[nxt.ordinal].due_at
        timers.wait_or_raise(self.run_id, due, block=not self.dispatched)

    def finish(self, outcome: str, summary: str = "") -> Event:
        """Append RUN_FINISHED and release the lease.

        On a run that already finished with ``outcome``, returns the recorded RUN_FINISHED:
        a worker killed just after its finish was acknowledged and re-executed from the
        top reaches the same call again. A different outcome raises ``RunFinished``.

        A run a person cancelled ends ``cancelled`` whatever ``outcome`` says (the
        summary names the request); ``summary`` is kept after it.
        """
        outcome, summary = self.final_outcome(outcome, summary)
        try:
            if self.state.status == "finished" and self.state.outcome == outcome:
                for ev in reversed(self.since_last_turn()):
                    if ev.type is EventType.RUN_FINISHED:
                        return ev
            return self.append(EventType.RUN_FINISHED, outcome=outcome, summary=summary)
        finally:
            self.lease.release()

    # Cancellation ----------------------------------------------------------------------
    @property
    def cancel_flag_key(self) -> str:
        if self._cancel_flag_key is None:  # constant per run, asked for at every check
            self._cancel_flag_key = approvals.cancel_flag_key(self.deps, self.tenant, self.run_id)
        return self._cancel_flag_key

    def check_cancelled(self) -> None:
        """Raise ``Cancelled`` (once) if a person cancelled the run: call before a step of
        your own (``call_tool`` and the agent loop's model turns already check)."""
        drive(self, self.cancel_check())

    def cancel_check(self) -> Steps[None]:
        """A step's check (before a model turn or a tool call), as the rules' steps: raise
        ``Cancelled`` into the agent, once, when a person cancelled the run; raise
        ``HandingOver`` when the worker that dispatched the run drains (``producers._drain``).

        The run's cancel flag is read while no cancellation is in the state. A read at most
        ``CANCEL_FLAG_FRESH_S`` old answers the check: the last barrier's ownership check's
        (one ``MGET`` with the lease, so steps that append durably cost no round trip of
        their own) or an earlier step's own ``GET``; an older one, or none, is replaced by a
        ``GET`` here. So a cancellation is seen by the owner's first step that begins
        ``CANCEL_FLAG_FRESH_S`` or more after it was requested (an agent whose steps are
        further apart than that: its next step), and a loop of pipelined steps asks Redis
        once per ``CANCEL_FLAG_FRESH_S``, however many steps it makes meanwhile. When the
        flag is set, the inbox's cancellation is recorded first (``approvals.poll_cancel``).
        After ``Cancelled`` was raised the agent's steps run again (its clean-up), and the
        run ends cancelled when it is finished or closed (``Run.finish``, ``Run.close``).
        """
        st = self.state
        if self.dispatched and self.deps.draining.is_set() and st.status != "finished":
            raise HandingOver(self.run_id)
        if st.status == "finished" or self.cancel_raised:
            return
        if st.cancel is None:
            read = self.cancel_flag
            if read is not None and time.monotonic() - read[1] <= CANCEL_FLAG_FRESH_S:
                seen = read[0]
            else:
                asked = time.monotonic()
                try:
                    seen = (yield from peek(self.cancel_flag_key)) is not None
                except RedisUnavailable:
                    # Not a reason to stop: the ownership check after the step's next
                    # append asks Redis too, and fences the run if it cannot. The request
                    # waits in the inbox.
                    return
                self.cancel_flag = (seen, asked)
            if not seen:
                return
            self.cancel_flag = None  # the inbox is read now and the flag cleared: read again
            yield from approvals.poll_cancel(self)
        cancel = self.state.cancel
        if cancel is None:
            return
        self.cancel_raised = True
        raise Cancelled(
            f"run {self.run_id} was cancelled by {cancel.requested_by}: {cancel.reason}",
            requested_by=cancel.requested_by,
            reason=cancel.reason,
            run_id=self.run_id,
            seq=cancel.requested_seq,
        )

    def ends_cancelled(self) -> bool:
        """Closing must end the run cancelled: its agent was told, and it has not ended."""
        return (
            self.cancel_raised
            and self.state.cancel is not None
            and self.state.status != "finished"
            and self.poisoned is None
            and not self.lease.released
        )

    def final_outcome(self, outcome: str, summary: str) -> tuple[str, str]:
        """The outcome and summary a finish records: ``cancelled`` once a person cancelled."""
        c = self.state.cancel
        if c is None or self.state.status == "finished":
            return outcome, summary
        why = f"cancelled by {c.requested_by}: {c.reason}"
        return CANCELLED, why if not summary or outcome == CANCELLED else f"{why}; {summary}"

    # Reading back ----------------------------------------------------------------------
    def read_back(self, reader: LogReader, end: int) -> set[str]:
        """Fold this run's records up to ``end``; returns the ids of the events accepted.

        When the process's writer (``EventWriter.own_offsets``) or its log tail shows that
        every record of this run in the range is this writer's own, ending with its record
        at ``end - 1`` (a claim nobody raced), they are folded from what was written,
        without a read: the log holds exactly those records of the run there, so its fold
        is this one. Another writer's record, or neither able to say, and the range is
        read."""
        by_tail = self._read_back_by_tail(end)
        if by_tail is not None:
            return by_tail
        accepted: set[str] = set()
        for rec in reader.read(self.run_id, partition=self.partition, start=self.position, end=end):
            if accept(self.state, rec.event, rec.forged):
                accepted.add(rec.event.event_id)
                self.note(rec.event)
        self.position = max(self.position, end)
        return accepted

    def _read_back_by_tail(self, end: int) -> set[str] | None:
        if end <= self.position:
            return None
        key = self.run_id.encode()
        found = self.deps.writer.own_offsets(
            self.deps.settings.events_topic, self.partition, key, self.position, end - 1
        )
        if found is None:
            tail = self.deps.tail
            if tail is None:
                return None
            tail.follow(self.partition, self.position)
            found = tail.offsets_of(self.partition, key, self.position, end - 1)
        if found is None or end - 1 not in found or any(off not in self._own for off in found):
            return None
        accepted: set[str] = set()
        for off in found:
            ev = self._own[off]
            if accept(self.state, ev):
                accepted.add(ev.event_id)
                self.note(ev)
        self._moved_to(end)
        return accepted


def barrier_all(runs: list[Engine]) -> dict[str, list[Delivered] | Exception]:
    """``barrier`` of many runs at once (claims of runs adopted together): the first wait
    sends every run's queued appends in one go (the others find theirs acknowledged by
    the same flush), then every run's ownership is checked in one Redis round trip
    (``LeaseManager.check_many``), each after its own acknowledgements, as ``barrier``
    checks. A run's failure (fenced, an append refused or unknown) is its own: returned
    in its place, the other runs go on. Run ids must be distinct."""
    out: dict[str, list[Delivered] | Exception] = {}
    with contextlib.ExitStack() as held:
        checked: list[tuple[Engine, list[Delivered], list[_Pending]]] = []
        for run in runs:
            held.enter_context(run.lock)
            try:
                done, pending = run.acknowledged()
            except Exception as exc:  # noqa: BLE001 - this run's alone, as its barrier's
                out[run.run_id] = exc
                continue
            if pending:
                checked.append((run, done, pending))
            else:
                out[run.run_id] = done
        if not checked:
            return out
        leases = [(run.lease, run.cancel_flag_key) for run, _, _ in checked]
        try:
            verdicts = checked[0][0].deps.leases.check_many(leases)
        except RedisUnavailable as exc:
            for run, _, _ in checked:
                out[run.run_id] = run.unconfirmed(exc)
            return out
        for (run, done, pending), (ok, flag) in zip(checked, verdicts, strict=True):
            try:
                run.owned_after(pending, ok, flag)
            except Exception as exc:  # noqa: BLE001 - this run's alone
                out[run.run_id] = exc
                continue
            out[run.run_id] = done
    return out


def _clear_folded(view: RunState) -> None:
    """The log view answers "is it valid" through the one acceptance rule; what the rule
    folds besides (messages, calls) lives in ``state``, not twice. An ended run's view keeps
    its open calls and approvals: the rule for its settlement asks about them."""
    if view.status == "finished":
        return
    view.messages.clear()
    view.completed_calls.clear()
    view.open_calls.clear()
    view.approvals.clear()


def valid_kept(folded: Folded) -> list[Event]:
    fenced = {rec.offset for rec in folded.fenced}
    return [rec.event for rec in folded.kept if rec.offset not in fenced]
