"""Run state as a fold of the valid log, and the validation rule every reader shares.

This module is the definition of what a run's state means. It is pure: no Kafka, no
Redis, no clock, no I/O. ``apply`` mutates and returns the state it is given so that a
long replay does not copy the message list per event; ``fold`` starts from a fresh state,
so from the outside replay is a pure function of the events.

Validation (deterministic, identical in every reader, because partition order is total):

* the first valid event is RUN_STARTED (or a fork's RUN_FORKED) with seq 1;
* RUN_RESUMED is valid iff its epoch is above the current epoch, its seq is the next one
  and its ``expected_prev_seq`` is the current seq: it moves ownership to its epoch;
* any other event is valid iff its epoch is the current epoch and its seq the next one;
* nothing is valid after RUN_FINISHED but CONTENT_ERASED, which is valid only there: on a
  finished run, at the next seq, above the current epoch (the eraser took the run), and the
  settlement of the calls the run left open (``runlog reconcile``): a person's RUN_RESUMED
  (``operator`` set) above the current epoch, at the next seq, on a finished run with open
  calls and no erasure, makes its epoch the *settling* one; at that epoch only the steps of
  recovery on an open call are valid (TOOL_CALL_UNCERTAIN, RECONCILIATION_ATTEMPTED, a
  TOOL_CALL_COMPLETED with ``source=reconciliation``, an APPROVAL_REQUESTED about the call),
  and a person's APPROVAL_DECIDED on such a call's escalation (signed as any decision).
  The run stays finished: nothing it does is invoked again, only evidence is recorded.

An invalid event is a fenced write: excluded from state, kept in the log, counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from runlog.errors import UnknownEventType
from runlog.projections._lineage import Lineage, fork_effect_resolved, run_forked, unpack_state
from runlog.projections._messages import Message, ToolResult
from runlog.schemas import _models as m
from runlog.schemas._keys import compensated_tool
from runlog.schemas._models import Event
from runlog.schemas._sealing import ERASED
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority, Verdict, decision_message
from runlog.schemas._vocabulary import OWNERSHIP, RECORD_ONLY, STARTS, STATE_CHANGING, EventType

FOLD_VERSION = 8
"""Bump whenever a fold rule changes meaning: snapshots of an older fold are cache misses.

1: the v1 vocabulary. 2: CONTEXT_COMPACTED v2 (tail counted in turns unless the record
pins the exact message count). 3: an open call keeps its STARTED's ``operation_id`` (so a
retry records it too); a v2 snapshot lacks it, hence a miss. 4: a decision counts only if
the state's ``authority`` accepts its signature (a forged one is rejected like a fenced
write), and a decided approval names the key that signed it. 5: RUN_STARTED v2 names the
registered agent (version, input) and TIMER_STARTED records durable timers; a v4 snapshot of
such a run lacks them, hence a miss. 6: a fork (RUN_FORKED) runs the parent's registered
agent (name, version; its own input if given); a v5 snapshot of a fork lacks them. 7:
CONTENT_ERASED is valid after RUN_FINISHED and erases the state's content fields; a v6
snapshot may hold a finished run's plaintext, so it is a miss. 8: a finished run's open calls
may be settled after its finish (``settling_epoch``); a v7 snapshot would refuse that
settlement, so it is a miss.

States of logs that never use a field added later compare equal to the states recorded
before it existed: such a field is marked ``OMIT_DEFAULT`` and ``to_dict`` leaves it out
while it holds its default (the permanent fixtures rely on this rule).
"""

OMIT_DEFAULT = {"omit_default": True}
"""Field metadata: ``to_dict`` omits the field while it equals its default."""

TRANSIENT = {"transient": True}
"""Field metadata: not part of the state (never in ``to_dict``, never compared): an input
of the fold that the reader sets, like the decider keys it trusts."""

Status = Literal["new", "running", "escalated", "finished"]
CallStatus = Literal["started", "uncertain", "escalated", "conflict", "decided"]


@dataclass
class OpenCall:
    """A started call without a completion: in flight for its writer, uncertain for a reader."""

    idempotency_key: str
    started_seq: int
    call_id: str
    name: str
    args_json: str
    risk: str
    attempt: int
    started_at: datetime
    status: CallStatus = "started"
    last_error: str | None = None
    last_evidence: str | None = None
    reconciliations: int = 0
    uncertain_recorded: bool = False
    """A TOOL_CALL_UNCERTAIN was appended for this attempt."""
    approval_id: str | None = None
    decision: bool | None = None
    """A person's decision on its escalation: True retry with the same key, False do not."""
    decision_note: str = ""
    decided_by: str = ""
    undo_first: bool = field(default=False, metadata=OMIT_DEFAULT)
    """The approved retry is "undo and retry" (APPROVAL_DECIDED v3 ``answer``): the inverse
    of what may have happened runs first, and only once it completed the call runs again
    under a fresh key (``producers._calls``)."""
    operation_id: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """The caller-given scope of its key (None: the run); every attempt records it."""

    @property
    def proven_absent(self) -> bool:
        """The latest reconciliation proved that no earlier attempt took effect or can."""
        return (self.last_evidence or "").partition(":")[0] == "absent"


