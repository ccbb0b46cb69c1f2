"""The uncertain-call projection: a queue of side effects whose outcome nobody knows.

A call becomes uncertain when its writer lost it: a RUN_RESUMED arrives while its STARTED
has no COMPLETED (the previous owner died), or a TOOL_CALL_UNCERTAIN records that the
tool's outcome is unknown. It leaves the queue when a valid COMPLETED closes it, and how
it closed is counted: by reconciliation evidence, by a later attempt with the same key,
by a person's decision, or as a proven failure of a later attempt.

Only valid events count: the run state is folded alongside with the writers' rule
(``projections._verdict``), so fenced writes never open or close anything.

Pure: no clock. Ages and overdue actions are computed at query time from the stored
start times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runlog.projections._run_state import OpenCall, RunState, Step, advance
from runlog.projections._verdict import slim_dict
from runlog.schemas import _models as m
from runlog.schemas._keys import compensated_tool
from runlog.schemas._models import Event

COUNTERS = ("opened", "reconciled", "retried", "decided", "failed", "escalated")
"""``opened``: became uncertain; ``reconciled``: closed by a completion from reconciliation
evidence; ``retried``: closed by a later live attempt with the same key; ``decided``: closed
after a person's decision; ``failed``: a later attempt proved failure; ``escalated``: handed
to a person (conflict or no safe automatic action), counted once per call."""


@dataclass
class UncertainCall:
    run_id: str
    tenant: str
    idempotency_key: str
    tool: str
    args_json: str
    risk: str
    first_started_at: str
    """ISO time of the first attempt's STARTED: what ages are measured from."""
    started_at: str
    """ISO time of the latest attempt's STARTED."""
    started_seq: int
    attempts: int
    status: str
    """uncertain | escalated | conflict | decided | retrying (a later attempt in flight)."""
    opened_at: str
    """ISO time of the event that made it uncertain."""
    opened_seq: int
    last_error: str | None = None
    last_evidence: str | None = None
    reconciliations: int = 0
    approval_id: str | None = None
    escalated: bool = False
    compensates: str | None = None
    """For a compensation (``<tool>/compensate``): the key of the call it undoes."""

    def to_dict(self) -> dict[str, Any]:
        # Every field is a str, int, bool or None: a shallow copy is ``asdict`` exactly.
        return dict(vars(self))


@dataclass
class UncertainRun:
    """Per-run projection state."""

    validator: RunState = field(default_factory=RunState)
    calls: dict[str, UncertainCall] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "validator": slim_dict(self.validator),
            "calls": {k: c.to_dict() for k, c in self.calls.items()},
            "counters": dict(self.counters),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UncertainRun:
        return cls(
            validator=RunState.from_dict(data["validator"]),
            calls={k: UncertainCall(**c) for k, c in data["calls"].items()},
            counters=dict(data["counters"]),
        )


def _status(call: OpenCall) -> str:
    if call.status == "started":
        return "uncertain" if call.uncertain_recorded else "retrying"
    return call.status


def _refresh(tracked: UncertainCall, call: OpenCall) -> None:
    tracked.attempts = call.attempt
    tracked.started_at = call.started_at.isoformat()
    tracked.started_seq = call.started_seq
    tracked.status = _status(call)
    tracked.last_error = call.last_error
    tracked.last_evidence = call.last_evidence
    tracked.reconciliations = call.reconciliations
    tracked.approval_id = call.approval_id or tracked.approval_id


def apply_event(run: UncertainRun, ev: Event, changed: set[str] | None = None) -> dict[str, int]:
    """Fold ``ev`` (and the run's own validator); see ``apply_step``."""
    return apply_step(run, run.validator, ev, advance(run.validator, ev), changed)


def apply_step(
    run: UncertainRun, st: RunState, ev: Event, step: Step, changed: set[str] | None = None
) -> dict[str, int]:
    """Apply ``ev`` whose passage through the run state ``st`` was ``step`` (``st`` is the
    state after it). Returns the counter increments it caused (for partition aggregates);
    the keys of the tracked calls it added, changed or removed go into ``changed``."""
    delta: dict[str, int] = {}
    if not step.accepted:
        return delta  # a fenced write settles nothing and opens nothing
    if isinstance(ev.payload, m.ContentErased):
        # The run's content is erased: its tracked calls stay (still open), without it.
        for key, kept in run.calls.items():
            kept.args_json = m.ERASED if kept.args_json else ""
            kept.last_error = None if kept.last_error is None else m.ERASED
            if kept.last_evidence is not None:
                verdict, colon, _ = kept.last_evidence.partition(":")
                kept.last_evidence = verdict + colon + m.ERASED if colon else m.ERASED
            if changed is not None:
                changed.add(key)
        return delta
    touched = step.touched
    was_decided = {k for k in touched if k in run.calls and run.calls[k].status == "decided"}
    for key in sorted(touched):
        call = st.open_calls.get(key)
        tracked = run.calls.get(key)
        if call is None:
            if tracked is None:
                continue
            del run.calls[key]
            if changed is not None:
                changed.add(key)
            kind = "failed"
            p = ev.payload
            if isinstance(p, m.ToolCallCompleted):
                if key in was_decided:
                    kind = "decided"
                elif p.source == "reconciliation":
                    kind = "reconciled"
                elif not p.is_error:
                    kind = "retried"
            delta[kind] = delta.get(kind, 0) + 1
            continue
        if tracked is None:
            if call.status == "started" and not call.uncertain_recorded:
                # In flight for a live writer. RUN_RESUMED turns such calls "uncertain"
                # in the fold; TOOL_CALL_UNCERTAIN sets ``uncertain_recorded``.
                continue
            tracked = run.calls[key] = UncertainCall(
                run_id=st.run_id,
                tenant=st.tenant,
                idempotency_key=key,
                tool=call.name,
                args_json=call.args_json,
                risk=call.risk,
                first_started_at=call.started_at.isoformat(),
                started_at=call.started_at.isoformat(),
                started_seq=call.started_seq,
                attempts=call.attempt,
                status="uncertain",
                opened_at=ev.occurred_at.isoformat(),
                opened_seq=ev.seq,
                compensates=call.operation_id if compensated_tool(call.name) else None,
            )
            delta["opened"] = delta.get("opened", 0) + 1
        _refresh(tracked, call)
        if changed is not None:
            changed.add(key)
        if tracked.status in ("escalated", "conflict") and not tracked.escalated:
            tracked.escalated = True
            delta["escalated"] = delta.get("escalated", 0) + 1
    for name, n in delta.items():
        run.counters[name] = run.counters.get(name, 0) + n
    return delta
