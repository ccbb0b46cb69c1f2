"""A run's history as a story: one entry per record of its log, in log order.

Read with ``runlog.log._fold.read_run(..., keep=True)``, the one way every reader reads a
run, and told with the fold's own rule: each record is marked valid or, if the ownership
rule refused it, a fenced write with ``run_state.rejection``'s reason. Tool arguments and
results, evidence and errors are shown with the fields a user marks secret
(``RUNLOG_REDACT_FIELDS``) replaced, wherever they sit: in the JSON, in JSON held in its
string values, and in text that is not JSON (a result runlog cut) by field patterns.
Every printer (``runlog show``, the console) redacts through ``redact_json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import redis

from runlog._settings import Settings
from runlog.consumers import _erasure as erasure
from runlog.consumers._redaction import redact_json, secret_fields
from runlog.errors import DecisionConflict, UnknownRun
from runlog.log._authority import authority_for
from runlog.log._fold import read_run
from runlog.log._reader import LogReader, LogRecord
from runlog.projections._run_state import (
    RunState,
    accept,
    decision_text,
    decision_verdict,
    rejection,
    standing_decision,
    superseded,
)
from runlog.projections._state_view import facts
from runlog.schemas import _models as m
from runlog.schemas._keys import check_run_id, check_tenant
from runlog.schemas._models import Event
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority


def erasure_dict(st: RunState) -> dict[str, Any]:
    """Who erased the run's content, when, why, which subject and keys (``st.erased``)."""
    e = st.erased
    assert e is not None
    return {
        "by": e.erased_by,
        "at": e.erased_at.isoformat(),
        "reason": e.reason,
        "subject": e.subject,
        "key_ids": list(e.key_ids),
        "seq": e.erased_seq,
    }


@dataclass
class Call:
    """Everything the log says about one idempotency key."""

    idempotency_key: str
    tool: str
    risk: str = ""
    args_json: str = ""
    attempts: int = 0
    outcome: str = "open"
    """open | uncertain | completed | failed | escalated | conflict | decided."""
    source: str = ""
    result: str | None = None
    reconciliations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "source": self.source or None}


