"""The state projection's view of a run: what a reader of the log shows beyond the fold.

Pure: the log position of a record is given to the fold as data, like the event itself,
and who holds the run's lease now is data the caller read from Redis.

- ``StateView``: the run state (exactly ``projections._run_state.apply``, the writers' fold
  and validation rule) plus what a reader of the log knows and a writer does not need: the
  run's partition and first offset (so replay jobs can seek instead of scanning) and the
  records of the run that could not be decoded (quarantined).
- The run's status: where a run is in its life, in one vocabulary every reader tells the
  same way (below).

**The run's status** is one rule (``run_status``). ``runlog runs``, ``runlog show``,
``runlog state``, their ``--json`` and the console all ask it; none of them decides a
status of its own. The log's part comes from the fold (``phase_of``), the live part (who
holds the run's lease now, and until when) is data the caller read from Redis and passes
in.

========================  ===============================================================
status                    meaning
========================  ===============================================================
``running``               not finished, a writer holds its lease (``owner``,
                          ``lease_expires_at``)
``waiting``               a person must decide (an approval request, a conflict that
                          stopped the run): ``waiting_for="person"``, ``since`` the
                          oldest request; or the run sleeps on a durable timer
                          (``run.sleep``, an agent's retry) that is not due:
                          ``waiting_for="time"``, ``until`` the due time, ``since`` the
                          sleep began (its last event), whoever holds it
``orphaned``              not finished, nothing it waits for, and nobody holds it or its
                          lease names a worker that is gone (``owner``, ``owner_alive``
                          false: the lease is free for the next owner); a run a draining
                          worker let go names it (``handed_over_by``). ``since`` its last
                          valid event (what its last owner wrote last)
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

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, get_args

from runlog.projections._run_state import RunState, accept
from runlog.projections._verdict import slim_dict
from runlog.schemas._models import Event

VIEW_VERSION = 3
"""Bump when the stored shape or meaning changes. 2: the store keeps the conversation and the
stored results apart (``to_dict(slim=True)``); a version-1 view is split on its next write.
3: the run state's scalars, open calls and approvals are stored apart as well; a view of an
earlier version is split on its next write."""


def facts(state: RunState, *names: str) -> dict[str, Any]:
    """The named fields of ``state``, in the order given, a collection (the conversation,
    calls, approvals) by its size: what every summary of a run reports."""
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(state, name)
        out[name] = len(value) if isinstance(value, list | dict) else value
    return out


@dataclass
class Quarantined:
    """A record of this run (by Kafka key) that the projection could not use."""

    partition: int
    offset: int
    error: str
    """Error class name, e.g. ``CorruptRecord``."""


@dataclass
class StateView:
    state: RunState = field(default_factory=RunState)
    partition: int | None = None
    first_offset: int | None = None
    """Offset of the first record with this run's key: where a replay should start."""
    last_offset: int | None = None
    records: int = 0
    """Records of this run seen (valid, fenced or quarantined)."""
    quarantined: list[Quarantined] = field(default_factory=list)

    def to_dict(self, *, slim: bool = False) -> dict[str, Any]:
        """JSON-ready view; ``slim`` leaves out the conversation and the stored results
        (empty), the parts that grow with every event and that a store keeps apart."""
        return {
            "state": slim_dict(self.state) if slim else self.state.to_dict(),
            **self.location_dict(),
        }

    def location_dict(self) -> dict[str, Any]:
        """The view without its run state: where the run lives in the log."""
        return {
            "version": VIEW_VERSION,
            "partition": self.partition,
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
            "records": self.records,
            "quarantined": [
                {"partition": q.partition, "offset": q.offset, "error": q.error}
                for q in self.quarantined
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StateView:
        return cls(
            state=RunState.from_dict(data["state"]),
            partition=data["partition"],
            first_offset=data["first_offset"],
            last_offset=data["last_offset"],
            records=data["records"],
            quarantined=[Quarantined(**q) for q in data["quarantined"]],
        )

    def summary(self) -> dict[str, str]:
        """A flat, small view for dashboards (every value a string, Redis-hash ready)."""
        st = self.state
        head = facts(st, "run_id", "tenant", "status", "seq", "epoch", "turns")
        tokens = facts(st, "input_tokens", "output_tokens")
        counts = facts(
            st, "completed_calls", "open_calls", "compactions", "resumptions", "fenced_writes"
        )
        return {
            **{k: str(v) for k, v in (head | tokens).items()},
            "cost_usd": repr(st.cost_usd),
            **{k: str(v) for k, v in counts.items()},
            "outcome": st.outcome or "",
            "last_event_at": st.last_event_at.isoformat() if st.last_event_at else "",
            "partition": "" if self.partition is None else str(self.partition),
            "first_offset": "" if self.first_offset is None else str(self.first_offset),
            "quarantined": str(len(self.quarantined)),
            # Only once erased: the summaries of every other run stay as they were.
            **(
                {}
                if st.erased is None
                else {
                    "erased_by": st.erased.erased_by,
                    "erased_at": st.erased.erased_at.isoformat(),
                    "erasure_reason": st.erased.reason,
                }
            ),
        }


def place(view: StateView, partition: int, offset: int) -> None:
    """Note that a record of the run sits at ``offset`` (whatever the fold made of it)."""
    _locate(view, partition, offset)


def _locate(view: StateView, partition: int, offset: int) -> None:
    if view.first_offset is None:
        view.partition, view.first_offset = partition, offset
    view.last_offset = offset
    view.records += 1


def apply_record(view: StateView, ev: Event, partition: int, offset: int) -> StateView:
    """Fold one decoded record (mutates and returns ``view``)."""
    fold_record(view, ev, partition, offset)
    return view


def fold_record(view: StateView, ev: Event, partition: int, offset: int) -> bool:
    """Fold one decoded record into ``view`` (mutated); True iff the run state accepted it."""
    _locate(view, partition, offset)
    return accept(view.state, ev)


def apply_quarantined(view: StateView, partition: int, offset: int, error: str) -> StateView:
    """Mark that a record of this run was quarantined; the run state itself is unchanged."""
    _locate(view, partition, offset)
    view.quarantined.append(Quarantined(partition, offset, error))
    return view


# ---------------------------------------------------------------------- the run's status

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
STATUSES: tuple[Status, ...] = get_args(Status)

Phase = Literal[
    "active", "waiting", "sleeping", "cancelling", "finished", "failed", "cancelled", "terminated"
]
PHASES: tuple[Phase, ...] = get_args(Phase)
"""The part of a status the log alone decides (what the run index stores): ``active``
becomes ``running`` or ``orphaned`` by who holds the lease now; ``sleeping`` is the status
``waiting`` for a time."""

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
    alive: bool = True
    """False: the lease names a session whose liveness key is gone (its worker died): the
    lease is free for whoever takes the run next."""
    handed_over_by: str | None = None
    """Set on a lease-less holder record: the run was let go by this draining owner."""


@dataclass(frozen=True)
class RunStatus:
    status: Status
    since: datetime | None = None
    """orphaned: its last valid event; waiting: the oldest request; cancelling: the
    request; ended: its last event."""
    owner: str | None = None
    lease_expires_at: datetime | None = None
    waiting_for: Literal["person", "time"] | None = None
    until: datetime | None = None
    """waiting for a time: when the durable timer is due."""
    owner_alive: bool = True
    """False: ``owner`` is a worker that is gone (its session's liveness key expired)."""
    handed_over_by: str | None = None
    """An orphan a draining worker let go (its handover), waiting for the next owner."""

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
            "until": None if self.until is None else self.until.isoformat(),
            "owner_alive": self.owner_alive,
            "handed_over_by": self.handed_over_by,
        }

    def text(self) -> str:
        """One line for people: ``running (owner w1/ab12, lease until 12:00:01)``."""
        parts: list[str] = []
        head: str = self.status
        if self.waiting_for == "time" and self.until is not None:
            head += f" until {self.until.isoformat(timespec='seconds')}"
        elif self.waiting_for is not None:
            head += f" for a {self.waiting_for}"
        if self.owner is not None and not self.owner_alive:
            parts.append(f"lease held by {self.owner}, expired: its worker is gone")
        elif self.owner is not None:
            until = self.lease_expires_at.strftime("%H:%M:%S") if self.lease_expires_at else "?"
            parts.append(f"owner {self.owner}, lease until {until}")
        if self.handed_over_by is not None:
            parts.append(f"handed over by {self.handed_over_by}")
        if self.since is not None and self.status != "running":
            parts.append(f"since {self.since.isoformat(timespec='seconds')}")
        return head + (f" ({'; '.join(parts)})" if parts else "")


def phase_of(st: RunState) -> Phase:
    """The log's part of the status (the first that holds wins)."""
    if st.status == "finished":
        return ENDED_BY.get(st.outcome or "", "finished")
    if st.cancel is not None:
        return "cancelling"
    if st.status == "escalated" or st.pending_approvals:
        return "waiting"
    if sleeping_until(st) is not None:
        return "sleeping"
    return "active"


def sleeping_until(st: RunState) -> datetime | None:
    """The due time of the durable timer the run sleeps on, else None.

    From the log alone: the run's latest timer is due after its last valid event, so
    nothing happened since it was due (the wake-up's RUN_RESUMED, or the agent's next step
    after the sleep, is written at or after the due time)."""
    if not st.timers or st.last_event_at is None:
        return None
    due = st.timers[-1].due_at
    return due if due > st.last_event_at else None


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


def status_from(
    phase: str, holder: Holder | None, since: datetime | None, until: datetime | None = None
) -> RunStatus:
    """The status of a run in ``phase`` (``PHASES``) that ``holder`` holds (None: nobody);
    ``until``: a sleeping run's due time."""
    owner = None if holder is None else holder.owner
    expires = None if holder is None else holder.expires_at
    alive = holder is None or holder.alive  # a dead session's lease is nobody's to renew
    if phase in ("finished", "failed", "cancelled", "terminated"):
        return RunStatus(phase, since)  # type: ignore[arg-type]
    if phase == "cancelling":
        return RunStatus("cancelling", since, owner, expires, owner_alive=alive)
    if phase == "waiting":
        return RunStatus("waiting", since, owner, expires, owner_alive=alive, waiting_for="person")
    if phase == "sleeping":
        return RunStatus(
            "waiting", since, owner, expires, owner_alive=alive, waiting_for="time", until=until
        )
    if holder is not None and holder.handed_over_by is not None:
        return RunStatus("orphaned", since, handed_over_by=holder.handed_over_by)
    if holder is not None and not holder.alive:
        return RunStatus("orphaned", since, owner, expires, owner_alive=False)
    if holder is not None:
        return RunStatus("running", since, owner, expires)
    return RunStatus("orphaned", since)


def run_status(st: RunState, holder: Holder | None) -> RunStatus:
    """The status of the run whose fold is ``st`` and whose lease ``holder`` holds."""
    return status_from(phase_of(st), holder, since_of(st), sleeping_until(st))


def phases_for(status: str) -> tuple[Phase, ...]:
    """The stored phases a run of ``status`` is in (a filter on the run index)."""
    if status in ("running", "orphaned"):
        return ("active",)
    if status == "waiting":
        return ("waiting", "sleeping")
    if status in PHASES:
        return (status,)
    raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
