"""Where a run is in its life, in one vocabulary every reader tells the same way.

This is the one rule. ``runlog runs``, ``runlog show``, ``runlog state``, their ``--json``
and the console all ask it; none of them decides a status of its own. It is pure: the
log's part comes from the fold (``phase_of``), the live part (who holds the run's lease
now, and until when) is data the caller read from Redis and passes in.

========================  ===============================================================
status                    meaning
========================  ===============================================================
``running``               not finished, a writer holds its lease (``owner``,
                          ``lease_expires_at``)
``waiting``               a person must decide (an approval request, a conflict that
                          stopped the run): ``waiting_for="person"``, ``since`` the
                          oldest request. (``waiting_for="time"``: a durable timer, with
                          the worker fleet; see ``phase_of``.)
``orphaned``              not finished, nobody holds it, nothing it waits for: ``since``
                          its last valid event (what its last owner wrote last)
``cancelling``            a person cancelled it (``runlog cancel``) and it has not ended
                          yet: its owner sees the request at its next step; an unowned
                          run is cancelled when next opened. ``since`` the request
``finished``              RUN_FINISHED with any outcome but the three below
``failed``                RUN_FINISHED ``failed``
``cancelled``             RUN_FINISHED ``cancelled`` (the agent saw ``Cancelled``)
``terminated``            RUN_FINISHED ``terminated`` (``runlog terminate``: its owner was
                          fenced; its open calls are left to reconciliation)
========================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from runlog.projections.run_state import RunState

Status = Literal[
    "running",
    "waiting",
    "orphaned",
    "cancelling",
    "finished",
    "failed",
    "cancelled",
    "terminated",
]
STATUSES: tuple[Status, ...] = (
    "running",
    "waiting",
    "orphaned",
    "cancelling",
    "finished",
    "failed",
    "cancelled",
    "terminated",
)

Phase = Literal["active", "waiting", "cancelling", "finished", "failed", "cancelled", "terminated"]
PHASES: tuple[Phase, ...] = (
    "active",
    "waiting",
    "cancelling",
    "finished",
    "failed",
    "cancelled",
    "terminated",
)
"""The part of a status the log alone decides (what the run index stores): ``active``
becomes ``running`` or ``orphaned`` by who holds the lease now."""

ENDED_BY: dict[str, Phase] = {
    "failed": "failed",
    "cancelled": "cancelled",
    "terminated": "terminated",
}
"""RUN_FINISHED outcomes with a status of their own; any other outcome is ``finished``."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run's lease now, as Redis says (the only truth of ownership)."""

    owner: str
    epoch: int
    expires_at: datetime


@dataclass(frozen=True)
class RunStatus:
    status: Status
    since: datetime | None = None
    """orphaned: its last valid event; waiting: the oldest request; cancelling: the
    request; ended: its last event."""
    owner: str | None = None
    lease_expires_at: datetime | None = None
    waiting_for: Literal["person", "time"] | None = None

    @property
    def ended(self) -> bool:
        return self.status in ("finished", "failed", "cancelled", "terminated")

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "since": None if self.since is None else self.since.isoformat(),
            "owner": self.owner,
            "lease_expires_at": (
                None if self.lease_expires_at is None else self.lease_expires_at.isoformat()
            ),
            "waiting_for": self.waiting_for,
        }

    def text(self) -> str:
        """One line for people: ``running (owner w1/ab12, lease until 12:00:01)``."""
        parts: list[str] = []
        if self.waiting_for is not None:
            parts.append(f"for a {self.waiting_for}")
        if self.owner is not None:
            until = self.lease_expires_at.strftime("%H:%M:%S") if self.lease_expires_at else "?"
            parts.append(f"owner {self.owner}, lease until {until}")
        if self.since is not None and self.status != "running":
            parts.append(f"since {self.since.isoformat(timespec='seconds')}")
        return self.status + (f" ({'; '.join(parts)})" if parts else "")


def phase_of(st: RunState) -> Phase:
    """The log's part of the status (the first that holds wins)."""
    if st.status == "finished":
        return ENDED_BY.get(st.outcome or "", "finished")
    if st.cancel is not None:
        return "cancelling"
    if st.status == "escalated" or st.pending_approvals:
        return "waiting"
    # The worker fleet's durable timers belong here: a run sleeping until a time that has
    # not come is "waiting" (waiting_for="time", since the sleep), whoever holds it.
    return "active"


def since_of(st: RunState) -> datetime | None:
    """When the run entered the phase ``phase_of`` gives (see ``RunStatus.since``)."""
    phase = phase_of(st)
    if phase == "cancelling" and st.cancel is not None:
        return st.cancel.requested_at
    if phase == "waiting":
        asked = [a.requested_at for a in st.pending_approvals.values()]
        if asked:
            return min(asked)
    return st.last_event_at


def status_from(phase: str, holder: Holder | None, since: datetime | None) -> RunStatus:
    """The status of a run in ``phase`` (``PHASES``) that ``holder`` holds (None: nobody)."""
    owner = None if holder is None else holder.owner
    expires = None if holder is None else holder.expires_at
    if phase in ("finished", "failed", "cancelled", "terminated"):
        return RunStatus(phase, since)  # type: ignore[arg-type]
    if phase == "cancelling":
        return RunStatus("cancelling", since, owner, expires)
    if phase == "waiting":
        return RunStatus("waiting", since, owner, expires, waiting_for="person")
    if holder is not None:
        return RunStatus("running", since, owner, expires)
    return RunStatus("orphaned", since)


def run_status(st: RunState, holder: Holder | None) -> RunStatus:
    """The status of the run whose fold is ``st`` and whose lease ``holder`` holds."""
    return status_from(phase_of(st), holder, since_of(st))


def phases_for(status: str) -> tuple[Phase, ...]:
    """The stored phases a run of ``status`` is in (a filter on the run index)."""
    if status in ("running", "orphaned"):
        return ("active",)
    if status in PHASES:
        return (status,)
    raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