@dataclass
class Timeline:
    run_id: str
    tenant: str
    state: RunState
    entries: list[dict[str, Any]]
    calls: list[Call]
    source: str
    """Where the read started (``index``, ``time`` or ``scan``)."""
    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Approval id -> the entry of the decision that stands on it (the first valid one)."""

    def decision_conflict(self, approval_id: str) -> DecisionConflict | None:
        """The refusal a new decision on ``approval_id`` meets, if one already stands."""
        standing = standing_decision(self.state, approval_id)
        if standing is None:
            return None
        entry = self.decided.get(approval_id, {})
        at = entry.get("at")
        return DecisionConflict(
            decision_text(
                approval_id,
                standing.decided_by,
                standing.approved,
                standing.note,
                at,
                standing.answer,
            ),
            approval_id=approval_id,
            decided_by=standing.decided_by or "",
            approved=bool(standing.approved),
            note=standing.note,
            decided_at=datetime.fromisoformat(at) if at else None,
            decided_seq=entry.get("seq"),
            run_id=self.run_id,
            answer=standing.answer,
        )

    def to_dict(self) -> dict[str, Any]:
        st = self.state
        return {
            "run_id": self.run_id,
            "tenant": self.tenant,
            **facts(st, "status", "outcome", "seq", "epoch", "resumptions", "fenced_writes"),
            "read_from": self.source,
            "events": self.entries,
            "calls": [c.to_dict() for c in self.calls],
            "lineage": lineage_dict(st),
            **({} if st.erased is None else {"erased": erasure_dict(st)}),
        }


def lineage_dict(st: RunState) -> dict[str, Any] | None:
    """A fork's parent and fork point, and the other timeline's effects it did not inherit
    (None for a run that was not forked)."""
    lin = st.lineage
    if lin is None:
        return None
    return {
        "parent_run_id": lin.parent_run_id,
        "at_seq": lin.at_seq,
        "parent_digest": lin.parent_digest,
        "forked_by": lin.forked_by,
        "reason": lin.reason,
        "effects": lin.effects_mode,
        "ancestry": lin.ancestry,
        "input_json": lin.input_json,
        "other_timeline": [dict(vars(e)) for e in lin.not_inherited()],
    }


def _entry(rec: LogRecord, valid: bool, why: str | None) -> dict[str, Any]:
    ev = rec.event
    return {
        "seq": ev.seq,
        "epoch": ev.epoch,
        "type": ev.type.value,
        "at": ev.occurred_at.isoformat(),
        "writer": ev.writer_id,
        "partition": rec.partition,
        "offset": rec.offset,
        "valid": valid,
        "fenced_reason": why,
    }


def _describe(
    e: dict[str, Any], ev: Event, st: RunState, calls: dict[str, Call], secret: frozenset[str]
) -> str:
    """Fill ``e`` with the payload's facts (redacted) and return one line about it.

    ``st`` is the state *before* ``ev``; ``calls`` is keyed by idempotency key, plus
    ``#<seq>`` for the STARTED at that seq (a proven failure names only its STARTED).
    """
    p = ev.payload

    def call(key: str, name: str) -> Call:
        return calls.setdefault(key, Call(key, name))

    if isinstance(p, m.RunStarted):
        e.update(agent=p.agent, goal=p.goal)
        if p.code_version is not None:
            e.update(code_version=p.code_version)
            return f"run of agent {p.agent} (code {p.code_version}) requested and started"
        return f"run started by {p.agent or 'a worker'}" + (f": {p.goal}" if p.goal else "")
    if isinstance(p, m.RunForked):
        e.update(parent_run_id=p.parent_run_id, at_seq=p.at_seq, parent_digest=p.parent_digest)
        e.update(forked_by=p.forked_by, reason=p.reason, effects=p.effects)
        why = f": {p.reason}" if p.reason else ""
        return (
            f"forked from {p.parent_run_id} at seq {p.at_seq} by {p.forked_by} "
            f"(effects {p.effects}){why}"
        )
    if isinstance(p, m.ForkEffectResolved):
        content = redact_json(p.content, secret)
        e.update(tool=p.name, idempotency_key=p.logical_key, resolution=p.resolution)
        e["args_json"] = redact_json(p.args_json, secret)
        e.update(source_run_id=p.source_run_id, source_seq=p.source_seq, result=content)
        e.update(repeat_key=p.repeat_key, decided_by=p.decided_by)
        where = f"{p.source_run_id} #{p.source_seq}"
        if p.resolution == "repeated":
            return f"{p.name}: repeat of {where} under {p.repeat_key} ({p.decided_by})"
        return f"{p.name} {p.resolution} from {where} ({p.decided_by}): {content}"
    if isinstance(p, m.TimerStarted):
        e.update(timer=p.timer, due_at=p.due_at.isoformat(), purpose=p.purpose)
        what = "retry" if p.purpose == "retry" else "sleep"
        return f"{what} of {p.seconds:g}s (durable timer): due at {p.due_at:%H:%M:%S}"
    if isinstance(p, m.RunResumed):
        e.update(previous_epoch=p.previous_epoch, gap_ms=p.gap_ms, reason=p.reason)
        gap = "" if p.gap_ms is None else f" after {p.gap_ms / 1000:.1f}s"
        why = f" ({p.reason})" if p.reason else ""
        if p.operator is not None:
            e["operator"] = p.operator
            return f"taken by {p.operator}: epoch {p.previous_epoch} -> {e['epoch']}{gap}{why}"
        return f"resumed: epoch {p.previous_epoch} -> {e['epoch']}{gap}{why}"
    if isinstance(p, m.ContentErased):
        e.update(erased_by=p.erased_by, erasure_reason=p.reason, subject=p.subject)
        e["key_ids"] = list(p.key_ids)
        return (
            f"content erased by {p.erased_by}: {p.reason} (subject {p.subject}, "
            f"{len(p.key_ids)} key(s) destroyed)"
        )
    if isinstance(p, m.RunCancelRequested):
        e.update(requested_by=p.requested_by, reason=p.reason)
        return f"cancel requested by {p.requested_by}: {p.reason}"
    if isinstance(p, m.UserMessage):
        e["content"] = p.content
        return f"user: {p.content}"
    if isinstance(p, m.ModelTurn):
        proposals = [
            {
                "call_id": c.call_id,
                "name": c.name,
                "args_json": redact_json(c.args_json, secret),
                "idempotency_key": c.idempotency_key,
            }
            for c in p.tool_calls
        ]
        e.update(text=p.text, tool_calls=proposals, cost_usd=p.cost_usd)
        e.update(input_tokens=p.usage.input_tokens, output_tokens=p.usage.output_tokens)
        names = ", ".join(c.name for c in p.tool_calls)
        return f"model: {p.text}" + (f" -> calls {names}" if names else "")
    if isinstance(p, m.ToolCallDenied):
        e.update(tool=p.name, args_json=redact_json(p.args_json, secret), reason=p.reason)
        e["policy"] = p.policy
        return f"denied {p.name}: {p.reason}"
    if isinstance(p, m.ToolCallStarted):
        c = call(p.idempotency_key, p.name)
        c.risk, c.args_json, c.attempts = p.risk, redact_json(p.args_json, secret) or "", p.attempt
        c.outcome = "open"
        calls[f"#{ev.seq}"] = c
        e.update(tool=p.name, idempotency_key=p.idempotency_key, risk=p.risk, attempt=p.attempt)
        e.update(dedupes_by_key=p.dedupes_by_key, compensable=p.compensable)
        e["args_json"] = c.args_json
        return f"call {p.name} {c.args_json} (risk {p.risk}, attempt {p.attempt})"
    if isinstance(p, m.ToolCallCompleted):
        result = redact_json(p.content, secret)
        e.update(tool=p.name, idempotency_key=p.idempotency_key, is_error=p.is_error)
        e.update(source=p.source, result=result, duration_ms=p.duration_ms)
        e["started_seq"] = p.started_seq
        # A proven failure records no key: its call is the one its STARTED opened.
        found = calls.get(p.idempotency_key or "") or calls.get(f"#{p.started_seq}")
        if found is not None:
            found.outcome = "failed" if p.is_error else "completed"
            found.source, found.result = p.source, result
        verb = "failed" if p.is_error else "completed"
        via = " by reconciliation" if p.source == "reconciliation" else ""
        return f"{p.name} {verb}{via}: {result}"
    if isinstance(p, m.ToolCallUncertain):
        call(p.idempotency_key, p.name).outcome = "uncertain"
        error = redact_json(p.error, secret)
        e.update(tool=p.name, idempotency_key=p.idempotency_key, error=error)
        e.update(detected_by=p.detected_by, started_seq=p.started_seq)
        return f"{p.name} outcome UNKNOWN ({p.detected_by}): {error}"
    if isinstance(p, m.ReconciliationAttempted):
        evidence = redact_json(p.evidence, secret)
        c = call(p.idempotency_key, p.name)
        c.reconciliations.append(f"{p.outcome} -> {p.action} ({p.rule})")
        if p.action == "escalate":
            c.outcome = "conflict" if p.outcome == "conflict" else "escalated"
        e.update(tool=p.name, idempotency_key=p.idempotency_key, outcome=p.outcome)
        e.update(action=p.action, rule=p.rule, evidence=evidence)
        return f"reconcile {p.name}: {p.outcome} -> {p.action} by rule {p.rule}" + (
            f"; evidence {evidence}" if evidence else ""
        )
    if isinstance(p, m.ApprovalRequested):
        e.update(approval_id=p.approval_id, kind=p.kind, reason=p.reason, tool=p.name)
        e.update(idempotency_key=p.idempotency_key, args_json=redact_json(p.args_json, secret))
        e.update(last_error=redact_json(p.last_error, secret), detail=redact_json(p.detail, secret))
        return f"approval {p.approval_id} requested ({p.kind}): {p.reason}"
    if isinstance(p, m.ApprovalDecided):
        asked = st.approvals.get(p.approval_id)
        latency = None
        if asked is not None:
            latency = round((ev.occurred_at - asked.requested_at).total_seconds() * 1000)
        e.update(approval_id=p.approval_id, approved=p.approved, decided_by=p.decided_by)
        e.update(note=p.note, latency_ms=latency, answer=p.answer)
        signed = decision_verdict(st, ev)
        e.update(signature=signed.label, key_id=signed.key_id)
        verb = "approved" if p.approved else "rejected"
        if p.approved and p.answer == m.UNDO_AND_RETRY:
            verb = "chose undo and retry"
        why = f": {p.note}" if p.note else ""
        return f"{p.approval_id} {verb} by {p.decided_by}{why} ({signed.label})"
    if isinstance(p, m.GuardrailTriggered):
        e.update(guardrail=p.guardrail, severity=p.severity, action=p.action, detail=p.detail)
        return f"guardrail {p.guardrail} ({p.severity}): {p.action}"
    if isinstance(p, m.ContextCompacted):
        e.update(summary=p.summary, kept_turns=p.kept_turns, kept_messages=p.kept_messages)
        e["dropped"] = p.dropped
        kept = (
            f"{p.kept_turns} turn(s)" if p.kept_turns is not None else f"{p.kept_messages} msg(s)"
        )
        return f"context compacted: dropped {p.dropped}, kept {kept}"
    if isinstance(p, m.MemoryWritten):
        e.update(key=p.key, value=p.value)
        return f"memory {p.key} written"
    if isinstance(p, m.RunFinished):
        e.update(outcome=p.outcome, summary=p.summary)
        return f"finished: {p.outcome}" + (f" ({p.summary})" if p.summary else "")
    return str(e["type"])


def build(
    records: Iterable[LogRecord],
    secret: frozenset[str],
    authority: DecisionAuthority = NO_AUTHORITY,
) -> tuple[RunState, list[dict[str, Any]], list[Call], dict[str, dict[str, Any]]]:
    """Fold ``records`` with the fold's rule (trusting ``authority``) and tell each one."""
    st = RunState(authority=authority)
    entries: list[dict[str, Any]] = []
    calls: dict[str, Call] = {}
    decided: dict[str, dict[str, Any]] = {}
    """Approval id -> the entry of the decision that stands on it."""
    for rec in records:
        ev = rec.event
        why = rejection(st, ev, rec.forged)
        e = _entry(rec, why is None, why)
        if why is not None:
            # A fenced write is told but changes nothing: it is not part of the run.
            e["text"] = f"FENCED {ev.type.value} (epoch {ev.epoch}, seq {ev.seq}): {why}"
            if rec.forged is not None:
                e["text"] = (
                    f"FORGED {ev.type.value} (epoch {ev.epoch}, seq {ev.seq}, writer "
                    f"{ev.writer_id}): {rec.forged}; ignored"
                )
            elif why == "forged_decision":
                # Kept in the log, never part of the run: say what it claimed and why not.
                p = ev.payload
                assert isinstance(p, m.ApprovalDecided)
                verb = "approved" if p.approved else "rejected"
                e.update(approval_id=p.approval_id, approved=p.approved, decided_by=p.decided_by)
                e["text"] = (
                    f"FORGED DECISION (epoch {ev.epoch}, seq {ev.seq}, writer {ev.writer_id}): "
                    f"{p.approval_id} {verb} as {p.decided_by!r}: "
                    f"{decision_verdict(st, ev).why}; ignored"
                )
            accept(st, ev, rec.forged)
            entries.append(e)
            continue
        e["text"] = _describe(e, ev, st, calls, secret)
        standing = superseded(st, ev)
        if standing is not None:
            # A decision after the one that stands: told, marked, and it changes nothing.
            first = decided.get(standing.approval_id, {}).get("at")
            e.update(superseded=True, superseded_by=standing.decided_by, standing_at=first)
            e["text"] = f"SUPERSEDED {e['text']}; superseded: " + decision_text(
                standing.approval_id,
                standing.decided_by,
                standing.approved,
                standing.note,
                first,
                standing.answer,
            )
        elif isinstance(ev.payload, m.ApprovalDecided) and ev.payload.approval_id in st.approvals:
            decided.setdefault(ev.payload.approval_id, e)
        accept(st, ev)
        entries.append(e)
    unique = {k: c for k, c in calls.items() if not k.startswith("#")}
    for key, c in unique.items():
        still = st.open_calls.get(key)
        if still is not None:
            # Open at the end of the log: the fold says how far settling it got.
            c.outcome = "open" if still.status == "started" else still.status
    if st.erased is not None:
        entries, unique = _erased(entries, unique)
    return st, entries, list(unique.values()), decided