@dataclass
class Approval:
    approval_id: str
    kind: str
    reason: str
    requested_seq: int
    requested_at: datetime
    idempotency_key: str | None = None
    approved: bool | None = None
    decided_by: str | None = None
    note: str = ""
    due_at: datetime | None = field(default=None, metadata=OMIT_DEFAULT)
    """When the decision is due (APPROVAL_REQUESTED v2); None: no deadline. Omitted from
    ``to_dict`` when None, so states of logs written before deadlines are unchanged."""
    key_id: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """The trusted decider key that signed the standing decision (None: unsigned, accepted
    because the reader trusts no keys)."""
    answer: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """The standing decision's answer beyond approve/reject (``UNDO_AND_RETRY``), else None."""


@dataclass
class Cancellation:
    """A person's request that the run stop (RUN_CANCEL_REQUESTED): the first one stands."""

    requested_by: str
    reason: str
    requested_seq: int
    requested_at: datetime


@dataclass
class Erasure:
    """The run's content was erased (CONTENT_ERASED): who, when, why, and which keys."""

    erased_by: str
    reason: str
    subject: str
    key_ids: list[str]
    erased_seq: int
    erased_at: datetime


@dataclass(frozen=True)
class Timer:
    """A durable timer of a run (``run.sleep``, or an agent's retry policy)."""

    due_at: datetime
    purpose: str = ""
    """Empty for ``run.sleep``; ``"retry"`` for a retry of the agent after a failure."""


@dataclass
class RunState:
    run_id: str = ""
    tenant: str = ""
    status: Status = "new"
    seq: int = 0
    """Seq of the last valid event."""
    epoch: int = 0
    """Epoch of the current owner, as the log says."""
    max_epoch_seen: int = 0
    """Highest epoch on any event of the run, valid or not: the floor for the next owner."""
    started_at: datetime | None = None
    last_event_at: datetime | None = None
    turns: int = 0
    messages: list[Message] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    completed_calls: dict[str, str] = field(default_factory=dict)
    """idempotency key -> stored result: the load-bearing deduplication fact."""
    open_calls: dict[str, OpenCall] = field(default_factory=dict)
    """idempotency key -> started call with no completion yet."""
    approvals: dict[str, Approval] = field(default_factory=dict)
    compactions: int = 0
    resumptions: int = 0
    denials: int = 0
    retries: int = 0
    fenced_writes: int = 0
    outcome: str | None = None
    summary: str = ""
    cancel: Cancellation | None = field(default=None, metadata=OMIT_DEFAULT)
    """The cancellation requested (None: none). Omitted from ``to_dict`` when None, so the
    states of logs written before cancellation existed are unchanged."""
    lineage: Lineage | None = field(default=None, metadata=OMIT_DEFAULT)
    """A fork's parent, fork point and the other timeline's effects (``projections._lineage``);
    None for a run that was started, not forked."""
    agent_version: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """The registered agent's code version that started the run (RUN_STARTED v2); None
    for a run not started through the agent registry (``runlog.agent``)."""
    agent_input: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """That agent's input, canonical JSON (RUN_STARTED v2); None like ``agent_version``."""
    agent_name: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """That agent's registered name; None like ``agent_version``."""
    subject: str | None = field(default=None, metadata=OMIT_DEFAULT)
    """The data subject the run's content is sealed for (RUN_STARTED v3 ``subject``); None:
    the run itself (``runlog.schemas._sealing.subject_of``)."""
    timers: tuple[Timer, ...] = field(default=(), metadata=OMIT_DEFAULT)
    """Each durable timer (TIMER_STARTED), by ordinal: when it is due and what for."""
    erased: Erasure | None = field(default=None, metadata=OMIT_DEFAULT)
    """The erasure of the run's content (CONTENT_ERASED); None: not erased. Once set, every
    content field of the state reads ``models.ERASED``."""
    settling_epoch: int | None = field(default=None, metadata=OMIT_DEFAULT)
    """The epoch of a person's taking of the finished run to settle its open calls (see the
    module docstring); None: the run was not taken after its finish."""
    authority: DecisionAuthority = field(
        default=NO_AUTHORITY, compare=False, repr=False, metadata=TRANSIENT
    )
    """The decider keys this reader trusts (``schemas._signing``): data the reader passes in
    (``runlog.log._authority.authority_for``), so the fold stays pure. Not state: a snapshot
    records which key set it was folded under instead (``authority.fingerprint``)."""

    @property
    def uncertain_calls(self) -> dict[str, OpenCall]:
        """Calls whose outcome is not known from the log (after a crash: every open call)."""
        return self.open_calls

    @property
    def pending_approvals(self) -> dict[str, Approval]:
        return {k: a for k, a in self.approvals.items() if a.approved is None}

    @property
    def usage(self) -> m.Usage:
        return m.Usage(input_tokens=self.input_tokens, output_tokens=self.output_tokens)

    @property
    def cost(self) -> float:
        """Model cost in USD (the public API's name for ``cost_usd``)."""
        return self.cost_usd

    def to_dict(self) -> dict[str, Any]:
        """Every durable field, JSON-ready; equal states give equal dicts."""
        out: dict[str, Any] = jsonable(self)
        return out

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of ``to_dict``: equal iff the states are equal."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], authority: DecisionAuthority = NO_AUTHORITY
    ) -> RunState:
        """Inverse of ``to_dict`` (used by snapshots), folding on under ``authority``."""
        d = dict(data)
        d["authority"] = authority
        d["started_at"] = _dt(d.get("started_at"))
        d["last_event_at"] = _dt(d.get("last_event_at"))
        d["messages"] = [
            Message(
                **{
                    **msg,
                    "tool_result": ToolResult(**msg["tool_result"]) if msg["tool_result"] else None,
                }
            )
            for msg in d.get("messages", [])
        ]
        d["open_calls"] = {
            k: OpenCall(**{**v, "started_at": _dt(v["started_at"])})
            for k, v in d.get("open_calls", {}).items()
        }
        if d.get("cancel") is not None:
            c = d["cancel"]
            d["cancel"] = Cancellation(**{**c, "requested_at": _dt(c["requested_at"])})
        d["approvals"] = {
            k: Approval(
                **{**v, "requested_at": _dt(v["requested_at"]), "due_at": _dt(v.get("due_at"))}
            )
            for k, v in d.get("approvals", {}).items()
        }
        if d.get("lineage") is not None:
            d["lineage"] = Lineage.from_dict(d["lineage"])
        if d.get("erased") is not None:
            e = d["erased"]
            d["erased"] = Erasure(**{**e, "erased_at": _dt(e["erased_at"])})
        d["timers"] = tuple(
            Timer(due_at=_dt(t["due_at"]), purpose=t.get("purpose", ""))
            for t in d.get("timers", ())
        )
        return cls(**d)


