"""The event vocabulary and its exhaustive classification.

Every type is either state-changing (the run-state fold has a rule for it) or record-only
(the fold deliberately ignores it; audit and other projections may still read it). A type
in neither set raises: a new member can never disappear because somebody forgot a branch.
"""

from __future__ import annotations

from enum import StrEnum

from runlog.errors import UnknownEventType


class EventType(StrEnum):
    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    USER_MESSAGE = "user_message"
    MODEL_TURN = "model_turn"
    TOOL_CALL_DENIED = "tool_call_denied"
    TOOL_CALL_STARTED = "tool_call_started"
    TOOL_CALL_COMPLETED = "tool_call_completed"
    TOOL_CALL_UNCERTAIN = "tool_call_uncertain"
    RECONCILIATION_ATTEMPTED = "reconciliation_attempted"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_DECIDED = "approval_decided"
    GUARDRAIL_TRIGGERED = "guardrail_triggered"
    CONTEXT_COMPACTED = "context_compacted"
    MEMORY_WRITTEN = "memory_written"
    RUN_FINISHED = "run_finished"
    RUN_CANCEL_REQUESTED = "run_cancel_requested"
    RUN_FORKED = "run_forked"
    FORK_EFFECT_RESOLVED = "fork_effect_resolved"
    TIMER_STARTED = "timer_started"
    CONTENT_ERASED = "content_erased"


STATE_CHANGING: frozenset[EventType] = frozenset(
    {
        EventType.RUN_STARTED,
        EventType.RUN_RESUMED,
        EventType.USER_MESSAGE,
        EventType.MODEL_TURN,
        EventType.TOOL_CALL_DENIED,
        EventType.TOOL_CALL_STARTED,
        EventType.TOOL_CALL_COMPLETED,
        EventType.TOOL_CALL_UNCERTAIN,
        EventType.RECONCILIATION_ATTEMPTED,
        EventType.APPROVAL_REQUESTED,
        EventType.APPROVAL_DECIDED,
        EventType.CONTEXT_COMPACTED,
        EventType.RUN_FINISHED,
        EventType.RUN_CANCEL_REQUESTED,
        EventType.RUN_FORKED,
        EventType.FORK_EFFECT_RESOLVED,
        EventType.TIMER_STARTED,
        EventType.CONTENT_ERASED,
    }
)

# Facts for audit; the run-state fold keeps nothing of them on purpose.
RECORD_ONLY: frozenset[EventType] = frozenset(
    {
        EventType.GUARDRAIL_TRIGGERED,
        EventType.MEMORY_WRITTEN,
    }
)

# The first event of a run: a start, or a fork's lineage record (runlog.producers._forks).
STARTS: frozenset[EventType] = frozenset({EventType.RUN_STARTED, EventType.RUN_FORKED})

# Events that move ownership: the first event of a run, and a takeover.
OWNERSHIP: frozenset[EventType] = STARTS | {EventType.RUN_RESUMED}


def parse_event_type(value: str) -> EventType:
    """The vocabulary member named ``value``; raises ``UnknownEventType`` for anything else."""
    try:
        et = EventType(value)
    except ValueError as exc:
        raise UnknownEventType(f"unknown event type {value!r}") from exc
    classify(et)
    return et


def classify(et: EventType) -> str:
    """``"state"`` or ``"record"``; raises for a type in neither set."""
    if et in STATE_CHANGING:
        return "state"
    if et in RECORD_ONLY:
        return "record"
    raise UnknownEventType(f"event type {et.value!r} is neither state-changing nor record-only")