def _erased(
    entries: list[dict[str, Any]], calls: dict[str, Call]
) -> tuple[list[dict[str, Any]], dict[str, Call]]:
    """An erased run's story: every record told by its structure, its content ``ERASED``
    (whatever the records still hold: after the key is shredded they hold nothing)."""
    told = []
    for e in entries:
        if e.get("type") == "content_erased":
            told.append(e)
            continue
        text = e.get("text", "")
        e = erasure.scrub({k: v for k, v in e.items() if k != "text"})
        e["text"] = f"{e['type']}: {m.ERASED}" if text else text
        told.append(e)
    for c in calls.values():
        c.args_json = m.ERASED if c.args_json else c.args_json
        c.result = None if c.result is None else m.ERASED
    return told, calls


def run_timeline(
    reader: LogReader, client: redis.Redis, settings: Settings, tenant: str, run_id: str
) -> Timeline:
    """The timeline of ``run_id`` as ``tenant`` sees it.

    A run owned by another tenant is refused exactly like a run that does not exist, so a
    caller cannot learn which run ids other tenants use.
    """
    check_run_id(run_id)
    check_tenant(tenant)
    read = read_run(reader, client, settings, tenant, run_id, keep=True)
    st = read.state
    if not st.run_id or st.tenant != tenant:
        raise UnknownRun(f"no run {run_id} for tenant {tenant}", run_id=run_id)
    # Another tenant's records under this id are fenced for it; their content is theirs.
    mine = [r for r in read.folded.kept if r.event.tenant == tenant]
    state, entries, calls, decided = build(mine, secret_fields(settings), authority_for(settings))
    return Timeline(run_id, tenant, state, entries, calls, read.source, decided)
