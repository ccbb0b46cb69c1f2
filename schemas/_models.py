"""Pydantic models of the payloads (current version of each type) and of the envelope."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runlog.schemas._vocabulary import EventType

Risk = Literal["safe", "reversible", "irreversible"]


class Payload(BaseModel):
    # NaN and infinity are refused in every float field: NaN != NaN, so a NaN cost would
    # make two folds of the same log compare unequal and their digests disagree.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class RunStarted(Payload):
    agent: str = ""
    goal: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    code_version: str | None = None
    """v2: the registered agent's code version (``runlog.agent``); None in v1 records and
    for a run not started through the agent registry."""
    input_json: str | None = None
    """v2: the registered agent's input, canonical JSON; None like ``code_version``."""
    subject: str | None = None
    """v3: the data subject whose key seals the run's content (``open_run(subject=...)``:
    a person or account id); None (and in older records): the run itself is the subject."""


class RunResumed(Payload):
    previous_epoch: int
    expected_prev_seq: int
    gap_ms: int | None = None
    reason: str = ""
    operator: str | None = None
    """v2: the person whose act (a decision, a cancellation, a termination) this ownership
    move records; None (and in v1 records): a worker resuming the run to run it."""


class UserMessage(Payload):
    content: str


class ToolCallProposal(Payload):
    call_id: str
    name: str
    args_json: str
    idempotency_key: str | None = None

    @property
    def args(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.args_json)
        return value


class Usage(Payload):
    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
        )


class ModelTurn(Payload):
    text: str = ""
    tool_calls: tuple[ToolCallProposal, ...] = ()
    usage: Usage = Usage()
    cost_usd: float = 0.0
    response_json: str | None = None
    """v2: the framework's whole response as JSON, so a resumed run replays it instead of
    asking the model again (None in v1 records and from writers that keep only the above)."""


class ToolCallDenied(Payload):
    call_id: str
    name: str
    args_json: str
    reason: str
    policy: str = ""


class ToolCallStarted(Payload):
    call_id: str
    name: str
    args_json: str
    idempotency_key: str
    attempt: int = 1
    risk: Risk = "safe"
    operation_id: str | None = None
    dedupes_by_key: bool | None = None
    """v2: the tool declares that its receiver deduplicates by the idempotency key, so a
    retry with the key does not repeat an effect that landed (None in v1 records)."""
    compensable: bool | None = None
    """v2: the tool declares an inverse (``compensate=``) (None in v1 records)."""


class ToolCallCompleted(Payload):
    call_id: str
    name: str
    started_seq: int
    content: str
    is_error: bool = False
    idempotency_key: str | None = None
    source: Literal["live", "reconciliation"] = "live"
    duration_ms: int | None = Field(default=None, ge=0)
    """v2: wall time of the invocation; None when not measured (v1 records, reconciliation)."""


class ToolCallUncertain(Payload):
    started_seq: int
    call_id: str
    name: str
    idempotency_key: str
    error: str
    detected_by: Literal["live", "recovery"]


ReconcileOutcome = Literal["match", "absent", "conflict", "unavailable", "no_reconciler", "decided"]
RecoveryAction = Literal[
    "complete", "retry", "retry_compensate", "escalate", "keep_uncertain", "resolve"
]


class ReconciliationAttempted(Payload):
    started_seq: int
    idempotency_key: str
    name: str
    outcome: ReconcileOutcome
    evidence: str = ""
    rule: str
    action: RecoveryAction


class ApprovalRequested(Payload):
    approval_id: str
    kind: Literal["action", "uncertain_call", "conflict"]
    reason: str
    name: str | None = None
    args_json: str | None = None
    idempotency_key: str | None = None
    started_seq: int | None = None
    started_at: datetime | None = None
    last_error: str | None = None
    detail: str | None = None
    due_at: datetime | None = None
    """v2: when the person's decision is due (UTC); None in v1 records and without a
    deadline. ``runlog approvals --overdue`` names the requests past it."""


