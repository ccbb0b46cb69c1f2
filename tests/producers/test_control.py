"""Cancel and terminate on the real stack, with real worker processes.

Effects are counted outside every process, in the ledger (Redis, keyed by idempotency
key). A cancellation is recorded in the log and seen by the owner at its next step; a
termination fences the owner (a higher epoch) and leaves its open calls open.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from workers.common import (
    EXIT_FENCED,
    Ledger,
    assert_log_sound,
    read_log,
    start_worker,
    verdicts,
)

import runlog
from runlog._settings import Settings
from runlog.consumers._verify import verify_events
from runlog.producers import _timers as timers
from runlog.producers._engine import CANCEL_FLAG_FRESH_S
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(180)

CONTROL = Path(__file__).resolve().parents[1] / "workers" / "control_worker.py"
EXIT_CANCELLED = 9


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from runlog.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _show(capsys: pytest.CaptureFixture[str], run_id: str, tenant: str = "acme") -> Any:
    rc, out, err = _cli(capsys, "show", run_id, "--tenant", tenant, "--json")
    assert rc == 0, err
    return json.loads(out)


def _events(s: Settings, run_id: str) -> list[Any]:
    events = [r.event for r in read_log(s, run_id)]
    assert_log_sound(events)
    checks = verify_events(events)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    return events


def _valid(events: list[Any]) -> list[Any]:
    return [ev for ev, ok in verdicts(events) if ok]


def _env(monkeypatch: pytest.MonkeyPatch, s: Settings) -> None:
    from projections_support import env_for

    for k, v in env_for(s).items():
        monkeypatch.setenv(k, v)


def _worker(s: Settings, tmp: Path, name: str, run_id: str, *args: str) -> Any:
    return start_worker(s, tmp, name, "--run-id", run_id, *args, script=CONTROL)


def _charge_keys(events: list[Any]) -> dict[str, str]:
    """amount -> idempotency key of each charge STARTED (valid or not)."""
    out: dict[str, str] = {}
    for ev in events:
        if ev.type is EventType.TOOL_CALL_STARTED:
            out[json.loads(ev.payload.args_json)["amount"].__str__()] = ev.payload.idempotency_key
    return out


def test_cancel_during_an_irreversible_call_ends_cancelled_after_its_one_effect(
    fast: Settings,
    ledger: Ledger,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner is inside an irreversible call when a person cancels: the call completes
    (its one effect recorded), the owner sees the request before its next call, the agent
    cleans up, and the run ends cancelled: no further effect, no call silently closed."""
    _env(monkeypatch, fast)
    rid = "r-cancel-in-call"
    w = _worker(
        fast, tmp_path, "w", rid, "--steps", "4", "--hold-at", "1", "--hold", "in-tool", "--cleanup"
    )
    w.wait_flag("in-tool")
    # The owner holds the run: the request waits in its inbox.
    how = runlog.cancel(
        rid, reason="customer withdrew", by="ann", tenant="acme", settings=fast, wait_s=0
    )
    assert how == "queued"
    assert _show(capsys, rid)["status"] == "running"  # not in the log yet: the owner has it
    w.go()
    code, result = w.finish()
    assert code == EXIT_CANCELLED, result
    assert json.loads(w.flag("cancelled").read_text()) == {
        "by": "ann",
        "reason": "customer withdrew",
    }
    events = _events(fast, rid)
    valid = _valid(events)
    keys = _charge_keys(events)
    # The call under way when the request came: exactly one effect, completed live.
    assert ledger.count(keys["1"]) == 1
    completed = [
        ev.payload.idempotency_key for ev in valid if ev.type is EventType.TOOL_CALL_COMPLETED
    ]
    assert keys["1"] in completed
    # No call after it but the agent's clean-up, which ran after Cancelled was raised.
    assert "2" not in keys and "3" not in keys
    assert ledger.count(keys["cleanup"]) == 1
    asked = [ev for ev in valid if ev.type is EventType.RUN_CANCEL_REQUESTED]
    assert len(asked) == 1
    assert (asked[0].payload.requested_by, asked[0].payload.reason) == ("ann", "customer withdrew")
    assert valid[-1].type is EventType.RUN_FINISHED and valid[-1].payload.outcome == "cancelled"
    shown = _show(capsys, rid)
    assert shown["status"] == "cancelled" and shown["left_open"] == []
    assert shown["cancel"]["requested_by"] == "ann" and shown["resumptions"] == 0
    assert ledger.total() == 3  # charges 0 and 1, and the clean-up