def _dt(value: Any) -> Any:
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def durable_fields(value: Any) -> Iterator[tuple[str, Any]]:
    """The fields of a dataclass instance that its JSON form holds: none marked
    ``transient`` (a reader's, such as the state's authority), and none marked
    ``omit_default`` while at its default."""
    for f in dataclasses.fields(value):
        if f.metadata.get("transient"):
            continue
        v = getattr(value, f.name)
        if f.metadata.get("omit_default") and v == f.default:
            continue
        yield f.name, v


def jsonable(value: Any) -> Any:
    """JSON-ready copy of a state: dataclasses -> dicts, tuples -> lists, datetimes -> ISO.

    Walks the values directly: ``dataclasses.asdict`` deep-copies every leaf first, which
    dominated snapshot and projection writes.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: jsonable(v) for name, v in durable_fields(value)}
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


# ---------------------------------------------------------------------------- validation


def is_valid(state: RunState, ev: Event) -> bool:
    """The acceptance rule every reader applies: the ownership rule (see the module
    docstring) and, for a decision, a decider's signature (``decision_verdict``)."""
    if not _owner_rule(state, ev):
        return False
    return ev.type is not EventType.APPROVAL_DECIDED or decision_verdict(state, ev).accepted


def decision_verdict(state: RunState, ev: Event) -> Verdict:
    """Whether the trusted deciders (``state.authority``) signed this APPROVAL_DECIDED.

    The signed bytes are rebuilt from the event itself (its run, tenant, approval and
    answer), so a signature copied onto another run, tenant, approval or answer fails.
    """
    p = ev.payload
    assert isinstance(p, m.ApprovalDecided)
    if not state.authority.enforcing:
        return state.authority.verdict(b"", p.key_id, p.signature)
    message = decision_message(
        run_id=ev.run_id,
        tenant=ev.tenant,
        approval_id=p.approval_id,
        approved=p.approved,
        decided_by=p.decided_by,
        note=p.note,
        decided_at=p.decided_at,
        answer=p.answer,
    )
    return state.authority.verdict(message, p.key_id, p.signature)


def _owner_rule(state: RunState, ev: Event) -> bool:
    if ev.type is EventType.CONTENT_ERASED:
        # Only on a finished run (a run in progress is stopped first), by whoever took it
        # after its last owner: an epoch above the current one, at the next seq.
        return (
            state.status == "finished"
            and ev.run_id == state.run_id
            and ev.tenant == state.tenant
            and ev.seq == state.seq + 1
            and ev.epoch > state.epoch
        )
    if state.status == "finished":
        return _settles(state, ev)
    if state.run_id and (ev.run_id != state.run_id or ev.tenant != state.tenant):
        return False
    if ev.seq != state.seq + 1:
        return False
    if ev.type in STARTS:
        return state.status == "new"
    if state.status == "new":
        return False
    if ev.type is EventType.RUN_RESUMED:
        p = ev.payload
        assert isinstance(p, m.RunResumed)
        return ev.epoch > state.epoch and p.expected_prev_seq == state.seq
    return ev.epoch == state.epoch