class ApprovalDecided(Payload):
    approval_id: str
    approved: bool
    decided_by: str
    note: str = ""
    decided_at: str | None = None
    """v2: when the decider decided (ISO-8601 UTC), as signed (None: unsigned, and v1)."""
    key_id: str | None = None
    """v2: the decider's key that signed it (``runlog.schemas._signing``; None: unsigned)."""
    signature: str | None = None
    """v2: base64 Ed25519 signature of ``signing.decision_message`` (None: unsigned)."""
    answer: str | None = None
    """v3: the answer when approve/reject does not say it all (``UNDO_AND_RETRY``, with
    ``approved`` true); None: ``approved`` says it (every v1 and v2 decision)."""


UNDO_AND_RETRY = "undo_and_retry"
"""A person's third answer about an uncertain call of a tool with an inverse: run the
inverse of what may have happened (its own key), and only once it completed run the call
again under a fresh key. Recorded as ``ApprovalDecided.answer`` with ``approved`` true."""

ANSWERS = frozenset({UNDO_AND_RETRY})
"""Every ``ApprovalDecided.answer`` a reader knows; any other is refused where it is made."""


class GuardrailTriggered(Payload):
    guardrail: str
    severity: str
    action: str
    detail: str = ""


class ContextCompacted(Payload):
    """v2. What stays at the tail is counted in turns; ``kept_messages`` pins it exactly.

    v1 had a single ``kept`` counting messages. Its v2 equivalent is ``kept_messages``
    (the upcaster maps it; see ``schemas._evolution``). A v2 writer gives ``kept_turns``.
    """

    summary: str
    kept_turns: int | None = Field(default=None, ge=0)
    """Turns retained: from the k-th last model turn to the end of the context."""
    kept_messages: int | None = Field(default=None, ge=0)
    """Exact messages retained at the tail; when set, replay uses it, not ``kept_turns``."""
    dropped: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _v1_callers(cls, data: Any) -> Any:
        # The v1 API's ``kept`` only ever meant messages, so a caller still passing it is
        # mapped to that exact meaning, never to turns. (Decoded v1 records do not come
        # through here unconverted: the codec upcasts them first.)
        if isinstance(data, dict) and "kept" in data:
            if "kept_messages" in data:
                raise ValueError("give kept_messages or the v1 name kept, not both")
            data = {k: v for k, v in data.items() if k != "kept"} | {"kept_messages": data["kept"]}
        return data

    @property
    def kept(self) -> int | None:
        """Deprecated v1 name, still MESSAGES: ``kept_messages`` (None if counted in turns)."""
        return self.kept_messages

    @model_validator(mode="after")
    def _something_kept(self) -> ContextCompacted:
        if self.kept_turns is None and self.kept_messages is None:
            raise ValueError("context_compacted needs kept_turns (or kept_messages)")
        return self


class MemoryWritten(Payload):
    key: str
    value: str


class RunFinished(Payload):
    outcome: str
    summary: str = ""


class RunCancelRequested(Payload):
    """A person asked the run to stop (cooperatively): who and why."""

    requested_by: str
    reason: str


ERASED = "\u2039erased\u203a"
"""What a content field reads as once its run's content was erased ("erased" in angle
quotes; CONTENT_ERASED): the fold writes it over every content field of the state, and a
sealed field whose key was shredded decodes to the same (``runlog.schemas._sealing``)."""


def data_subject(run_id: str, started: Payload | None) -> str:
    """A run's data subject: the one its first event (RUN_STARTED, RUN_FORKED) names, else
    the run itself. Its content is encrypted under that subject's key and forgotten with it."""
    return getattr(started, "subject", None) or run_id


class ContentErased(Payload):
    """A person (or the retention job) erased the run's content: the subject's data keys
    were destroyed (``key_ids``) and the plaintext copies purged. Who, why; when is the
    event's ``occurred_at``."""

    subject: str
    key_ids: tuple[str, ...] = ()
    erased_by: str
    reason: str


