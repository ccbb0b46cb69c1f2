"""A worker paused (SIGSTOP) inside an irreversible call with a lookup, its run taken over
and the call reconciled, then woken (SIGCONT): its request, still in flight, must not make
the effect a second time.

A lookup proves a request absent *now*. Only the receiver can prove it will never land:
these tests pause the owner while its request is held before the receiver commits it,
and count the effects the receiver (``workers.common.Ledger``, in Redis, outside every
worker process) applied per key once the paused request went on.
"""

from __future__ import annotations

import signal
from pathlib import Path

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

from runlog.schemas import models as m
from runlog.schemas.keys import new_run_id
from runlog.schemas.vocabulary import EventType
from runlog.settings import Settings

pytestmark = pytest.mark.timeout(120)


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
        new = start_worker(fast, tmp, "new", "--run-id", rid, "--reconcile", "ledger", *receiver)
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
