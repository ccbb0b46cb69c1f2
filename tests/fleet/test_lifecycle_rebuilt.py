"""``lifecycle.rebuilt``: the record a run's log implies, the rule a worker applies to a
record that disagrees with the log and a start request applies to a run that has one. Pure:
a state in, a record out (no stack)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runlog.fleet._lifecycle import Record, rebuilt
from runlog.projections._run_state import Approval, Cancellation, Erasure, RunState, Timer

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _running(**kw: object) -> RunState:
    st = RunState(run_id="r", tenant="acme", status="running", agent_name="sleeper")
    for k, v in kw.items():
        setattr(st, k, v)
    return st


def _state(st: RunState) -> str | None:
    got = rebuilt(st, NOW)
    return None if got is None else got.state


def test_the_log_names_tenant_and_agent_never_the_record() -> None:
    assert rebuilt(_running(), NOW) == Record("open", "acme", "sleeper")


def test_a_timer_not_yet_due_is_waited_for_with_its_own_due_time() -> None:
    due = NOW + timedelta(seconds=40)
    st = _running(timers=(Timer(NOW - timedelta(hours=1)), Timer(due)))
    assert rebuilt(st, NOW) == Record("waiting_until", "acme", "sleeper", due_at=due)


def test_a_timer_due_or_a_cancel_or_a_question_dispatches_the_run_to_find_its_wait_again() -> None:
    later = (Timer(NOW + timedelta(seconds=40)),)
    assert _state(_running(timers=(Timer(NOW - timedelta(seconds=1)),))) == "open"
    asked = Cancellation("ops", "stop", 3, NOW)
    assert _state(_running(timers=later, cancel=asked)) == "open"
    pending = {"a1": Approval("a1", "action", "pay?", 4, NOW)}
    assert _state(_running(timers=later, approvals=pending)) == "open"


def test_an_ended_erased_unstarted_or_unregistered_run_has_no_record() -> None:
    assert rebuilt(_running(status="finished", outcome="succeeded"), NOW) is None
    gone = Erasure("dpo", "art. 17", "user-1", ["k1"], 5, NOW)
    assert rebuilt(_running(erased=gone), NOW) is None
    assert rebuilt(RunState(), NOW) is None
    assert rebuilt(_running(agent_name=None), NOW) is None