ForkEffects = Literal["inherit", "ask", "execute"]


class ParentEffect(Payload):
    """An effect another timeline made after a fork point (``RunForked.parent_effects``)."""

    logical_key: str
    key: str
    run_id: str
    seq: int
    name: str
    args_json: str
    risk: Risk = "safe"
    status: Literal["completed", "uncertain"]
    content: str | None = None
    compensable: bool | None = None


class RunForked(Payload):
    """A fork's first event: its lineage and the parent's state at ``at_seq``."""

    parent_run_id: str
    at_seq: int = Field(ge=1)
    parent_digest: str
    forked_by: str
    reason: str = ""
    effects: ForkEffects = "inherit"
    key_scope: str
    ancestry: tuple[str, ...] = ()
    state: str
    """The parent's state at ``at_seq``: ``projections._lineage.pack_state``."""
    parent_effects: tuple[ParentEffect, ...] = ()
    input_json: str | None = None
    agent: str = ""
    goal: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    subject: str | None = None
    """v3: the data subject the fork's content is sealed for, its parent's (the parent's
    ``subject``, else the parent run itself); None in older records: the fork itself."""


class ForkEffectResolved(Payload):
    """A fork met an action another timeline completed after the fork point."""

    logical_key: str
    call_id: str
    name: str
    args_json: str
    resolution: Literal["inherited", "repeated", "declined"]
    source_run_id: str
    source_seq: int
    source_key: str
    content: str = ""
    repeat_key: str | None = None
    decided_by: str = ""
    approval_id: str | None = None


class TimerStarted(Payload):
    """A durable timer: the run waits until ``due_at`` (``run.sleep``)."""

    timer: int = Field(ge=0)
    seconds: float = Field(ge=0)
    due_at: datetime
    purpose: str = ""


PAYLOAD_MODELS: dict[EventType, type[Payload]] = {
    EventType.RUN_STARTED: RunStarted,
    EventType.RUN_RESUMED: RunResumed,
    EventType.USER_MESSAGE: UserMessage,
    EventType.MODEL_TURN: ModelTurn,
    EventType.TOOL_CALL_DENIED: ToolCallDenied,
    EventType.TOOL_CALL_STARTED: ToolCallStarted,
    EventType.TOOL_CALL_COMPLETED: ToolCallCompleted,
    EventType.TOOL_CALL_UNCERTAIN: ToolCallUncertain,
    EventType.RECONCILIATION_ATTEMPTED: ReconciliationAttempted,
    EventType.APPROVAL_REQUESTED: ApprovalRequested,
    EventType.APPROVAL_DECIDED: ApprovalDecided,
    EventType.GUARDRAIL_TRIGGERED: GuardrailTriggered,
    EventType.CONTEXT_COMPACTED: ContextCompacted,
    EventType.MEMORY_WRITTEN: MemoryWritten,
    EventType.RUN_FINISHED: RunFinished,
    EventType.RUN_CANCEL_REQUESTED: RunCancelRequested,
    EventType.RUN_FORKED: RunForked,
    EventType.FORK_EFFECT_RESOLVED: ForkEffectResolved,
    EventType.TIMER_STARTED: TimerStarted,
    EventType.CONTENT_ERASED: ContentErased,
}


class Event(BaseModel):
    """One immutable fact about a run: the envelope and its typed payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str
    """Unique id of this event."""
    run_id: str
    """The run; also the Kafka key, so one run's events are totally ordered."""
    tenant: str
    """Tenant owning the run; part of every idempotency key."""
    seq: int = Field(ge=1)
    """Contiguous per run, from 1."""
    epoch: int = Field(ge=0)
    """Fencing token of the writer that appended it."""
    type: EventType
    schema_version: int = Field(ge=1)
    """Version of the type's schema the payload conforms to (after upcasting: current)."""
    occurred_at: datetime
    """UTC, microsecond precision."""
    writer_id: str
    """Identity of the worker process that appended it."""
    payload: Payload
