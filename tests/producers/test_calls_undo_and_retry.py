"""The third answer to an uncertain call: "undo and retry", where the tool has an inverse.

The inverse of what may have happened runs as a call of its own (its own key), and only
once the log says it completed does the call run again, as a call of its own under a
fresh key (a receiver that deduplicates by key would otherwise hand back the undone
effect). An inverse that fails or is lost goes back to a person, as compensation does.
Offered by ``runlog.decide``, the CLI and the console only where the tool declared
``compensate=``; refused with ``NotUndoable`` elsewhere. The receiver is a real ledger
in Redis; the crash tests SIGKILL a real decider process at each point of the answer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_calls_compensation as wc
from workers.common import Ledger, valid_events, worker_env
from workers.undo_worker import Bookings

import runlog
from runlog._settings import Settings
from runlog.schemas import _models as m
from runlog.schemas._canonical import canonical_json

pytestmark = pytest.mark.timeout(90)

WORKER = Path(__file__).resolve().parents[1] / "workers" / "undo_worker.py"


def _cli(fast: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=worker_env(fast),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _one_booking_stands(
    fast: Settings, ledger: Ledger, rid: str, key: str
) -> tuple[str, list[m.Event]]:
    """The world and the log after "undo and retry" settled: the wrong booking undone, one
    new one under a fresh key, and the call closed with that booking's result. Returns the
    fresh key and the run's valid events."""
    events = valid_events(fast, rid)
    started = [p for ev in events if isinstance(p := ev.payload, m.ToolCallStarted)]
    fresh = {p.idempotency_key for p in started if p.name == "book"} - {key}
    assert len(fresh) == 1, started
    (new,) = fresh
    assert ledger.per_key() == {key: 0, new: 1}, "not exactly one booking stands"
    assert ledger.found(new) == canonical_json(wc.ARGS)
    done = {
        p.idempotency_key: p
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallCompleted) and p.idempotency_key is not None
    }
    assert done[key].content == done[new].content == "booked R-7"
    # The retry started only after the inverse's completion was in the log.
    seq = {
        (type(p).__name__, p.idempotency_key): ev.seq
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallStarted | m.ToolCallCompleted)
    }
    inverse = next(p.idempotency_key for p in started if p.name == "book/compensate")
    assert seq[("ToolCallCompleted", inverse)] < seq[("ToolCallStarted", new)]
    with runlog.open_run(rid, settings=fast, tools=Bookings(ledger, False).tools()) as run:
        assert key not in run.state.open_calls and new not in run.state.open_calls
        assert run.state.completed_calls[key] == "booked R-7"
    assert ledger.per_key() == {key: 0, new: 1}, "opening the run again changed the world"
    return new, events


def test_undo_and_retry_undoes_the_effect_then_makes_it_once_under_a_fresh_key(
    fast: Settings, ledger: Ledger
) -> None:
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    q = runlog.question(rid, esc.approval_id, settings=fast)
    assert q.undoable and q.undo_and_retry and "FRESH key" in q.undo_and_retry
    assert "Undo and retry" in q.undo_confirmation()
    got = runlog.decide(
        rid,
        esc.approval_id,
        approved=True,
        undo_and_retry=True,
        decided_by="ops",
        note="undo the 20 nights, book 2",
        tools=svc.tools(),
        settings=fast,
    )
    assert got == "recorded"
    assert len(svc.cancels) == 2 and svc.cancels[0][0] == svc.cancels[1][0]
    new, events = _one_booking_stands(fast, ledger, rid, key)
    assert svc.booked == [key, new]
    decided = [p for ev in events if isinstance(p := ev.payload, m.ApprovalDecided)]
    assert [(d.approved, d.answer) for d in decided] == [(True, m.UNDO_AND_RETRY)]
    q = runlog.question(rid, esc.approval_id, settings=fast)
    assert q.decided is not None and "undo and retry" in q.decided


def test_undo_and_retry_is_refused_where_it_cannot_be_answered(
    fast: Settings, ledger: Ledger
) -> None:
    """An irreversible tool has no inverse: the API raises ``NotUndoable`` and the CLI
    exits 1, and nothing is appended; "undo and retry" is an approval, never a rejection."""

    @runlog.tool(risk="irreversible")
    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, canonical_json(args))
        raise TimeoutError("the bank did not answer")

    with runlog.open_run(settings=fast, tools=[pay]) as run:
        with pytest.raises(runlog.Escalated) as esc:
            run.call_tool("pay", {"amount": 5})
        rid, seq = run.run_id, run.state.seq
    ap = esc.value.approval_id
    assert ap is not None
    assert not runlog.question(rid, ap, settings=fast).undoable
    with pytest.raises(runlog.NotUndoable):
        runlog.decide(rid, ap, approved=True, undo_and_retry=True, decided_by="ops", settings=fast)
    with pytest.raises(runlog.NotUndoable):
        runlog.decide(rid, ap, approved=False, undo_and_retry=True, decided_by="ops", settings=fast)
    done = _cli(fast, "approve", rid, ap, "--by", "ops", "--undo-and-retry")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not recorded" in done.stderr
    explained = _cli(fast, "explain", rid, ap)
    assert explained.returncode == 0 and "--undo-and-retry" not in explained.stdout
    _console_refuses_undo(fast, rid, ap)
    assert valid_events(fast, rid)[-1].seq == seq, "a refused answer appended something"