SETTLEMENT: frozenset[EventType] = frozenset(
    {
        EventType.TOOL_CALL_UNCERTAIN,
        EventType.RECONCILIATION_ATTEMPTED,
        EventType.TOOL_CALL_COMPLETED,
        EventType.APPROVAL_REQUESTED,
        EventType.APPROVAL_DECIDED,
    }
)
"""The steps of recovery on an open call that are valid on a finished run, at its settling
epoch (``_settles``), and a person's decision on an open call's escalation."""


def _settles(state: RunState, ev: Event) -> bool:
    """Whether ``ev`` takes a finished run to settle its open calls, or is a step of that
    settlement: the only writes after a finish besides the erasure."""
    if ev.run_id != state.run_id or ev.tenant != state.tenant or ev.seq != state.seq + 1:
        return False
    if state.erased is not None or not state.open_calls:
        return False
    p = ev.payload
    if ev.type is EventType.RUN_RESUMED:
        assert isinstance(p, m.RunResumed)
        return (
            p.operator is not None and ev.epoch > state.epoch and p.expected_prev_seq == state.seq
        )
    if ev.type not in SETTLEMENT or state.settling_epoch is None:
        return False
    if not (ev.epoch == state.epoch == state.settling_epoch):
        return False
    if isinstance(p, m.ToolCallCompleted) and p.source != "reconciliation":
        return False
    if isinstance(p, m.ApprovalRequested) and p.kind not in ("uncertain_call", "conflict"):
        return False
    if isinstance(
        p,
        m.ToolCallUncertain | m.ReconciliationAttempted | m.ToolCallCompleted | m.ApprovalRequested,
    ):
        return p.idempotency_key in state.open_calls
    if isinstance(p, m.ApprovalDecided):
        asked = state.approvals.get(p.approval_id)
        return asked is not None and asked.idempotency_key in state.open_calls
    return False


def rejection(state: RunState, ev: Event, forged: str | None = None) -> str | None:
    """None if ``is_valid``; otherwise why the rule rejects ``ev`` on top of ``state``.

    The reasons name what happened in the writers' terms, so verify and the audit can tell
    the expected fenced writes (a stale owner, a claim that lost a race) from a bug.
    ``forged``: the reader found the record not authenticated by its tenant's writers
    (``schemas._tenant_mac``): "forged_tenant", whatever else holds.
    """
    if forged is not None:
        return "forged_tenant"
    if is_valid(state, ev):
        return None
    if _owner_rule(state, ev):
        return "forged_decision"  # the owner's rule holds: only the signature failed
    if state.run_id and (ev.run_id != state.run_id or ev.tenant != state.tenant):
        return "foreign_record"
    if ev.epoch < state.epoch:
        return "stale_epoch_duplicate_seq" if ev.seq <= state.seq else "stale_epoch"
    if ev.type in OWNERSHIP and ev.epoch > state.epoch:
        # A would-be owner claimed on an outdated view; it re-reads and claims again.
        return "lost_claim"
    if state.status == "finished":
        return "after_finish"
    if ev.epoch > state.epoch:
        return "epoch_without_takeover"
    if ev.seq <= state.seq:
        return "duplicate_seq_same_epoch"
    if ev.seq > state.seq + 1:
        return "seq_gap"
    return "invalid_transition"


# ---------------------------------------------------------------------------- fold rules

Rule = Callable[[RunState, Event], None]


def _run_started(st: RunState, ev: Event) -> None:
    st.run_id, st.tenant, st.status = ev.run_id, ev.tenant, "running"
    st.epoch = ev.epoch
    st.started_at = ev.occurred_at
    p = ev.payload
    assert isinstance(p, m.RunStarted)
    if p.code_version is not None:
        st.agent_name, st.agent_version, st.agent_input = p.agent, p.code_version, p.input_json
    st.subject = p.subject


def _timer_started(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.TimerStarted)
    if p.timer == len(st.timers):  # the next ordinal; a repeat of a recorded one is a no-op
        st.timers = (*st.timers, Timer(due_at=p.due_at, purpose=p.purpose))


def _run_resumed(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.RunResumed)
    st.epoch = ev.epoch
    if st.status == "finished":
        # Taken after its finish to settle its open calls: the run stays finished.
        st.settling_epoch = ev.epoch
    if p.operator is None:
        # A person taking the run to record their act is not the run resuming.
        st.resumptions += 1
    # Anything started by the previous owner without a completion is now uncertain:
    # that owner can no longer report it, so only evidence can settle it.
    for call in st.open_calls.values():
        if call.status == "started":
            call.status = "uncertain"


def _user_message(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.UserMessage)
    st.messages.append(Message("user", p.content, trust="user"))


