"""The notification projection: which approvals wait for a person, and what to tell them.

For every valid APPROVAL_REQUESTED the projection owes one notification; a valid
APPROVAL_DECIDED settles the request (a notification not delivered by then is dropped).
This module says what a notification holds and who it is; the store keeps the waiting
requests, queues the notifications and records their delivery (``consumers._store``,
``consumers._notify``).

Pure: everything comes from the event and the run state; no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runlog.projections._run_state import RunState
from runlog.projections._verdict import slim_dict
from runlog.schemas import _models as m
from runlog.schemas._models import Event

Notification = dict[str, Any]


@dataclass
class NotifyRun:
    """Per-run projection state: only the validator; the requests are stored elsewhere."""

    validator: RunState = field(default_factory=RunState)

    def to_dict(self) -> dict[str, Any]:
        return {"validator": slim_dict(self.validator)}


def identity(tenant: str, run_id: str, approval_id: str) -> str:
    """The one name of an approval request across the deployment: the notification's key
    and the webhook's ``Idempotency-Key``. Unambiguous: a tenant has no ``:`` and a run
    id no ``/``."""
    return f"runlog:{tenant}:{run_id}/{approval_id}"


def requested(state: RunState, ev: Event) -> Notification | None:
    """The notification a valid APPROVAL_REQUESTED owes (``state`` has folded it)."""
    p = ev.payload
    if not isinstance(p, m.ApprovalRequested):
        return None
    approval = state.approvals.get(p.approval_id)
    if approval is None or approval.requested_seq != ev.seq:
        return None  # not this request (the fold keeps the first of a repeated id)
    return {
        "id": identity(ev.tenant, ev.run_id, p.approval_id),
        "tenant": ev.tenant,
        "run_id": ev.run_id,
        "approval_id": p.approval_id,
        "kind": p.kind,
        "reason": p.reason,
        "tool": p.name,
        "idempotency_key": p.idempotency_key,
        "requested_at": ev.occurred_at.isoformat(),
        "requested_by": ev.writer_id,
        "requested_seq": ev.seq,
        "due_at": None if p.due_at is None else p.due_at.isoformat(),
    }


def decided(state: RunState, ev: Event) -> tuple[str, dict[str, Any]] | None:
    """The request a valid APPROVAL_DECIDED settled and how (``state`` has folded it):
    the first decision of a request stands, so it is the one named."""
    p = ev.payload
    if not isinstance(p, m.ApprovalDecided):
        return None
    approval = state.approvals.get(p.approval_id)
    if approval is None or approval.approved is None:
        return None
    return identity(ev.tenant, ev.run_id, p.approval_id), {
        "approved": approval.approved,
        "decided_by": approval.decided_by,
        "decided_at": ev.occurred_at.isoformat(),
    }
