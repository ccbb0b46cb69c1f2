"""The state projection: the run-state fold plus where the run lives in the log.

Pure: the log position of a record is given to the fold as data, like the event itself.
The run state is exactly ``projections._run_state.apply`` (the writers' fold and validation
rule); this module only adds what a reader of the log knows and a writer does not need:
the run's partition and first offset (so replay jobs can seek instead of scanning) and the
records of the run that could not be decoded (quarantined).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