def _model_turn(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ModelTurn)
    # A proposal's fields are strings (or None): its __dict__ is its model_dump(), without
    # pydantic's serializer (a replay's fold spends most of a model turn there otherwise).
    calls = [dict(vars(c)) for c in p.tool_calls]
    st.messages.append(Message("assistant", p.text, trust="model", tool_calls=calls))
    st.turns += 1
    st.input_tokens += p.usage.input_tokens
    st.output_tokens += p.usage.output_tokens
    st.cost_usd += p.cost_usd


if any(f.annotation not in (str, str | None) for f in m.ToolCallProposal.model_fields.values()):
    raise RuntimeError("ToolCallProposal is no longer flat: _model_turn must model_dump() it")


def _tool_call_denied(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ToolCallDenied)
    content = f"denied by policy {p.policy}: {p.reason}" if p.policy else f"denied: {p.reason}"
    st.messages.append(
        Message("tool", trust="tool", tool_result=ToolResult(p.call_id, p.name, content, True))
    )
    st.denials += 1


def _tool_call_started(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ToolCallStarted)
    previous = st.open_calls.get(p.idempotency_key)
    if p.attempt > 1:
        st.retries += 1
    st.open_calls[p.idempotency_key] = OpenCall(
        idempotency_key=p.idempotency_key,
        started_seq=ev.seq,
        call_id=p.call_id,
        name=p.name,
        args_json=p.args_json,
        risk=p.risk,
        attempt=p.attempt,
        started_at=ev.occurred_at,
        last_error=previous.last_error if previous else None,
        last_evidence=previous.last_evidence if previous else None,
        reconciliations=previous.reconciliations if previous else 0,
        operation_id=p.operation_id
        if p.operation_id is not None or previous is None
        else previous.operation_id,
    )


def find_open(st: RunState, started_seq: int, key: str | None = None) -> OpenCall | None:
    """The open call a completion closes: the one started at ``started_seq``.

    ``key`` (the completion's idempotency key) is tried first, so the common case does not
    scan every open call of the run.
    """
    call = st.open_calls.get(key) if key is not None else None
    if call is not None and call.started_seq == started_seq:
        return call
    for call in st.open_calls.values():
        if call.started_seq == started_seq:
            return call
    return None


def _tool_call_completed(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ToolCallCompleted)
    st.messages.append(
        Message(
            "tool",
            trust="tool",
            tool_result=ToolResult(p.call_id, p.name, p.content, p.is_error),
        )
    )
    call = find_open(st, p.started_seq, p.idempotency_key)
    if call is not None:
        del st.open_calls[call.idempotency_key]
    if p.idempotency_key is not None:
        st.completed_calls[p.idempotency_key] = p.content  # <- the load-bearing line


def _tool_call_uncertain(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ToolCallUncertain)
    call = st.open_calls.get(p.idempotency_key)
    if call is not None:
        call.status = "uncertain" if call.status == "started" else call.status
        call.last_error = p.error
        call.uncertain_recorded = True


def _reconciliation_attempted(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ReconciliationAttempted)
    call = st.open_calls.get(p.idempotency_key)
    if call is None:
        return
    call.reconciliations += 1
    call.last_evidence = f"{p.outcome}: {p.evidence}" if p.evidence else p.outcome
    if p.action == "escalate":
        call.status = "conflict" if p.outcome == "conflict" else "escalated"
    elif p.action == "keep_uncertain":
        call.status = "uncertain"


def requested_before(st: RunState, ev: Event) -> Approval | None:
    """The standing request of the id ``ev`` (an APPROVAL_REQUESTED) asks again, if any.
    The first request of an id stands: a repeat changes nothing (the fold ignores it, the
    writer refuses it), so it never reopens a request a person decided."""
    p = ev.payload
    assert isinstance(p, m.ApprovalRequested)
    return st.approvals.get(p.approval_id)


def _approval_requested(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ApprovalRequested)
    if requested_before(st, ev) is not None:
        return
    st.approvals[p.approval_id] = Approval(
        approval_id=p.approval_id,
        kind=p.kind,
        reason=p.reason,
        requested_seq=ev.seq,
        requested_at=ev.occurred_at,
        idempotency_key=p.idempotency_key,
        due_at=p.due_at,
    )
    if p.kind in ("uncertain_call", "conflict") and p.idempotency_key in st.open_calls:
        call = st.open_calls[p.idempotency_key]
        call.approval_id = p.approval_id
        call.status = "conflict" if p.kind == "conflict" else "escalated"
    if p.kind == "conflict" and st.status != "finished":
        st.status = "escalated"


# ---------------------------------------------------------------------------- decisions
#
# A person's decision is final: the first valid APPROVAL_DECIDED of an approval stands.
# A later one is refused where it is made (``standing_decision`` asked before appending);
# one that a race let into the log anyway is record-only, "superseded" (``superseded``).
# Every reader and every decider asks these two functions, nothing else.


