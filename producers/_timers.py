"""Durable timers: ``run.sleep(seconds)`` records when the run is due again.

A timer is an event (TIMER_STARTED: its ordinal, the seconds asked, ``due_at``), so a run
re-executed from the top (a worker of the fleet dispatching it again) finds its k-th
``sleep`` already recorded and waits only for what is left of it. A timer not yet due
raises ``TimerPending`` out of the agent function: the worker that runs it releases the
run's lease and its slot, and dispatches the run again at ``due_at``. Outside a worker
(``open_run`` in a script), ``sleep`` simply waits in this thread when asked to block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from runlog.projections._run_state import RunState, Timer
from runlog.schemas import _codec as codec

SLEEP = ""
RETRY = "retry"


class TimerPending(BaseException):
    """The run waits for its timer: unwinds the agent function to its worker.

    A ``BaseException`` (as ``KeyboardInterrupt``) so that an agent's ``except Exception``
    around a step never swallows it.
    """

    def __init__(self, run_id: str, due_at: datetime) -> None:
        super().__init__(f"run {run_id} sleeps until {due_at.isoformat()}")
        self.run_id = run_id
        self.due_at = due_at


@dataclass(frozen=True)
class NextTimer:
    """The timer the next ``sleep`` of a run names: recorded already, or to append."""

    ordinal: int
    """Its ordinal among all the run's timers (TIMER_STARTED ``timer``)."""
    recorded: Timer | None


def next_timer(state: RunState, used: int, purpose: str = SLEEP) -> NextTimer:
    """The ``used``-th timer of ``purpose`` in ``state``, or the ordinal a new one takes."""
    mine = [i for i, t in enumerate(state.timers) if t.purpose == purpose]
    if used < len(mine):
        return NextTimer(mine[used], state.timers[mine[used]])
    return NextTimer(len(state.timers), None)


def payload(ordinal: int, seconds: float, purpose: str) -> dict[str, object]:
    due = codec.now_utc() + timedelta(seconds=max(0.0, seconds))
    return {"timer": ordinal, "seconds": max(0.0, seconds), "due_at": due, "purpose": purpose}


def remaining_s(due_at: datetime) -> float:
    return (due_at - codec.now_utc()).total_seconds()


def wait_or_raise(run_id: str, due_at: datetime, *, block: bool) -> None:
    """Return once ``due_at`` has passed: at once, by waiting here (``block``), or by
    raising ``TimerPending`` to the worker."""
    left = remaining_s(due_at)
    if left <= 0:
        return
    if not block:
        raise TimerPending(run_id, due_at)
    time.sleep(left)
