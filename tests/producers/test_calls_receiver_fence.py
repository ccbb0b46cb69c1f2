"""A worker paused (SIGSTOP) inside an irreversible call with a lookup, its run taken over
and the call reconciled, then woken (SIGCONT): its request, still in flight, must not make
the effect a second time.

A lookup proves a request absent *now*. Only the receiver can prove it will never land:
these tests pause the owner while its request is held before the receiver commits it,
and count the effects the receiver (``workers.common.Ledger``, in Redis, outside every
worker process) applied per key once the paused request went on.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from workers.common import (
    EXIT_ESCALATED,
    EXIT_FENCED,
    EXIT_OK,
    Ledger,
    Worker,
    assert_log_sound,
    payloads,
    read_log,
    start_worker,
    wait_lease_gone,
)

import runlog
import runlog.aio
from runlog._settings import Settings
from runlog.errors import InvalidToolDeclaration
from runlog.schemas import _models as m
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

NEW_OWNER_TTL_MS = 8000


def _events(settings: Settings, run_id: str) -> list[m.Event]:
    return [rec.event for rec in read_log(settings, run_id)]


def _pause_in_flight_then_take_over(
    fast: Settings, tmp: Path, client: redis.Redis, rid: str, *receiver: str
) -> tuple[Worker, int, dict[str, object]]:
    """The owner's request is in flight (held before the receiver commits it) when the owner
    is paused; another worker takes the run over and reconciles the call; then the paused
    owner wakes and its request goes on. Returns the old owner and the new one's exit."""
    old = start_worker(
        fast, tmp, "old", "--run-id", rid, "--charge-mode", "block-before", *receiver
    )
    old.wait_flag("in-tool")
    old.kill(signal.SIGSTOP)  # its lease renewer stops with it
    try:
        wait_lease_gone(client, fast)
        # The new owner keeps a longer lease: it may wait out a commit window, and one
        # stall of 1.5 s on a loaded machine would fence it (correctly, but off the point).
        new = start_worker(
            fast,
            tmp,
            "new",
            "--run-id",
            rid,
            "--reconcile",
            "ledger",
            *receiver,
            RUNLOG_LEASE_TTL_MS=str(NEW_OWNER_TTL_MS),
        )
        code, result = new.finish()
    finally:
        old.kill(signal.SIGCONT)
    old.go()  # the held request reaches the receiver now, after the reconciliation
    return old, code, result