def test_cancel_of_an_unowned_run_is_recorded_and_ends_it_when_next_opened(
    fast: Settings,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _env(monkeypatch, fast)
    calls: list[str] = []

    @runlog.tool("note", risk="safe")
    def note(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        return "noted"

    with runlog.open_run("r-unowned", tenant="acme", tools=[note], settings=fast) as run:
        run.call_tool("note", {"n": 1})
    assert _show(capsys, "r-unowned")["status"] == "orphaned"
    rc, out, err = _cli(
        capsys, "cancel", "r-unowned", "--tenant", "acme", "--reason", "wrong", "--by", "bob"
    )
    assert rc == 0, err and "recorded" in out
    shown = _show(capsys, "r-unowned")
    # Cancelling until someone opens it; taking it to record the request is not a resumption.
    assert shown["status"] == "cancelling" and shown["resumptions"] == 0
    assert shown["cancel"]["requested_by"] == "bob" and shown["cancel"]["reason"] == "wrong"
    assert (
        runlog.cancel("r-unowned", reason="again", by="cy", tenant="acme", settings=fast)
        == "already"
    )

    with runlog.open_run("r-unowned", tenant="acme", tools=[note], settings=fast) as run:
        with pytest.raises(runlog.Cancelled) as raised:
            run.call_tool("note", {"n": 2})
        assert raised.value.requested_by == "bob"
        run.call_tool("note", {"n": "cleanup"})  # the agent's clean-up runs after it
    assert len(calls) == 2  # n=1 and the clean-up; n=2 never reached the tool
    shown = _show(capsys, "r-unowned")
    assert shown["status"] == "cancelled" and shown["outcome"] == "cancelled"
    assert shown["resumptions"] == 1  # the run's own reopening, not the operator's
    _events(fast, "r-unowned")
    rc, _, err = _cli(
        capsys, "cancel", "r-unowned", "--tenant", "acme", "--reason", "late", "--by", "bob"
    )
    assert rc == 1 and "already ended" in err


@pytest.mark.parametrize("where", ["between", "in-tool"])
def test_terminate_fences_a_sigstopped_owner(
    where: str,
    fast: Settings,
    ledger: Ledger,
    redis_client: redis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGSTOP the owner (between two calls, or inside a call before its effect), terminate
    the run, SIGCONT the owner: its next append is fenced and the receiver sees no effect
    it was not already handed; the call open at the termination is listed, still open."""
    _env(monkeypatch, fast)
    rid = f"r-term-{where}"
    w = _worker(fast, tmp_path, "w", rid, "--steps", "4", "--hold-at", "1", "--hold", where)
    held = w.wait_flag(where)
    w.kill(signal.SIGSTOP)
    try:
        rc, out, err = _cli(
            capsys,
            "terminate",
            rid,
            "--tenant",
            "acme",
            "--reason",
            "runaway",
            "--by",
            "ops",
            "--json",
        )
        assert rc == 0, err
        done = json.loads(out)
        opened = json.loads(w.flag("opened").read_text())
        assert done["status"] == "terminated" and done["epoch"] > opened["epoch"]
        left = [c["idempotency_key"] for c in done["open_calls"]]
        assert left == ([held] if where == "in-tool" else [])
    finally:
        w.kill(signal.SIGCONT)
    w.go()
    code, result = w.finish()
    assert code == EXIT_FENCED, result
    events = _events(fast, rid)
    valid = _valid(events)
    assert valid[-1].type is EventType.RUN_FINISHED and valid[-1].payload.outcome == "terminated"
    keys = _charge_keys(events)
    # Only what the owner was handed before the stop took effect, once; nothing after it.
    assert ledger.count(keys["0"]) == 1
    assert "2" not in keys and "3" not in keys
    if where == "in-tool":
        assert ledger.count(held) == 1  # it was inside the tool: the receiver got it once
    else:
        assert "1" not in keys or ledger.count(keys["1"]) == 0
    assert ledger.total() == (2 if where == "in-tool" else 1)
    # Everything the woken owner appended after the takeover is fenced in the log.
    finish_at = next(i for i, ev in enumerate(events) if ev is valid[-1])
    late = events[finish_at + 1 :]
    assert all(not ok for ev, ok in verdicts(events)[finish_at + 1 :]) and all(
        ev.epoch == opened["epoch"] for ev in late
    )
    shown = _show(capsys, rid)
    assert shown["status"] == "terminated"
    assert [c["idempotency_key"] for c in shown["left_open"]] == left
    rc, text, err = _cli(capsys, "show", rid, "--tenant", "acme")
    assert rc == 0 and "status terminated" in text and "terminated by ops: runaway" in text
    assert ("open calls left for reconciliation" in text) == bool(left)
    assert all(key in text for key in left)
    if left:
        # The console lists them too, on the run's page.
        import httpx
        from ui_support import TOKEN_A, console, projecting, wait_for

        with projecting(fast, redis_client), console(fast) as base:
            web = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN_A}"})
            page = wait_for(
                "the run page", lambda: (r := web.get(f"/runs/{rid}")).status_code == 200 and r
            )
            assert 'id="left-open"' in page.text and left[0] in page.text
    assert shown["resumptions"] == 0  # the terminating takeover is an operator's act


def test_a_cancel_and_a_terminate_racing_end_the_run_one_way(
    fast: Settings,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Released from a barrier on the same run, again and again: the log ends with one
    valid RUN_FINISHED, terminated; the cancel is recorded before it or refused."""
    _env(monkeypatch, fast)
    for i in range(6):
        rid = f"r-race-{i}"
        with runlog.open_run(rid, tenant="acme", settings=fast) as run:
            run.append("user_message", content="go")
        barrier = threading.Barrier(2)
        outcome: dict[str, Any] = {}

        def cancel(
            rid: str = rid, outcome: dict[str, Any] = outcome, barrier: Any = barrier
        ) -> None:
            barrier.wait()
            try:
                outcome["cancel"] = runlog.cancel(
                    rid, reason="stop", by="ann", tenant="acme", settings=fast, wait_s=3
                )
            except runlog.RunFinished:
                outcome["cancel"] = "ended"

        def terminate(
            rid: str = rid, outcome: dict[str, Any] = outcome, barrier: Any = barrier
        ) -> None:
            barrier.wait()
            try:
                outcome["terminate"] = runlog.terminate(
                    rid, reason="kill", by="ops", tenant="acme", settings=fast
                ).epoch
            except runlog.RunFinished:
                outcome["terminate"] = "ended"

        threads = [threading.Thread(target=cancel), threading.Thread(target=terminate)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert isinstance(outcome["terminate"], int), outcome  # nothing else ends the run
        assert outcome["cancel"] in ("recorded", "queued", "already", "ended"), outcome
        events = _events(fast, rid)
        valid = _valid(events)
        finished = [ev for ev in valid if ev.type is EventType.RUN_FINISHED]
        assert len(finished) == 1 and finished[0].payload.outcome == "terminated"
        assert valid[-1] is finished[0]
        shown = _show(capsys, rid)
        assert shown["status"] == "terminated" and shown["resumptions"] == 0
        asked = [ev for ev in valid if ev.type is EventType.RUN_CANCEL_REQUESTED]
        assert len(asked) <= 1
        if outcome["cancel"] == "recorded":
            assert len(asked) == 1


def test_every_status_is_told_the_same_by_runs_show_state_and_the_console(
    test_settings: Settings,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One run in each status of the vocabulary; ``runs --json``, ``show --json``,
    ``state --json`` and the console's run page say the same status for each."""
    import re

    import httpx
    from ui_support import TOKEN_A, console, wait_for
    from workers.common import services_for

    from runlog.consumers.runner import ProjectionRunner

    s = test_settings
    _env(monkeypatch, s)
    runs: dict[str, str] = {}
    with services_for(s):

        def opened(name: str) -> runlog.Run:
            run = runlog.open_run(f"r-st-{name}", tenant="acme", settings=s)
            run.append("user_message", content=name)
            runs[name] = run.run_id
            return run

        held = opened("running")  # held to the end: its lease is live
        try:
            with opened("waiting") as run:
                run.request_approval("refund?")
            opened("orphaned").close()
            with opened("sleeping") as run:  # a durable timer due in an hour, not yet due
                run.append(EventType.TIMER_STARTED, timers.payload(0, 3600, timers.SLEEP))
                due = run.state.timers[0].due_at
            opened("cancelling").close()
            runlog.cancel(runs["cancelling"], reason="r", by="ann", tenant="acme", settings=s)
            opened("finished").finish("succeeded")
            opened("failed").finish("failed", "boom")
            opened("cancelled").close()
            runlog.cancel(runs["cancelled"], reason="r", by="ann", tenant="acme", settings=s)
            with (
                runlog.open_run(runs["cancelled"], tenant="acme", settings=s) as run,
                pytest.raises(runlog.Cancelled),
            ):
                run.check_cancelled()
            opened("terminated").close()
            runlog.terminate(runs["terminated"], reason="r", by="ops", tenant="acme", settings=s)
            ProjectionRunner(s, redis_client, ("state",)).catch_up(timeout_s=60)

            rc, out, err = _cli(capsys, "runs", "--json", "--tenant", "acme")
            assert rc == 0, err
            listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
            with console(s) as base:
                web = httpx.Client(
                    base_url=base, headers={"Authorization": f"Bearer {TOKEN_A}"}, timeout=30
                )
                for name, rid in runs.items():
                    shown = _show(capsys, rid)
                    rc, out, err = _cli(capsys, "state", rid, "--tenant", "acme", "--json")
                    assert rc == 0, err
                    page = wait_for("the run page", lambda rid=rid: web.get(f"/runs/{rid}"))
                    found = re.search(r'id="status">([a-z]+)<', page.text)
                    told = {
                        "runs": listed[rid]["status"],
                        "show": shown["status"],
                        "state": json.loads(out)["status"],
                        "console": found.group(1) if found else None,
                    }
                    expected = {"sleeping": "waiting"}.get(name, name)
                    assert set(told.values()) == {expected}, (name, told)
                    waits = {
                        "runs": listed[rid]["waiting_for"],
                        "show": shown["waiting_for"],
                        "state": json.loads(out)["waiting_for"],
                    }
                    if name == "sleeping":
                        # waiting until the due time, told the same everywhere
                        assert set(waits.values()) == {"time"}, waits
                        untils = {listed[rid]["until"], shown["until"], json.loads(out)["until"]}
                        assert untils == {due.isoformat()}, untils
                        rc, text, err = _cli(capsys, "state", rid, "--tenant", "acme")
                        assert f"waiting until {due.isoformat(timespec='seconds')}" in text
                        assert due.isoformat(timespec="seconds") in page.text
                    if name == "waiting":
                        assert set(waits.values()) == {"person"}, waits
                    if name == "running":
                        assert listed[rid]["owner"] == shown["owner"] is not None
                    if name in ("orphaned", "cancelling"):
                        assert shown["since"] and listed[rid]["since"]
        finally:
            held.close()


def test_cancel_during_a_call_that_turns_uncertain_leaves_it_to_the_recovery_rules(
    fast: Settings,
    ledger: Ledger,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver applies the effect, then the answer is lost (a timeout), while a person
    cancels: the call is uncertain, and without evidence an irreversible call waits for a
    person; the run ends cancelled with the call still open, honest, listed, never closed."""
    from runlog.consumers import _queries as queries
    from runlog.consumers.runner import ProjectionRunner

    _env(monkeypatch, fast)
    asked: list[str] = []

    @runlog.tool("wire", risk="irreversible")
    def wire(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args))
        # A person cancels while the receiver has it; the owner holds the run: queued.
        asked.append(
            runlog.cancel(
                "r-uncertain", reason="stop", by="ann", tenant="acme", settings=fast, wait_s=0
            )
        )
        raise TimeoutError("no answer after the request was sent")

    with runlog.open_run("r-uncertain", tenant="acme", tools=[wire], settings=fast) as run:
        with pytest.raises(runlog.Escalated):
            run.call_tool("wire", {"eur": 5})
        key = next(iter(run.state.open_calls))
        with pytest.raises(runlog.Cancelled):
            run.call_tool("wire", {"eur": 6})
    assert asked == ["queued"]
    assert ledger.per_key() == {key: 1}  # one effect, and the second call never ran
    shown = _show(capsys, "r-uncertain")
    assert shown["status"] == "cancelled"
    (left,) = shown["left_open"]
    assert left["idempotency_key"] == key and left["status"] == "escalated"
    valid = _valid(_events(fast, "r-uncertain"))
    closed = [ev for ev in valid if ev.type is EventType.TOOL_CALL_COMPLETED]
    assert closed == []  # nothing closed the call without evidence or a person
    ProjectionRunner(fast, redis_client, ("uncertain",)).catch_up(timeout_s=60)
    queue = queries.uncertain_report(redis_client, fast).open
    assert [c["idempotency_key"] for c in queue] == [key]  # still in the queue


def test_an_awaiting_async_run_sees_a_cancel_at_its_next_await(
    fast: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(monkeypatch, fast)
    calls: list[int] = []

    @runlog.tool("step", risk="safe")
    async def step(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(int(args["n"]))
        return "ok"

    async def main() -> str:
        async with runlog.aio.open_run(
            "r-async", tenant="acme", tools=[step], settings=fast
        ) as run:
            await run.call_tool("step", {"n": 1})
            how = await runlog.aio.cancel(
                "r-async", reason="enough", by="ann", tenant="acme", settings=fast, wait_s=0
            )
            # A step that begins a window after the request sees it (an earlier one may use
            # a read of the window before it).
            await asyncio.sleep(CANCEL_FLAG_FRESH_S)
            try:
                await run.call_tool("step", {"n": 2})
            except runlog.Cancelled as exc:
                await run.call_tool("step", {"n": 3})  # clean-up
                return f"{how}: {exc.requested_by}"
        return "not cancelled"

    assert asyncio.run(main()) == "queued: ann"
    assert calls == [1, 3]
    shown = _show(capsys, "r-async")
    assert shown["status"] == "cancelled" and shown["cancel"]["reason"] == "enough"