def standing_decision(st: RunState, approval_id: str) -> Approval | None:
    """The approval if it is decided: its first valid decision, the one that stands."""
    approval = st.approvals.get(approval_id)
    return approval if approval is not None and approval.approved is not None else None


def superseded(st: RunState, ev: Event) -> Approval | None:
    """For an APPROVAL_DECIDED about to be folded on ``st``: the standing decision it comes
    after (the event then changes nothing: it is superseded), else None."""
    p = ev.payload
    if not isinstance(p, m.ApprovalDecided):
        return None
    return standing_decision(st, p.approval_id)


def ruled_out(st: RunState, key: str) -> bool:
    """A person rejected an escalation of the call with ``key`` (the standing decision of
    an approval about it): its completion, if any, closes it unrun by that ruling, which
    settles the key (it never runs again) and is no evidence of its effect."""
    return any(a.idempotency_key == key and a.approved is False for a in st.approvals.values())


def inverse_completed(st: RunState, inverse_key: str) -> bool:
    """The compensation with key ``inverse_key`` undid its effect, as far as the log shows:
    it completed, and not by a person's rejection of its own escalation (a lost inverse
    closed unrun). The one rule for "compensated by": the writer's retry and close, a
    person's "undo and retry", and the audit all ask it."""
    return inverse_key in st.completed_calls and not ruled_out(st, inverse_key)


def decision_text(
    approval_id: str,
    decided_by: str | None,
    approved: bool | None,
    note: str,
    at: str | None,
    answer: str | None = None,
) -> str:
    """How a standing decision is named wherever one is refused or superseded."""
    verb = "approved" if approved else "rejected"
    if approved and answer == m.UNDO_AND_RETRY:
        verb = "undo and retry"
    when = f" at {at}" if at else ""
    why = f" (note: {note})" if note else ""
    return f"approval {approval_id} already decided by {decided_by}{when}: {verb}{why}"


def _approval_decided(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ApprovalDecided)
    approval = st.approvals.get(p.approval_id)
    if approval is None or superseded(st, ev) is not None:
        return  # an unknown request, or a decision after the one that stands: record-only
    approval.approved, approval.decided_by, approval.note = p.approved, p.decided_by, p.note
    approval.key_id = decision_verdict(st, ev).key_id
    approval.answer = p.answer
    key = approval.idempotency_key
    if key is not None and key in st.open_calls:
        call = st.open_calls[key]
        call.status, call.decision = "decided", p.approved
        call.decision_note, call.decided_by = p.note, p.decided_by
        call.undo_first = p.approved and p.answer == m.UNDO_AND_RETRY
    if (
        approval.kind == "conflict"
        and st.status == "escalated"
        and not any(a.kind == "conflict" for a in st.pending_approvals.values())
    ):
        st.status = "running"


def messages_in_last_turns(messages: list[Message], turns: int) -> int:
    """Messages from the start of the ``turns``-th last model turn to the end.

    The first message (the task) is always kept separately, so it never counts here.
    """
    if turns <= 0:
        return 0
    seen = 0
    for i in range(len(messages) - 1, 0, -1):
        if messages[i].role == "assistant":
            seen += 1
            if seen == turns:
                return len(messages) - i
    return max(0, len(messages) - 1)


def _context_compacted(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ContextCompacted)
    # kept_messages is the exact v1 fact (and what upcast v1 records carry): apply it
    # exactly as the v1 fold did, including its slice semantics. Otherwise count turns.
    if p.kept_messages is not None:
        keep = p.kept_messages
    else:
        keep = messages_in_last_turns(st.messages, p.kept_turns or 0)
    tail = st.messages[-keep:] if keep else []
    st.messages = [*st.messages[:1], Message("user", p.summary, trust="untrusted"), *tail]
    st.compactions += 1


def _run_finished(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.RunFinished)
    st.status, st.outcome, st.summary = "finished", p.outcome, p.summary


def _run_cancel_requested(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.RunCancelRequested)
    if st.cancel is None:  # the first request stands; a later one is told, changes nothing
        st.cancel = Cancellation(p.requested_by, p.reason, ev.seq, ev.occurred_at)


def _erase(text: str) -> str:
    return m.ERASED if text else text


def _content_erased(st: RunState, ev: Event) -> None:
    """Record the erasure and write ``ERASED`` over every content field the state holds
    (what users said, model text, tool arguments and results, summaries, approval reasons
    and notes, evidence): structure (ids, keys, seq, epoch, outcome, counts, usage) stays."""
    p = ev.payload
    assert isinstance(p, m.ContentErased)
    st.epoch = ev.epoch
    if st.erased is None:
        st.erased = Erasure(
            p.erased_by, p.reason, p.subject, list(p.key_ids), ev.seq, ev.occurred_at
        )
    erase_content(st)


