"""Where a run is in its life: the log's phase, completed by who holds the lease now.

Pure: the runs' logs are built in memory and folded (``projections._run_state.fold``); the
lease's holder is data, as the callers read it from Redis.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from codec_support import make_event

from runlog.projections._run_state import RunState, fold
from runlog.projections._state_view import (
    PHASES,
    STATUSES,
    Holder,
    phase_of,
    phases_for,
    run_status,
    since_of,
    sleeping_until,
    status_from,
)
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

T0 = datetime(2020, 1, 1, tzinfo=UTC)
LEASE = T0 + timedelta(hours=1)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Run:
    """A run's log as its owner appends it, each event ``t`` seconds after T0."""

    def __init__(self) -> None:
        self.seq, self.epoch = 0, 1
        self.events: list[Event] = []
        self.add(EventType.RUN_STARTED, 0, agent="a", goal="g")

    def add(self, et: EventType, t: float, **payload: Any) -> Event:
        self.seq += 1
        return self.write(et, t, seq=self.seq, epoch=self.epoch, **payload)

    def write(self, et: EventType, t: float, *, seq: int, epoch: int, **payload: Any) -> Event:
        """Any record, valid or not (a stale owner's, when ``epoch`` is an old one)."""
        ev = make_event(
            et, payload, run_id="r1", tenant="acme", seq=seq, epoch=epoch, occurred_at=at(t)
        )
        self.events.append(ev)
        return ev

    def ask(self, approval_id: str, t: float, kind: str = "action") -> None:
        self.add(EventType.APPROVAL_REQUESTED, t, approval_id=approval_id, kind=kind, reason="r")

    def sleep(self, t: float, until: float, timer: int = 0) -> None:
        """A durable timer started at ``t``, due at ``until``."""
        self.add(EventType.TIMER_STARTED, t, timer=timer, seconds=until - t, due_at=at(until))

    def state(self) -> RunState:
        return fold(self.events)


@pytest.mark.parametrize(
    ("outcome", "phase"),
    [
        ("succeeded", "finished"),
        ("anything else", "finished"),
        ("failed", "failed"),
        ("cancelled", "cancelled"),
        ("terminated", "terminated"),
    ],
)
def test_the_finish_decides_first_and_three_outcomes_have_a_status_of_their_own(
    outcome: str, phase: str
) -> None:
    run = Run()
    run.ask("ap1", 1)  # still pending
    run.add(EventType.RUN_CANCEL_REQUESTED, 2, requested_by="ops", reason="stop")
    run.sleep(3, until=600)  # not due
    run.add(EventType.RUN_FINISHED, 4, outcome=outcome)
    st = run.state()
    assert phase_of(st) == phase
    # An ended run's status is its phase, whoever still holds a lease on it.
    told = run_status(st, Holder("w1", 1, LEASE))
    assert told.status == phase and told.ended and told.owner is None
    assert told.since == at(4)


def test_a_cancel_comes_before_waiting_and_waiting_for_a_person_before_a_timer() -> None:
    run = Run()
    run.sleep(1, until=600)
    assert phase_of(run.state()) == "sleeping"
    run.ask("ap1", 2)
    assert phase_of(run.state()) == "waiting"
    run.add(EventType.RUN_CANCEL_REQUESTED, 3, requested_by="ops", reason="stop")
    run.add(EventType.RUN_CANCEL_REQUESTED, 4, requested_by="bob", reason="again")
    run.add(EventType.USER_MESSAGE, 5, content="later")
    st = run.state()
    assert phase_of(st) == "cancelling"
    assert since_of(st) == at(3), "since the request that stands, the first one"
    # A conflict stops the run (escalated): it waits for a person too.
    conflict = Run()
    conflict.ask("c1", 1, kind="conflict")
    st = conflict.state()
    assert st.status == "escalated" and phase_of(st) == "waiting"


def test_a_waiting_run_is_waiting_since_its_oldest_open_request() -> None:
    run = Run()
    run.ask("ap1", 1)
    run.ask("ap2", 2)
    run.ask("ap3", 3)
    run.add(EventType.USER_MESSAGE, 4, content="meanwhile")
    assert since_of(run.state()) == at(1)
    run.add(EventType.APPROVAL_DECIDED, 5, approval_id="ap1", approved=True, decided_by="ann")
    st = run.state()
    assert phase_of(st) == "waiting" and since_of(st) == at(2)
    told = run_status(st, None)
    assert (told.status, told.waiting_for, told.since, told.owner) == (
        "waiting",
        "person",
        at(2),
        None,
    )
    # Every request decided: nothing to wait for; an unheld run is orphaned since its last event.
    run.add(EventType.APPROVAL_DECIDED, 6, approval_id="ap2", approved=False, decided_by="ann")
    run.add(EventType.APPROVAL_DECIDED, 7, approval_id="ap3", approved=True, decided_by="ann")
    told = run_status(run.state(), None)
    assert (told.status, told.since) == ("orphaned", at(7))


