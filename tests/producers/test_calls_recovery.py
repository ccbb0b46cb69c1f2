"""A worker dies (SIGKILL) or pauses (SIGSTOP) and a fresh process resumes the same run.

Every test checks three things: the log (which events, valid or fenced), the state (the
fold of the log read back equals the resumed worker's state) and the side effects
(counted in Redis by the tool, outside every worker process).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import redis
from workers.common import (
    EXIT_ESCALATED,
    EXIT_FENCED,
    EXIT_OK,
    Ledger,
    assert_log_sound,
    fold_log,
    payloads,
    read_log,
    start_worker,
    valid_types,
    verdicts,
    wait_lease_gone,
)

import runlog
from runlog._settings import Settings
from runlog.schemas import _models as m
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(90)


def _events(settings: Settings, run_id: str) -> list[m.Event]:
    return [r.event for r in read_log(settings, run_id)]


def _wait_for_last(settings: Settings, run_id: str, kind: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (types := valid_types(_events(settings, run_id))) or types[-1] != kind:
        assert time.monotonic() < deadline, f"the log of {run_id} never ended in {kind}"
        time.sleep(0.05)


def _verified(settings: Settings, run_id: str, result: dict[str, object]) -> list[m.Event]:
    """The log is sound and its fold is exactly the state the last worker held."""
    events = _events(settings, run_id)
    state = assert_log_sound(events)
    assert state.digest() == result["digest"], "replay of the log differs from the live state"
    assert state.fenced_writes == 0
    return events


def _ok(code: int, result: dict[str, object], expected: int = EXIT_OK) -> None:
    assert code == expected, f"exit {code}: {result.get('_stdout')}\n{result.get('_stderr')}"


def test_a_resumed_run_does_not_repeat_a_side_effect(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    """The spec's regression: the charge is recorded, the worker dies, a new one resumes."""
    rid = new_run_id()
    first = start_worker(
        fast, tmp_path, "first", "--run-id", rid, "--think-at", "2", "--think-s", "60"
    )
    first.wait_flag("model-2")  # the charge completed; the model is thinking about step 2
    first.kill()
    assert ledger.total() == 1

    second = start_worker(fast, tmp_path, "second", "--run-id", rid)
    code, result = second.finish()
    _ok(code, result)
    assert ledger.total() == 1, "resumption must not re-issue the charge"
    events = _verified(fast, rid, result)
    assert valid_types(events).count("tool_call_started") == 1
    assert result["status"] == "finished" and result["epoch"] == 2

    # A third process opening the finished run does nothing at all.
    third = start_worker(fast, tmp_path, "third", "--run-id", rid)
    code, result3 = third.finish()
    _ok(code, result3)
    assert ledger.total() == 1
    assert len(_events(fast, rid)) == len(events)