def erase_content(st: RunState) -> None:
    """Write ``ERASED`` over the content fields of ``st`` (mutated); idempotent."""
    for msg in st.messages:
        msg.content = _erase(msg.content)
        for call in msg.tool_calls:
            if "args_json" in call:
                call["args_json"] = _erase(call["args_json"])
        if msg.tool_result is not None:
            msg.tool_result.content = _erase(msg.tool_result.content)
    st.completed_calls = {k: _erase(v) for k, v in st.completed_calls.items()}
    for oc in st.open_calls.values():
        oc.args_json = _erase(oc.args_json)
        oc.last_error = None if oc.last_error is None else _erase(oc.last_error)
        if oc.last_evidence is not None:
            # The verdict before the colon is structure (``proven_absent`` reads it).
            verdict, colon, rest = oc.last_evidence.partition(":")
            oc.last_evidence = verdict + colon + _erase(rest) if colon else _erase(verdict)
        oc.decision_note = _erase(oc.decision_note)
    for a in st.approvals.values():
        a.reason, a.note = _erase(a.reason), _erase(a.note)
    st.summary = _erase(st.summary)
    if st.agent_input is not None:
        st.agent_input = _erase(st.agent_input)
    if st.lineage is not None:
        st.lineage.input_json = (
            None if st.lineage.input_json is None else _erase(st.lineage.input_json)
        )
        for fx in st.lineage.effects.values():
            for name in ("args_json", "content"):
                value = getattr(fx, name, None)
                if isinstance(value, str):
                    setattr(fx, name, _erase(value))


def _record_only(st: RunState, ev: Event) -> None:
    """Deliberately nothing: audit reads these; run state does not depend on them."""


RULES: dict[EventType, Rule] = {
    EventType.RUN_STARTED: _run_started,
    EventType.RUN_RESUMED: _run_resumed,
    EventType.USER_MESSAGE: _user_message,
    EventType.MODEL_TURN: _model_turn,
    EventType.TOOL_CALL_DENIED: _tool_call_denied,
    EventType.TOOL_CALL_STARTED: _tool_call_started,
    EventType.TOOL_CALL_COMPLETED: _tool_call_completed,
    EventType.TOOL_CALL_UNCERTAIN: _tool_call_uncertain,
    EventType.RECONCILIATION_ATTEMPTED: _reconciliation_attempted,
    EventType.APPROVAL_REQUESTED: _approval_requested,
    EventType.APPROVAL_DECIDED: _approval_decided,
    EventType.CONTEXT_COMPACTED: _context_compacted,
    EventType.RUN_FINISHED: _run_finished,
    EventType.RUN_CANCEL_REQUESTED: _run_cancel_requested,
    EventType.TIMER_STARTED: _timer_started,
    EventType.CONTENT_ERASED: _content_erased,
    EventType.GUARDRAIL_TRIGGERED: _record_only,
    EventType.MEMORY_WRITTEN: _record_only,
    EventType.RUN_FORKED: run_forked,
    EventType.FORK_EFFECT_RESOLVED: fork_effect_resolved,
}

# The rule table must mirror the classification exactly (checked by tests, and here so a
# drift fails at import rather than in production).
if (
    set(RULES) != STATE_CHANGING | RECORD_ONLY
    or any(RULES[t] is _record_only for t in STATE_CHANGING)
    or any(RULES[t] is not _record_only for t in RECORD_ONLY)
):  # pragma: no cover
    raise RuntimeError("run-state fold rules disagree with the vocabulary classification")


def accept(state: RunState, ev: Event, forged: str | None = None) -> bool:
    """Fold one event into ``state`` (mutated); True iff the acceptance rule accepted it.

    A rejected event is a fenced write: counted, otherwise excluded. Every reader asks
    this one function whether a record counts. ``forged`` is the reader's verdict on the
    record's tenant MAC (``schemas._tenant_mac``; None: authentic or unchecked): a forged
    record is rejected without touching anything else, not even the epoch floor.
    """
    if forged is not None:
        state.fenced_writes += 1
        return False
    if ev.epoch > state.max_epoch_seen:
        state.max_epoch_seen = ev.epoch
    et = ev.type
    rule = RULES.get(et)
    if rule is None:
        raise UnknownEventType(f"no fold rule for event type {et!r}")
    # The common case of ``is_valid`` first (the current owner's next event of a running
    # run), without the call; anything else asks ``is_valid`` itself.
    if not (state.status == "running" and _next_of_owner(state, state.seq, ev)) and not is_valid(
        state, ev
    ):
        state.fenced_writes += 1
        return False
    rule(state, ev)
    state.seq = ev.seq
    state.last_event_at = ev.occurred_at
    return True


def _next_of_owner(state: RunState, seq: int, ev: Event) -> bool:
    """``ev`` is the current owner's next event after ``seq``, of a type whose validity
    needs nothing more (``accept``'s common case, on a running run)."""
    et = ev.type
    return (
        ev.seq == seq + 1
        and ev.epoch == state.epoch
        and et not in OWNERSHIP
        and et is not EventType.APPROVAL_DECIDED
        and et is not EventType.CONTENT_ERASED
        and ev.run_id == state.run_id
        and ev.tenant == state.tenant
    )


