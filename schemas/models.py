"""Pydantic models of the payloads (current version of each type) and of the envelope."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.vocabulary import EventType

Risk = Literal["safe", "reversible", "irreversible"]


class Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunStarted(Payload):
    agent: str = ""
    goal: str = ""
    labels: dict[str, str] = Field(default_factory=dict)


class RunResumed(Payload):
    previous_epoch: int
    expected_prev_seq: int
    gap_ms: int | None = None
    reason: str = ""


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


class ToolCallCompleted(Payload):
    call_id: str
    name: str
    started_seq: int
    content: str
    is_error: bool = False
    idempotency_key: str | None = None
    source: Literal["live", "reconciliation"] = "live"


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


class ApprovalDecided(Payload):
    approval_id: str
    approved: bool
    decided_by: str
    note: str = ""


class GuardrailTriggered(Payload):
    guardrail: str
    severity: str
    action: str
    detail: str = ""


class ContextCompacted(Payload):
    summary: str
    kept: int = Field(ge=0)
    dropped: int = Field(default=0, ge=0)


class MemoryWritten(Payload):
    key: str
    value: str


class RunFinished(Payload):
    outcome: str
    summary: str = ""


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
