"""The audit projection: an append-only record per run of who did what, and when.

Entries: denials, approvals (requested; decided, by whom, latency to the person; a
decision after the one that stands is an ``approval_superseded`` entry naming it),
guardrail trips, retries (STARTED with attempt > 1), compensations (started, completed or
failed, with the key they undo), compactions (what was dropped),
resumptions (crash gap), forks (parent, seq, who, and the other timeline's effects after
the fork point) and what a fork did with each it met, fenced writes (what the ownership
rule rejected), reconciliation decisions, the run's end, and records that were quarantined.

Pure: entries carry the event's own time, never a clock; a rebuild yields the same list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runlog.projections._run_state import (
    RunState,
    Step,
    advance,
    decision_text,
    decision_verdict,
)
from runlog.projections._verdict import slim_dict
from runlog.schemas import _models as m
from runlog.schemas._keys import compensated_tool
from runlog.schemas._models import Event

Entry = dict[str, Any]


@dataclass
class AuditRun:
    """Per-run projection state: only the validator; the entries are appended elsewhere."""

    validator: RunState = field(default_factory=RunState)
    decided_at: dict[str, str] = field(default_factory=dict)
    """Approval id -> when the decision that stands on it was recorded: a superseded
    decision's entry names it."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"validator": slim_dict(self.validator)}
        if self.decided_at:
            out["decided_at"] = dict(sorted(self.decided_at.items()))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditRun:
        validator = RunState.from_dict(data["validator"])
        return cls(validator=validator, decided_at=dict(data.get("decided_at", {})))


def _base(kind: str, ev: Event, partition: int, offset: int) -> Entry:
    return {
        "kind": kind,
        "seq": ev.seq,
        "epoch": ev.epoch,
        "at": ev.occurred_at.isoformat(),
        "writer": ev.writer_id,
        "partition": partition,
        "offset": offset,
    }


_ENTRY_TYPES = (
    m.ToolCallDenied,
    m.ApprovalRequested,
    m.ApprovalDecided,
    m.GuardrailTriggered,
    m.ContextCompacted,
    m.RunResumed,
    m.ReconciliationAttempted,
    m.ToolCallUncertain,
    m.RunFinished,
    m.RunCancelRequested,
    m.RunForked,
    m.ForkEffectResolved,
    m.ContentErased,
)


def _has_entry(p: m.Payload) -> bool:
    """Whether a valid event with payload ``p`` adds an entry (mirrors ``entries``)."""
    if isinstance(p, _ENTRY_TYPES):
        return True
    if isinstance(p, m.ToolCallStarted):
        return p.attempt > 1 or compensated_tool(p.name) is not None
    if isinstance(p, m.ToolCallCompleted):
        return compensated_tool(p.name) is not None
    return False


def apply_event(run: AuditRun, ev: Event, partition: int, offset: int) -> list[Entry]:
    """Fold ``ev`` (and the run's own validator); returns the entries to append."""
    step = advance(run.validator, ev)
    return entries(run.validator, ev, step, partition, offset, run.decided_at)