_LEAVES_RUNNING = frozenset({EventType.APPROVAL_REQUESTED, EventType.RUN_FINISHED})
"""The types of ``accept``'s common case whose rule may change a running run's status."""


def accepted_in_order(state: RunState, events: list[Event]) -> bool:
    """``accept`` would accept every one of ``events`` folded into ``state`` in order, each
    in its common case (so no fold can refuse one halfway): a caller may fold them into
    ``state`` itself instead of into a copy it would throw away on a refusal."""
    if state.status != "running":
        return False
    seq, last = state.seq, len(events) - 1
    for i, ev in enumerate(events):
        if not _next_of_owner(state, seq, ev) or (i < last and ev.type in _LEAVES_RUNNING):
            return False
        seq = ev.seq
    return True


@dataclass(frozen=True)
class Step:
    """One event's passage through a run's fold, as the projections of a runner share it.

    The run state is folded once per record; every projection reads the verdict and what
    the event could change from here instead of folding a copy of the state itself.
    ``touched`` and ``approval`` are read from the state *before* the event, like ``asked_at``
    and ``undone``; the state after it is the state the step was taken on.
    """

    accepted: bool
    touched: frozenset[str]
    """Keys of the open calls the event can add, change or close (every other call of the
    run is unchanged by it): a store rewrites these and no other."""
    approval: str | None
    """The approval the event can add or decide."""
    asked_at: datetime | None
    """For a decision: when the request it answers was made."""
    undone: str | None
    """For a compensation's completion: the key of the call it undoes."""
    unproven: bool = False
    """For a compensation's completion: it closes the inverse by a person's rejection
    (``ruled_out``), so it is no evidence that ``undone``'s effect was undone."""
    superseded: Approval | None = None
    """For a valid decision that came after the one that stands: the standing one."""
    rejected: str | None = None
    """For a rejected record: why (``rejection``)."""


def touched_calls(st: RunState, ev: Event) -> frozenset[str]:
    """Keys of the open calls ``ev`` can change, read from the state *before* it.

    Mirrors the rules above that touch ``open_calls``: a run may hold hundreds of open
    calls, and a reader that keeps them apart need look at only these.
    """
    p = ev.payload
    if isinstance(p, m.RunResumed):
        # The takeover makes the calls still in flight uncertain; the others stay as they are.
        return frozenset(k for k, c in st.open_calls.items() if c.status == "started")
    if isinstance(p, m.RunForked):
        # A fork begins with its parent's open calls (uncertain to it): all of them.
        if p.state == ERASED:  # the carried state's content is gone: it begins with none
            return frozenset()
        return frozenset(unpack_state(p.state).get("open_calls", {}))
    keys: set[str] = set()
    if isinstance(p, m.ToolCallCompleted):
        closed = find_open(st, p.started_seq, p.idempotency_key)
        if closed is not None:
            keys.add(closed.idempotency_key)
    elif isinstance(p, m.ApprovalDecided):
        approval = st.approvals.get(p.approval_id)
        if approval is not None and approval.idempotency_key is not None:
            keys.add(approval.idempotency_key)
    key = vars(p).get("idempotency_key")  # not getattr: a miss on a model is slow
    if isinstance(key, str):
        keys.add(key)
    return frozenset(keys)


def advance(state: RunState, ev: Event, forged: str | None = None) -> Step:
    """``accept`` plus what the projections read of the state before ``ev``."""
    p = ev.payload
    asked_at: datetime | None = None
    undone: str | None = None
    unproven = False
    approval: str | None = None
    if isinstance(p, m.ApprovalDecided | m.ApprovalRequested):
        approval = p.approval_id
        asked = state.approvals.get(p.approval_id)
        asked_at = None if asked is None else asked.requested_at
    elif isinstance(p, m.ToolCallCompleted) and compensated_tool(p.name) is not None:
        # The key a compensation undoes is its STARTED's operation id; read it before the
        # completion closes the call.
        started = find_open(state, p.started_seq, p.idempotency_key)
        undone = started.operation_id if started is not None else None
        unproven = p.idempotency_key is not None and ruled_out(state, p.idempotency_key)
    touched = touched_calls(state, ev)
    standing = superseded(state, ev)
    if standing is not None:
        standing = dataclasses.replace(standing)  # as it stood before ``ev``
    accepted = accept(state, ev, forged)
    why = None if accepted else rejection(state, ev, forged)  # accept changed no rule input
    return Step(
        accepted,
        touched,
        approval,
        asked_at,
        undone,
        unproven,
        standing if accepted else None,
        why,
    )


def apply(state: RunState, ev: Event) -> RunState:
    """Fold one event into ``state`` (mutated and returned). Invalid events are counted."""
    accept(state, ev)
    return state


def fold(events: Iterable[Event], state: RunState | None = None) -> RunState:
    """The state of a run after ``events`` (from ``state``, or from nothing)."""
    st = RunState() if state is None else state
    for ev in events:
        apply(st, ev)
    return st