def _console_refuses_undo(fast: Settings, rid: str, ap: str) -> None:
    """The console offers no "undo and retry" button here, and a forged form asking for it
    gets a page in the console's layout that says why, with nothing recorded."""
    import re

    import httpx
    from ui_support import TOKEN_ADMIN, console, projecting, wait_for

    from runlog.log._clients import redis_client

    client = redis_client(fast)
    try:
        with projecting(fast, client), console(fast) as base:
            web = httpx.Client(base_url=base, follow_redirects=False, timeout=30)
            assert web.post("/login", data={"token": TOKEN_ADMIN}).status_code == 303

            def page() -> str | None:
                got = web.get(f"/runs/{rid}/approvals/{ap}")
                return got.text if got.status_code == 200 else None

            text = wait_for("the question", page)
            assert 'id="undo-and-retry"' not in text and 'id="undo-means"' not in text
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', text)
            assert csrf is not None
            form = {"decision": "undo_and_retry", "csrf": csrf.group(1), "confirm": "yes"}
            r = web.post(f"/runs/{rid}/approvals/{ap}", data=form)
            assert r.status_code == 409 and 'id="refused"' in r.text
            assert "declared no inverse" in r.text and "<header" in r.text  # its own layout
    finally:
        client.close()


def test_the_cli_offers_undo_and_retry_and_the_next_owner_with_the_tools_does_it(
    fast: Settings, ledger: Ledger
) -> None:
    """``runlog explain`` names the third answer; ``runlog approve --undo-and-retry`` records
    it without the tools, and the owner that next opens the run with them undoes and
    retries as recovery, before its caller can act."""
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    explained = _cli(fast, "explain", rid, esc.approval_id)
    assert explained.returncode == 0, explained.stderr
    assert "undo and retry = " in explained.stdout and "--undo-and-retry" in explained.stdout
    done = _cli(fast, "approve", rid, esc.approval_id, "--by", "ops", "--undo-and-retry")
    assert done.returncode == 0, done.stderr
    assert "recorded" in done.stdout
    assert ledger.per_key() == {key: 1}, "nothing can be undone without the tools"
    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        assert run.state.completed_calls[key] == "booked R-7"
    _one_booking_stands(fast, ledger, rid, key)


@pytest.mark.parametrize("kill_at", ["inverse", "retry"])
def test_a_decider_killed_during_undo_and_retry_leaves_one_effect(
    fast: Settings, ledger: Ledger, kill_at: str
) -> None:
    """SIGKILL of the process holding the run once the inverse's completion is durable
    (before the retry started), or inside the retry's tool after its effect was made: the
    next owner neither undoes twice nor books twice."""
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    worker = [sys.executable, str(WORKER), "--run-id", rid, "--approval-id", esc.approval_id]
    worker += ["--prefix", fast.redis_key_prefix, "--kill-at", kill_at]
    done = subprocess.run(worker, env=worker_env(fast), capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    booked = ledger.per_key()
    assert booked[key] == 0  # the inverse ran, and its completion is in the log
    assert sum(booked.values()) == (1 if kill_at == "retry" else 0)
    # The next owner (after the dead one's lease expired) finishes what was decided.
    tools = Bookings(ledger, kill_in_retry=False).tools()
    with runlog.open_run(rid, settings=fast, tools=tools, wait_s=10) as run:
        assert run.state.completed_calls[key] == "booked R-7"
    _one_booking_stands(fast, ledger, rid, key)


def test_undo_and_retry_whose_inverse_is_lost_retries_nothing_and_asks_again(
    fast: Settings, ledger: Ledger
) -> None:
    """The inverse's answer is lost: it is escalated as a call of its own, the original goes
    back to a person, and nothing is made again (no call under a fresh key)."""
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    svc.inverse = "timeout"  # the cancel takes effect, and its answer is lost
    runlog.decide(
        rid,
        esc.approval_id,
        approved=True,
        undo_and_retry=True,
        decided_by="ops",
        tools=svc.tools(),
        settings=fast,
    )
    assert svc.booked == [key], "retried although the undo is not known to have happened"
    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        original = run.state.open_calls[key]
        assert original.status == "escalated" and original.approval_id != esc.approval_id
        (inverse,) = [c for c in run.state.open_calls.values() if c.name == "book/compensate"]
        assert inverse.status == "escalated"
    assert svc.booked == [key] and len(svc.cancels) == 2


def test_undo_and_retry_queued_for_a_live_owner_is_carried_whole(
    fast: Settings, ledger: Ledger
) -> None:
    """While a worker holds the run the answer waits in its inbox; the owner records it as
    the decider signed it, answer included, and undoes and retries with its tools."""
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        got = runlog.decide(
            rid,
            esc.approval_id,
            approved=True,
            undo_and_retry=True,
            decided_by="ops",
            settings=fast,
            wait_s=0.5,
        )
        assert got == "queued" and ledger.per_key() == {key: 1}
        assert run.poll_decisions() == 1
        assert run.state.approvals[esc.approval_id].answer == m.UNDO_AND_RETRY
        assert run.state.completed_calls[key] == "booked R-7"
    _one_booking_stands(fast, ledger, rid, key)