@pytest.mark.parametrize("point", ["mid-model", "mid-tool", "after-effect"])
def test_sigkill_then_resume_effect_happens_once(
    point: str, fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    rid = new_run_id()
    args = {
        "mid-model": ["--think-at", "1", "--think-s", "60"],
        "mid-tool": ["--charge-mode", "block-before"],
        "after-effect": ["--charge-mode", "block-after"],
    }[point]
    flag = {"mid-model": "model-1", "mid-tool": "in-tool", "after-effect": "effect"}[point]
    first = start_worker(fast, tmp_path, "first", "--run-id", rid, *args)
    first.wait_flag(flag)
    if point == "mid-model":
        # Step 0's model turn is pipelined: killed during step 1's model call, once it is in
        # the log (a real model call lasts far longer than the producer's linger).
        _wait_for_last(fast, rid, "model_turn")
    first.kill()
    before = _events(fast, rid)
    assert ledger.total() == (1 if point == "after-effect" else 0)
    if point == "mid-model":
        assert valid_types(before)[-1] == "model_turn"  # step 1 was never recorded
    else:
        assert valid_types(before)[-1] == "tool_call_started"  # durable before the tool ran

    second = start_worker(fast, tmp_path, "second", "--run-id", rid, "--reconcile", "ledger")
    code, result = second.finish()
    _ok(code, result)
    events = _verified(fast, rid, result)
    assert ledger.total() == 1 and len(ledger.per_key()) == 1
    (key,) = ledger.per_key()
    types = valid_types(events)
    started = payloads(events, EventType.TOOL_CALL_STARTED)
    completed = payloads(events, EventType.TOOL_CALL_COMPLETED)
    recon = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert {p.idempotency_key for p in started} == {key}
    assert [p.idempotency_key for p in completed] == [key]
    assert types[-1] == "run_finished" and types.count("model_turn") == 3
    if point == "mid-model":
        assert "tool_call_uncertain" not in types and not recon
        assert [p.attempt for p in started] == [1] and completed[0].source == "live"
    elif point == "mid-tool":
        (unc,) = payloads(events, EventType.TOOL_CALL_UNCERTAIN)
        assert unc.detected_by == "recovery"
        assert [(r.outcome, r.action) for r in recon] == [("absent", "retry")]
        assert [p.attempt for p in started] == [1, 2] and completed[0].source == "live"
    else:
        (unc,) = payloads(events, EventType.TOOL_CALL_UNCERTAIN)
        assert unc.detected_by == "recovery"
        assert [(r.outcome, r.action) for r in recon] == [("match", "complete")]
        assert [p.attempt for p in started] == [1]
        assert completed[0].source == "reconciliation"
        assert completed[0].content == "charged 7 to A-1"
    if point != "mid-model":  # recovery settled the call before the model acted again
        after = types[types.index("run_resumed") + 1 :]
        assert after.index("tool_call_completed") < after.index("model_turn")


def test_sigkill_after_effect_irreversible_without_reconciler_escalates(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    rid = new_run_id()
    first = start_worker(fast, tmp_path, "first", "--run-id", rid, "--charge-mode", "block-after")
    first.wait_flag("effect")
    first.kill()

    second = start_worker(fast, tmp_path, "second", "--run-id", rid, "--reconcile", "none")
    code, result = second.finish()
    _ok(code, result, EXIT_ESCALATED)
    events = _verified(fast, rid, result)
    assert ledger.total() == 1
    (req,) = payloads(events, EventType.APPROVAL_REQUESTED)
    (started,) = payloads(events, EventType.TOOL_CALL_STARTED)
    assert req.kind == "uncertain_call" and req.approval_id == result["approval_id"]
    assert req.idempotency_key == started.idempotency_key
    assert req.args_json == started.args_json and req.started_at is not None
    assert req.last_error and "never completed" in req.last_error
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("no_reconciler", "escalate")

    # Resuming again without a decision still never re-executes it.
    third = start_worker(fast, tmp_path, "third", "--run-id", rid, "--reconcile", "none")
    code, result3 = third.finish()
    _ok(code, result3, EXIT_ESCALATED)
    assert ledger.total() == 1
    assert len(payloads(_events(fast, rid), EventType.TOOL_CALL_STARTED)) == 1

    # A person says it already happened: the call completes with the note, unexecuted.
    assert (
        runlog.decide(
            rid,
            req.approval_id,
            approved=False,
            decided_by="ops@example",
            note="charged by phone",
            settings=fast,
        )
        == "recorded"
    )
    fourth = start_worker(fast, tmp_path, "fourth", "--run-id", rid, "--reconcile", "none")
    code, result4 = fourth.finish()
    _ok(code, result4)
    events = _verified(fast, rid, result4)
    assert ledger.total() == 1
    assert len(payloads(events, EventType.TOOL_CALL_STARTED)) == 1
    (done,) = payloads(events, EventType.TOOL_CALL_COMPLETED)
    assert done.source == "reconciliation" and "charged by phone" in done.content
    assert result4["status"] == "finished"


def test_paused_owner_is_fenced_after_takeover_and_new_owner_reconciles(
    fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    """The spec's combined failure: pause after the remote effect, transfer, wake up."""
    rid = new_run_id()
    old = start_worker(fast, tmp_path, "old", "--run-id", rid, "--charge-mode", "block-after")
    old.wait_flag("effect")
    old.kill(signal.SIGSTOP)  # its lease renewer stops too
    try:
        wait_lease_gone(redis_client, fast)
        new = start_worker(fast, tmp_path, "new", "--run-id", rid, "--reconcile", "ledger")
        code, result = new.finish()
        _ok(code, result)
        assert result["epoch"] == 2 and result["status"] == "finished"
    finally:
        old.kill(signal.SIGCONT)
    old.go()  # the tool returns; the old owner tries to append its completion
    code, old_result = old.finish()
    _ok(code, old_result, EXIT_FENCED)
    assert old_result["outcome"] == "Fenced"

    events = _events(fast, rid)
    assert_log_sound(events)
    pairs = verdicts(events)
    stale = [ev for ev, ok in pairs if not ok]
    assert all(ev.epoch == 1 for ev in stale)  # anything the old owner landed is fenced
    state = fold_log(events)
    assert state.fenced_writes == len(stale)
    assert fold_log([ev for ev, ok in pairs if ok]).digest() == result["digest"]
    types = valid_types(events)
    assert "tool_call_uncertain" in types and "reconciliation_attempted" in types
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("match", "complete")
    (done,) = payloads(events, EventType.TOOL_CALL_COMPLETED)
    assert done.source == "reconciliation"
    assert ledger.total() == 1


def test_reexecuting_the_script_after_a_crash_recomputes_the_same_keys(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    """Two intentional charges of 7 are two actions; re-running the script is not a third."""
    rid = new_run_id()
    first = start_worker(
        fast, tmp_path, "first", "--run-id", rid, "--scenario", "direct", "--hold-after"
    )
    first_results = json.loads(first.wait_flag("after-calls"))
    first.kill()
    counts = ledger.per_key()
    assert len(counts) == 2 and set(counts.values()) == {1}

    second = start_worker(fast, tmp_path, "second", "--run-id", rid, "--scenario", "direct")
    code, result = second.finish()
    _ok(code, result)
    assert ledger.per_key() == counts, "the re-executed script charged again"
    assert json.loads((tmp_path / "second.after-calls").read_text()) == first_results
    events = _verified(fast, rid, result)
    started = payloads(events, EventType.TOOL_CALL_STARTED)
    assert sorted(p.idempotency_key for p in started) == sorted(counts)