def entries(
    st: RunState,
    ev: Event,
    step: Step,
    partition: int,
    offset: int,
    decided_at: dict[str, str] | None = None,
) -> list[Entry]:
    """The entries ``ev`` adds (in order), given its ``step`` through the run state ``st``
    (the state after it). ``decided_at`` (the run's, updated here) says when each
    standing decision was recorded."""
    p = ev.payload
    asked_at, undone = step.asked_at, step.undone
    if not step.accepted:
        e = _base("fenced_write", ev, partition, offset)
        e.update(type=ev.type.value, event_id=ev.event_id, valid_seq=st.seq, valid_epoch=st.epoch)
        if step.rejected == "forged_tenant":
            # A record its tenant's writers did not authenticate (schemas._tenant_mac).
            e.update(kind="forged_tenant_record", tenant=ev.tenant)
            e["text"] = f"forged tenant record: not authenticated by {ev.tenant!r}'s writers"
        elif step.rejected == "forged_decision" and isinstance(p, m.ApprovalDecided):
            # A decision no trusted decider signed: kept, excluded, and said so.
            e.update(kind="forged_decision", approval_id=p.approval_id, approved=p.approved)
            e.update(decided_by=p.decided_by, key_id=p.key_id)
            e["text"] = decision_verdict(st, ev).why
        return [e]
    if not _has_entry(p):
        return []
    e = _base(ev.type.value, ev, partition, offset)
    if isinstance(p, m.ToolCallDenied):
        e.update(kind="denial", tool=p.name, args_json=p.args_json, reason=p.reason)
        e["policy"] = p.policy
    elif isinstance(p, m.ApprovalRequested):
        e.update(kind="approval_requested", approval_id=p.approval_id, type=p.kind)
        e.update(reason=p.reason, tool=p.name, idempotency_key=p.idempotency_key)
    elif isinstance(p, m.ApprovalDecided):
        at = asked_at
        latency = None if at is None else round((ev.occurred_at - at).total_seconds() * 1000)
        e.update(kind="approval_decided", approval_id=p.approval_id, approved=p.approved)
        e.update(decided_by=p.decided_by, note=p.note, latency_ms=latency)
        e["requested_at"] = None if at is None else at.isoformat()
        signed = st.approvals.get(p.approval_id)
        if step.superseded is None and signed is not None and signed.key_id is not None:
            e["key_id"] = signed.key_id  # the trusted decider key that signed it
        standing = step.superseded
        known = {} if decided_at is None else decided_at
        if standing is not None:
            # A race let a second decision in: it is kept and shown, and changes nothing.
            first = known.get(p.approval_id)
            e.update(kind="approval_superseded", superseded_by=standing.decided_by)
            e.update(standing_approved=standing.approved, standing_note=standing.note)
            e["standing_at"] = first
            e["text"] = "superseded: " + decision_text(
                p.approval_id,
                standing.decided_by,
                standing.approved,
                standing.note,
                first,
                standing.answer,
            )
        elif decided_at is not None and p.approval_id in st.approvals:
            decided_at.setdefault(p.approval_id, ev.occurred_at.isoformat())
    elif isinstance(p, m.GuardrailTriggered):
        e.update(kind="guardrail", guardrail=p.guardrail, severity=p.severity, action=p.action)
        e["detail"] = p.detail
    elif isinstance(p, m.ToolCallStarted) and compensated_tool(p.name) is not None:
        e.update(kind="compensation_started", tool=compensated_tool(p.name))
        e.update(idempotency_key=p.idempotency_key, compensates=p.operation_id)
        e["attempt"] = p.attempt
    elif isinstance(p, m.ToolCallCompleted) and compensated_tool(p.name) is not None:
        # A lost inverse closed by a person's rejection undid nothing the log can show.
        done = "compensation_closed_unproven" if step.unproven else "compensation_completed"
        e.update(kind="compensation_failed" if p.is_error else done)
        e.update(tool=compensated_tool(p.name), compensates=undone, content=p.content)
        e["idempotency_key"] = p.idempotency_key
    elif isinstance(p, m.ToolCallStarted):
        if p.attempt <= 1:
            return []
        e.update(kind="retry", tool=p.name, idempotency_key=p.idempotency_key, attempt=p.attempt)
    elif isinstance(p, m.ContextCompacted):
        e.update(kind="compaction", dropped=p.dropped, summary=p.summary)
        e.update(kept_turns=p.kept_turns, kept_messages=p.kept_messages)
    elif isinstance(p, m.RunResumed):
        # A person taking the run to record their act is not the run resuming.
        kind = "resumption" if p.operator is None else "operator_takeover"
        e.update(kind=kind, previous_epoch=p.previous_epoch, gap_ms=p.gap_ms)
        e["reason"] = p.reason
        if p.operator is not None:
            e["operator"] = p.operator
    elif isinstance(p, m.RunCancelRequested):
        e.update(kind="cancel_requested", requested_by=p.requested_by, reason=p.reason)
    elif isinstance(p, m.ReconciliationAttempted):
        e.update(kind="reconciliation", tool=p.name, idempotency_key=p.idempotency_key)
        e.update(outcome=p.outcome, rule=p.rule, action=p.action, evidence=p.evidence)
    elif isinstance(p, m.ToolCallUncertain):
        e.update(kind="uncertain", tool=p.name, idempotency_key=p.idempotency_key)
        e.update(error=p.error, detected_by=p.detected_by)
    elif isinstance(p, m.RunFinished):
        e.update(kind="finished", outcome=p.outcome)
        if p.summary:
            e["summary"] = p.summary
    elif isinstance(p, m.RunForked):
        # Who forked, from where, and what the other timeline did after the fork point:
        # the effects an operator may have to undo (``compensable``: the tool has an inverse).
        e.update(kind="forked", parent_run_id=p.parent_run_id, at_seq=p.at_seq)
        e.update(parent_digest=p.parent_digest, forked_by=p.forked_by, reason=p.reason)
        e.update(effects=p.effects)
        e["other_timeline"] = [
            {
                "tool": fx.name,
                "args_json": fx.args_json,
                "run_id": fx.run_id,
                "seq": fx.seq,
                "key": fx.key,
                "status": fx.status,
                "compensable": fx.compensable,
            }
            for fx in p.parent_effects
            if fx.key not in st.completed_calls  # not settled: an open call of the prefix
        ]
    elif isinstance(p, m.ContentErased):
        # Who erased the run's content, when (``at``) and why: an audit fact kept after the
        # purge (its fields are not content: ``consumers._erasure`` leaves them).
        e.update(kind="content_erased", erased_by=p.erased_by, erasure_reason=p.reason)
        e.update(subject=p.subject, key_ids=list(p.key_ids))
    elif isinstance(p, m.ForkEffectResolved):
        e.update(kind="fork_effect", tool=p.name, resolution=p.resolution)
        e.update(source_run_id=p.source_run_id, source_seq=p.source_seq, key=p.logical_key)
        e.update(repeat_key=p.repeat_key, decided_by=p.decided_by, approval_id=p.approval_id)
    else:
        return []
    return [e]


def quarantined_entry(partition: int, offset: int, error: str, message: str) -> Entry:
    """The entry for a record of this run (by key) that could not be decoded."""
    return {
        "kind": "quarantined",
        "partition": partition,
        "offset": offset,
        "error": error,
        "message": message,
    }