def test_paused_request_is_refused_by_a_receiver_that_honours_the_token(
    fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    rid = new_run_id()
    old, code, result = _pause_in_flight_then_take_over(
        fast, tmp_path, redis_client, rid, "--receiver", "fenced"
    )
    assert code == EXIT_OK, result
    assert result["status"] == "finished"
    old_code, old_result = old.finish()
    assert old_code == EXIT_FENCED, old_result  # its refusal could not even be recorded

    events = _events(fast, rid)
    assert_log_sound(events)
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("absent", "retry")
    assert "token" in recon.rule
    assert ledger.per_key() == {recon.idempotency_key: 1}  # one effect, not two
    assert ledger.refused() == 1  # the paused owner's request, refused by its old token


def test_the_lookup_itself_fences_a_paused_request_that_lands_before_the_retry(
    fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    """The late request lands between the new owner's lookup and its retry: only the floor
    the lookup raised can refuse it (the retry has not reached the receiver yet)."""
    rid = new_run_id()
    fenced = ("--receiver", "fenced")
    old = start_worker(
        fast, tmp_path, "old", "--run-id", rid, "--charge-mode", "block-before", *fenced
    )
    key = old.wait_flag("in-tool")
    old.kill(signal.SIGSTOP)
    try:
        wait_lease_gone(redis_client, fast)
        new = start_worker(
            fast, tmp_path, "new", "--run-id", rid, "--charge-mode", "block-before", *fenced
        )
        assert new.wait_flag("in-tool") == key  # the retry is held before the receiver
    finally:
        old.kill(signal.SIGCONT)
    old.go()
    old_code, old_result = old.finish()
    assert old_code == EXIT_FENCED, old_result
    assert ledger.per_key() == {} and ledger.refused() == 1  # refused by the lookup's floor
    new.go()
    code, result = new.finish()
    assert code == EXIT_OK and result["status"] == "finished", result
    assert ledger.per_key() == {key: 1}


def test_paused_request_lands_once_on_a_receiver_that_dedupes_by_key(
    fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    """The declaration that made "absent, retry" safe before the fence: unchanged."""
    rid = new_run_id()
    old, code, result = _pause_in_flight_then_take_over(
        fast, tmp_path, redis_client, rid, "--receiver", "dedupes_by_key"
    )
    assert code == EXIT_OK, result
    old_code, old_result = old.finish()
    assert old_code == EXIT_FENCED, old_result

    events = _events(fast, rid)
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("absent", "retry")
    assert "deduplicates by key" in recon.rule
    assert ledger.per_key() == {recon.idempotency_key: 1}
    assert ledger.refused() == 0  # landed late, and deduplicated: one effect all the same


def test_paused_request_past_its_deadline_is_refused_after_recovery_waited_for_it(
    fast: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """A receiver that enforces the deadline: recovery meets the absence before the
    deadline, waits it out, asks again, and only then retries; the late request is
    refused."""
    ledger = Ledger(redis_client, fast.redis_key_prefix, "deadline")
    rid = new_run_id()
    old, code, result = _pause_in_flight_then_take_over(
        fast, tmp_path, redis_client, rid, "--receiver", "deadline", "--commit-window-s", "6"
    )
    assert code == EXIT_OK, result
    old_code, old_result = old.finish()
    assert old_code == EXIT_FENCED, old_result

    events = _events(fast, rid)
    assert_log_sound(events)
    waited, retried = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (waited.outcome, waited.action) == ("absent", "keep_uncertain")
    assert "ask again after it" in waited.rule
    assert (retried.outcome, retried.action) == ("absent", "retry")
    assert "deadline" in retried.rule
    started = payloads(events, EventType.TOOL_CALL_STARTED)
    assert [s.attempt for s in started] == [1, 2]
    assert ledger.per_key() == {waited.idempotency_key: 1}
    assert ledger.refused() == 1  # the paused owner's request, after its deadline


def test_paused_request_on_a_receiver_that_declares_nothing_is_never_retried_on_absent(
    fast: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """Nothing stops the late request: "absent" means "not yet", so a person decides."""
    ledger = Ledger(redis_client, fast.redis_key_prefix, None)
    rid = new_run_id()
    old, code, result = _pause_in_flight_then_take_over(
        fast, tmp_path, redis_client, rid, "--receiver", "none"
    )
    assert code == EXIT_ESCALATED, result
    old_code, old_result = old.finish()
    assert old_code == EXIT_FENCED, old_result

    events = _events(fast, rid)
    assert_log_sound(events)
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("absent", "escalate")
    assert "declares no receiver guarantee" in recon.rule
    assert len(payloads(events, EventType.TOOL_CALL_STARTED)) == 1  # never retried
    (asked,) = payloads(events, EventType.APPROVAL_REQUESTED)
    assert asked.kind == "uncertain_call" and asked.idempotency_key == recon.idempotency_key
    assert ledger.per_key() == {recon.idempotency_key: 1}  # the late request, once


# ------------------------------------------------------------ the contract, in process
def _fence_recorder(seen: list[dict[str, Any]]) -> tuple[Any, Any]:
    """A tool that names the fence, and one written before it (the key only)."""

    def fenced(
        args: dict[str, Any], *, idempotency_key: str, fencing_token: int, commit_deadline: datetime
    ) -> str:
        ctx = runlog.current_call()
        assert ctx is not None
        seen.append(
            {
                "key": idempotency_key,
                "token": fencing_token,
                "deadline": commit_deadline,
                "ctx": (ctx.fencing_token, ctx.commit_deadline),
            }
        )
        return "sent"

    def key_only(args: dict[str, Any], *, idempotency_key: str) -> str:
        ctx = runlog.current_call()
        assert ctx is not None and ctx.commit_deadline is not None
        seen.append({"key": idempotency_key, "ctx": (ctx.fencing_token, ctx.commit_deadline)})
        return "sent"

    return (
        runlog.tool("fenced", risk="irreversible", commit_window_s=7)(fenced),
        runlog.tool("key_only", risk="irreversible")(key_only),
    )


def _check_fence(fast: Settings, run_id: str, epoch: int, seen: list[dict[str, Any]]) -> None:
    started = payloads(_events(fast, run_id), EventType.TOOL_CALL_STARTED)
    at = {
        p.idempotency_key: ev.occurred_at
        for ev in _events(fast, run_id)
        if isinstance((p := ev.payload), m.ToolCallStarted)
    }
    assert len(started) == 2 and len(seen) == 2
    fenced, key_only = seen
    # The deadline every reader computes from the log is the one the tool was sent.
    assert fenced["deadline"] == at[fenced["key"]] + timedelta(seconds=7)
    assert fenced["token"] == epoch and fenced["ctx"] == (epoch, fenced["deadline"])
    assert key_only["ctx"] == (epoch, at[key_only["key"]] + timedelta(seconds=30))


def test_the_fence_reaches_tools_of_either_signature_through_the_sync_driver(
    fast: Settings,
) -> None:
    seen: list[dict[str, Any]] = []
    with runlog.open_run(settings=fast, tools=list(_fence_recorder(seen))) as run:
        assert run.call_tool("fenced", {"a": 1}) == "sent"
        assert run.call_tool("key_only", {"a": 1}) == "sent"
        run_id, epoch = run.run_id, run.epoch
    _check_fence(fast, run_id, epoch, seen)


def test_the_fence_reaches_tools_of_either_signature_through_the_async_driver(
    fast: Settings,
) -> None:
    seen: list[dict[str, Any]] = []

    async def main() -> tuple[str, int]:
        async with runlog.aio.open_run(settings=fast, tools=list(_fence_recorder(seen))) as run:
            assert await run.call_tool("fenced", {"a": 1}) == "sent"
            assert await run.call_tool("key_only", {"a": 1}) == "sent"
            return run.run_id, run.epoch

    run_id, epoch = asyncio.run(main())
    _check_fence(fast, run_id, epoch, seen)


def test_a_live_timeout_on_a_fenced_receiver_is_not_retried_on_absent(fast: Settings) -> None:
    """The request in doubt carries this owner's own token: a lookup with the same token
    fences nothing, so the absence is not final and a person decides."""
    sent: list[int] = []

    def pay(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
        sent.append(fencing_token)
        raise TimeoutError("no answer: the request may still be on its way")

    def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
        return runlog.Absent("not there yet")  # the request has not arrived (yet)

    tool = runlog.tool("pay", risk="irreversible", reconcile=lookup, receiver="fenced")(pay)
    with runlog.open_run(settings=fast, tools=[tool]) as run:
        with pytest.raises(runlog.Escalated):
            run.call_tool("pay", {"eur": 5})
        run_id = run.run_id
    assert len(sent) == 1  # never retried
    events = _events(fast, run_id)
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("absent", "escalate")
    assert "own token" in recon.rule


def test_a_safe_tool_is_retried_on_absent_without_a_declaration(fast: Settings) -> None:
    calls: list[str] = []

    def probe(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        if len(calls) == 1:
            raise TimeoutError("no answer")
        return "probed"

    absent = runlog.tool("probe", reconcile=lambda a, **k: runlog.Absent("none"))(probe)
    with runlog.open_run(settings=fast, tools=[absent]) as run:
        assert run.call_tool("probe", {}) == "probed"
        run_id = run.run_id
    (recon,) = payloads(_events(fast, run_id), EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("absent", "retry") and "risk=safe" in recon.rule
    assert len(calls) == 2 and len(set(calls)) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("receiver", "idempotent"),
        ("receiver", ("fenced", 3)),
        ("commit_window_s", 0),
        ("commit_window_s", float("inf")),
        ("commit_window_s", "30"),
    ],
)
def test_a_declaration_runlog_cannot_honour_is_refused_when_the_tool_is_made(
    field: str, value: Any
) -> None:
    with pytest.raises(InvalidToolDeclaration) as info:
        runlog.tool("pay", risk="irreversible", **{field: value})(lambda a, **k: "")
    assert (info.value.tool, info.value.field, info.value.value) == ("pay", field, value)
    assert isinstance(info.value, ValueError)


def test_dedupes_by_key_and_its_receiver_name_are_one_declaration() -> None:
    def fn(a: dict[str, Any], *, idempotency_key: str) -> str:
        return ""

    old = runlog.tool("t", dedupes_by_key=True)(fn)
    new = runlog.tool("t", receiver="dedupes_by_key")(fn)
    both = runlog.tool("t", receiver="fenced", dedupes_by_key=True)(fn)
    assert old.guarantees == new.guarantees == {"dedupes_by_key"}
    assert old.dedupes_by_key and new.dedupes_by_key and both.dedupes_by_key
    assert both.guarantees == {"fenced", "dedupes_by_key"}