def test_a_run_sleeps_until_its_latest_timer_is_due_and_a_fenced_write_does_not_wake_it() -> None:
    run = Run()
    run.sleep(1, until=10)
    run.epoch = 2  # a worker takes the run at the due time: it woke up
    run.add(EventType.RUN_RESUMED, 10, previous_epoch=1, expected_prev_seq=run.seq)
    assert sleeping_until(run.state()) is None and phase_of(run.state()) == "active"
    run.sleep(11, until=100, timer=1)
    # The old owner's late write, after the due time: not a valid event, so not a wake-up.
    run.write(EventType.USER_MESSAGE, 200, seq=run.seq + 1, epoch=1, content="stale")
    st = run.state()
    assert st.fenced_writes == 1
    assert sleeping_until(st) == at(100) and phase_of(st) == "sleeping"
    told = run_status(st, Holder("w2", 2, LEASE))
    assert (told.status, told.waiting_for, told.until, told.since) == (
        "waiting",
        "time",
        at(100),
        at(11),
    )
    assert told.owner == "w2", "a sleeping run waits for its time, whoever holds it"
    # The next valid event written at the due time: the timer is no longer waited for.
    run.add(EventType.USER_MESSAGE, 100, content="awake")
    assert sleeping_until(run.state()) is None and phase_of(run.state()) == "active"


ALIVE = Holder("w1", 3, LEASE)
DEAD = Holder("w1", 3, LEASE, alive=False)
HANDED = Holder("", 3, LEASE, handed_over_by="w0")


@pytest.mark.parametrize(
    ("holder", "status", "owner", "owner_alive", "handed_over_by"),
    [
        (ALIVE, "running", "w1", True, None),
        (DEAD, "orphaned", "w1", False, None),
        (HANDED, "orphaned", None, True, "w0"),
        (None, "orphaned", None, True, None),
    ],
)
def test_who_holds_an_active_run_decides_running_or_orphaned(
    holder: Holder | None,
    status: str,
    owner: str | None,
    owner_alive: bool,
    handed_over_by: str | None,
) -> None:
    run = Run()
    run.add(EventType.USER_MESSAGE, 7, content="hi")
    told = run_status(run.state(), holder)
    assert told.status == status and not told.ended
    assert (told.owner, told.owner_alive, told.handed_over_by) == (
        owner,
        owner_alive,
        handed_over_by,
    )
    assert told.lease_expires_at == (LEASE if owner else None)
    assert told.since == at(7) and told.waiting_for is None
    # JSON-ready: every value a str, bool or None.
    assert all(isinstance(v, str | bool | type(None)) for v in told.to_dict().values())


def test_an_orphan_tells_why_nobody_moves_it_in_the_words_the_docs_show() -> None:
    """docs/howto/stopping-runs.md, "Status": the detail ``runlog runs`` shows."""
    since = at(7)
    dead = status_from("active", DEAD, since).text()
    assert "lease held by w1, expired: its worker is gone" in dead
    handed = status_from("active", HANDED, since).text()
    assert "handed over by w0" in handed and "lease" not in handed
    running = status_from("active", ALIVE, since).text()
    assert running.startswith("running (owner w1") and "since" not in running


@pytest.mark.parametrize("phase", ["cancelling", "waiting", "sleeping"])
def test_a_waiting_or_cancelling_run_whose_worker_died_is_not_told_as_owned(phase: str) -> None:
    """Waiting for a person (or a timer, or its clean-up) is the log's part; whether its
    owner still lives is Redis's, and a dead session's worker is told as gone."""
    dead = status_from(phase, DEAD, at(7), at(9))
    assert not dead.owner_alive and "its worker is gone" in dead.text()
    alive = status_from(phase, ALIVE, at(7), at(9))
    assert alive.owner_alive and "owner w1, lease until" in alive.text()


HOLDERS = (None, ALIVE, DEAD, HANDED)


def test_the_index_filter_finds_every_run_of_a_status_and_only_those() -> None:
    """The run index stores the phase and filters by ``phases_for(status)``: a run is listed
    under a status iff its phase, with some holder, gives that status."""
    gives: dict[str, set[str]] = {s: set() for s in STATUSES}
    for phase in PHASES:
        for holder in HOLDERS:
            status = status_from(phase, holder, T0, LEASE).status
            assert status in STATUSES
            assert phase in phases_for(status), (phase, holder, status)
            gives[status].add(phase)
    for status in STATUSES:
        assert set(phases_for(status)) == gives[status], status


def test_an_unknown_status_is_refused_naming_the_statuses() -> None:
    with pytest.raises(ValueError, match="status must be one of") as refused:
        phases_for("asleep")
    assert all(s in str(refused.value) for s in STATUSES) and "'asleep'" in str(refused.value)
