"""``runlog bench fleet``'s observer: what its steps phase counts is in the log.

The steps phase stops its clock when the observer has seen every run's RUN_FINISHED, and
counts a run as succeeded only with its outcome and every step's TOOL_CALL_COMPLETED, read
from the records' type headers undecoded. A wrong count there would report a fleet figure
for work that was not done.
"""

from __future__ import annotations

import time
from typing import Any

import runlog
from runlog._settings import Settings
from runlog.schemas._vocabulary import EventType
from tools.benchmarks.fleet import Follower, _finishes


def _run(settings: Settings, calls: int, outcome: str | None) -> str:
    def step(args: dict[str, Any], *, idempotency_key: str) -> str:
        return f"step {args['i']}"

    tool = runlog.tool("step", risk="safe")(step)
    with runlog.open_run(settings=settings, tools=[tool]) as run:
        for i in range(calls):
            run.call_tool("step", {"i": i})
        if outcome is not None:
            run.finish(outcome, "done")
        return run.run_id


def test_the_observer_decodes_only_finishes_and_counts_every_other_record(
    test_settings: Settings,
) -> None:
    ok, failed = _run(test_settings, 3, "succeeded"), _run(test_settings, 1, "failed")
    still_open = _run(test_settings, 2, None)

    follower = Follower(test_settings, only=frozenset({EventType.RUN_FINISHED}))
    outcomes = _finishes(follower, [ok, failed], 30)

    assert outcomes == {ok: "succeeded", failed: "failed"}
    completed = EventType.TOOL_CALL_COMPLETED.value
    assert follower.counts[ok][completed] == 3
    assert follower.counts[failed][completed] == 1
    assert follower.counts[ok][EventType.RUN_STARTED.value] == 1
    # Only finishes were decoded, and nothing was folded from them alone.
    assert all(ev.type is EventType.RUN_FINISHED for evs in follower.events.values() for ev in evs)
    assert still_open not in follower.events
    assert not follower.states


def test_an_observer_of_every_record_folds_each_run(test_settings: Settings) -> None:
    rid = _run(test_settings, 2, "succeeded")
    follower = Follower(test_settings)
    deadline = time.monotonic() + 30
    try:
        while rid not in follower.states or follower.states[rid].status != "finished":
            assert time.monotonic() < deadline, "the run's finish never arrived"
            follower.poll(1.0)
    finally:
        follower.close()
    assert follower.states[rid].outcome == "succeeded"
    assert not follower.counts
