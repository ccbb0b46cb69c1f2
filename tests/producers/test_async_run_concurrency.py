"""Cancellation and concurrency on one run: a call cancelled before its tool was handed
the request is a proven non-effect recorded in the log; calls made at once on one run are
served one after another, each effect once.

Everything is read back from Kafka and from the receiver's ledger in Redis.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from workers.common import Ledger, assert_log_sound, payloads, read_log

import runlog
from runlog._settings import Settings
from runlog.producers import _async_run as async_run
from runlog.producers._writer import EventWriter
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(180)


def _pay(ledger: Ledger, *, applied: asyncio.Event | None = None) -> runlog.Tool:
    """An irreversible tool with no reconciler whose receiver does not deduplicate: every
    invocation is one more entry in the ledger, under the key it was sent. With
    ``applied``, it sets it once the effect happened and then never answers."""

    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        await asyncio.sleep(0.01)  # let other tasks run between the calls' steps
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        if applied is not None:
            applied.set()
            await asyncio.Event().wait()  # the effect happened; the answer never comes
        return f"paid {args['to']}"

    return runlog.tool("pay", risk="irreversible")(pay)


def _slow_started_barrier(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Every asyncio barrier waits ``delay_s`` before it waits for its acknowledgements
    (and follows: no inline serve), so a short timeout around a call lands inside the
    barrier of its STARTED, before the tool is handed the request."""
    monkeypatch.setattr(async_run, "INLINE_S", 0.0)
    original = async_run._acknowledged

    async def slow(*args: Any, **kw: Any) -> None:
        await asyncio.sleep(delay_s)
        await original(*args, **kw)

    monkeypatch.setattr(async_run, "_acknowledged", slow)


@pytest.mark.parametrize("retry_by", ["same_owner", "next_owner"])
def test_a_call_cancelled_in_its_started_barrier_runs_once_when_asked_again(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch, retry_by: str
) -> None:
    """wait_for times out while the irreversible call's STARTED is being made durable: the
    tool was never handed the request, the log says so, and asking again (in the same
    process, or as the next owner reading only the log) runs it exactly once."""
    tools = [_pay(ledger)]

    async def main() -> tuple[str, str | None]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            key = run.key_for("pay", {"to": "bob"})
            _slow_started_barrier(monkeypatch, 0.5)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(run.call_tool("pay", {"to": "bob"}), timeout=0.05)
            assert ledger.total() == 0
            assert run.key_for("pay", {"to": "bob"}) == key, "asking again must reuse the key"
            if retry_by == "same_owner":
                paid = await run.call_tool("pay", {"to": "bob"})
                await run.finish("succeeded")
                return run.run_id, paid
            return run.run_id, None

    run_id, paid = asyncio.run(main())
    monkeypatch.undo()
    if paid is None:

        async def resume() -> str:
            async with runlog.aio.open_run(run_id, tools=tools, settings=fast) as run:
                assert run.state.status == "running" and not run.state.open_calls
                paid = await run.call_tool("pay", {"to": "bob"})
                await run.finish("succeeded")
                return paid

        paid = asyncio.run(resume())
    assert paid == "paid bob"
    assert list(ledger.per_key().values()) == [1], "the tool must run exactly once"
    events = [rec.event for rec in read_log(fast, run_id)]
    state = assert_log_sound(events)
    assert state.status == "finished" and not state.open_calls
    assert payloads(events, EventType.APPROVAL_REQUESTED) == [], "escalated a proven non-effect"
    assert payloads(events, EventType.TOOL_CALL_UNCERTAIN) == []
    done = payloads(events, EventType.TOOL_CALL_COMPLETED)
    # The cancelled attempt is closed as a proven non-effect (no key: it may run again).
    assert [(c.is_error, c.idempotency_key is None) for c in done] == [
        (True, True),
        (False, False),
    ]
    started = payloads(events, EventType.TOOL_CALL_STARTED)
    assert [s.idempotency_key for s in started] == [done[1].idempotency_key] * 2
    assert done[0].started_seq != done[1].started_seq


def test_a_retry_cancelled_before_its_tool_ran_keeps_the_call_uncertain(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only this attempt is proven not to have run: a retry (attempt 2) whose first attempt's
    outcome was lost, cancelled in its STARTED barrier, leaves the call uncertain (never
    closed as a failure) and the recovery rules go on with attempt 3."""
    first = [True]

    async def ship(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        if first[0]:
            first[0] = False
            raise TimeoutError("carrier timed out after accepting")
        return "shipped"

    tools = [runlog.tool("ship", risk="reversible")(ship)]  # no lookup: retried by risk
    monkeypatch.setattr(async_run, "INLINE_S", 0.0)
    original = async_run._acknowledged
    runs: list[runlog.aio.AsyncRun] = []
    in_barrier = asyncio.Event()

    async def slow_on_attempt_2(*args: Any, **kw: Any) -> None:
        calls = runs[0].state.open_calls.values() if runs else []
        if any(c.attempt == 2 and c.status == "started" for c in calls):
            in_barrier.set()
            await asyncio.sleep(30)  # cancelled here
        await original(*args, **kw)

    monkeypatch.setattr(async_run, "_acknowledged", slow_on_attempt_2)

    async def main() -> str:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            runs.append(run)
            calling = asyncio.create_task(run.call_tool("ship", {"to": "bob"}))
            await in_barrier.wait()
            calling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await calling
            (call,) = run.state.open_calls.values()
            assert call.attempt == 2 and call.status == "uncertain"
            assert await run.call_tool("ship", {"to": "bob"}) == "shipped"
            await run.finish("succeeded")
            return run.run_id

    run_id = asyncio.run(main())
    assert list(ledger.per_key().values()) == [2]  # attempts 1 and 3; attempt 2 never ran
    events = [rec.event for rec in read_log(fast, run_id)]
    assert assert_log_sound(events).status == "finished"
    assert [s.attempt for s in payloads(events, EventType.TOOL_CALL_STARTED)] == [1, 2, 3]
    done = payloads(events, EventType.TOOL_CALL_COMPLETED)
    assert [c.is_error for c in done] == [False], "an unknown outcome was closed as failed"


def test_a_call_cancelled_after_its_tool_was_invoked_stays_uncertain(
    fast: Settings, ledger: Ledger
) -> None:
    """The cancel lands while the tool runs (its effect happened, its answer is slow):
    nothing proves a non-effect, so the call stays uncertain and the recovery rules for an
    irreversible tool without a lookup ask a person; it is never run again on its own."""

    async def main() -> str:
        applied = asyncio.Event()
        async with runlog.aio.open_run(tools=[_pay(ledger, applied=applied)], settings=fast) as run:
            calling = asyncio.create_task(run.call_tool("pay", {"to": "bob"}))
            await applied.wait()
            calling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await calling
            assert ledger.total() == 1
            with pytest.raises(runlog.Escalated):
                await run.call_tool("pay", {"to": "bob"})
            return run.run_id

    run_id = asyncio.run(main())
    tools = [_pay(ledger)]

    async def resume() -> None:
        async with runlog.aio.open_run(run_id, tools=tools, settings=fast) as run:
            assert run.state.status == "running"
            with pytest.raises(runlog.Escalated):
                await run.call_tool("pay", {"to": "bob"})

    asyncio.run(resume())
    assert list(ledger.per_key().values()) == [1], "an uncertain effect ran again"
    events = [rec.event for rec in read_log(fast, run_id)]
    state = assert_log_sound(events)
    assert len(state.open_calls) == 1 and not state.completed_calls
    assert [c.status for c in state.open_calls.values()] == ["escalated"]
    assert len(payloads(events, EventType.APPROVAL_REQUESTED)) == 1
    assert payloads(events, EventType.TOOL_CALL_COMPLETED) == []
    # The live writer saw the interruption and said so; no owner "stopped first".
    assert [u.detected_by for u in payloads(events, EventType.TOOL_CALL_UNCERTAIN)] == ["live"]


def test_a_cancelled_call_whose_sync_tool_still_runs_holds_the_run_until_it_ends(
    fast: Settings, ledger: Ledger
) -> None:
    """A plain-function tool runs in a worker thread, which a cancellation cannot stop:
    its request is still in flight and can still take effect. Asking again at once must
    not let a lookup find it absent and run it a second time: the run's next step waits
    for the thread, and the lookup then finds the effect."""
    entered, go = threading.Event(), threading.Event()

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        entered.set()
        go.wait(30)  # the receiver is slow to commit
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return f"paid {args['to']}"

    def check(args: dict[str, Any], *, idempotency_key: str) -> Any:
        if ledger.found(idempotency_key) is None:
            return runlog.Absent("no such payment")
        return runlog.Match(f"paid {args['to']}")

    tools = [runlog.tool("pay", risk="irreversible", reconcile=check, receiver="fenced")(pay)]

    async def main() -> tuple[str, str]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            calling = asyncio.create_task(run.call_tool("pay", {"to": "bob"}))
            await asyncio.to_thread(entered.wait, 30)
            calling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await calling
            asyncio.get_running_loop().call_later(0.5, go.set)
            paid = await run.call_tool("pay", {"to": "bob"})
            await run.finish("succeeded")
            return run.run_id, paid

    run_id, paid = asyncio.run(main())
    assert paid == "paid bob"
    assert list(ledger.per_key().values()) == [1], "the lookup raced the first request"
    events = [rec.event for rec in read_log(fast, run_id)]
    assert assert_log_sound(events).status == "finished"
    assert [c.source for c in payloads(events, EventType.TOOL_CALL_COMPLETED)] == ["reconciliation"]


def test_a_sync_call_interrupted_in_its_started_barrier_runs_once_when_asked_again(
    fast: Settings, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule on the sync path: ^C lands while the STARTED's barrier waits (before
    the wait, so its acknowledgement is left to the next barrier); the tool never ran,
    the log says so, and the next owner runs it once."""

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return f"paid {args['to']}"

    tools = [runlog.tool("pay", risk="irreversible")(pay)]
    original = EventWriter.wait
    armed = [True]

    def interrupted(self: EventWriter, *args: Any, **kw: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        original(self, *args, **kw)

    with runlog.open_run(tools=tools, settings=fast) as run:
        monkeypatch.setattr(EventWriter, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run.call_tool("pay", {"to": "bob"})
        assert ledger.total() == 0
        run_id = run.run_id
    with runlog.open_run(run_id, tools=tools, settings=fast) as again:
        assert not again.state.open_calls and again.state.status == "running"
        assert again.call_tool("pay", {"to": "bob"}) == "paid bob"
        again.finish("succeeded")
    assert list(ledger.per_key().values()) == [1]
    events = [rec.event for rec in read_log(fast, run_id)]
    assert assert_log_sound(events).status == "finished"
    assert payloads(events, EventType.APPROVAL_REQUESTED) == []


N_AT_ONCE = 6


def _assert_each_once(fast: Settings, ledger: Ledger, run_id: str, results: list[str]) -> None:
    assert results == [f"paid p{i}" for i in range(N_AT_ONCE)]
    counts = ledger.per_key()
    assert len(counts) == N_AT_ONCE and set(counts.values()) == {1}
    events = [rec.event for rec in read_log(fast, run_id)]
    state = assert_log_sound(events)
    assert sorted(state.completed_calls) == sorted(counts)
    assert not state.open_calls and state.status == "running"
    assert payloads(events, EventType.APPROVAL_REQUESTED) == []


def test_calls_made_at_once_on_one_async_run_each_take_effect_once(
    fast: Settings, ledger: Ledger
) -> None:
    """asyncio.gather over six irreversible calls on one run: six effects, six completions,
    the run goes on; its next owner finds nothing open and repeats nothing."""
    tools = [_pay(ledger)]

    async def main() -> tuple[str, list[str]]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            results = await asyncio.gather(
                *(run.call_tool("pay", {"to": f"p{i}"}) for i in range(N_AT_ONCE))
            )
            await run.append(EventType.USER_MESSAGE, content="and then?")  # the run goes on
            return run.run_id, list(results)

    run_id, results = asyncio.run(main())
    _assert_each_once(fast, ledger, run_id, results)

    async def resume() -> list[str]:
        async with runlog.aio.open_run(run_id, tools=tools, settings=fast) as run:
            assert not run.state.open_calls and run.state.status == "running"
            again = [await run.call_tool("pay", {"to": f"p{i}"}) for i in range(N_AT_ONCE)]
            await run.finish("succeeded")
            return again

    assert asyncio.run(resume()) == results  # the stored results, not new effects
    assert set(ledger.per_key().values()) == {1}


def test_calls_made_at_once_on_one_sync_run_from_threads_each_take_effect_once(
    fast: Settings, ledger: Ledger
) -> None:
    """The same rule for the sync ``Run``: six threads released at once from a barrier."""

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return f"paid {args['to']}"

    tools = [runlog.tool("pay", risk="irreversible")(pay)]
    results: list[str | BaseException] = [""] * N_AT_ONCE
    gate = threading.Barrier(N_AT_ONCE)

    with runlog.open_run(tools=tools, settings=fast) as run:

        def one(i: int) -> None:
            gate.wait()
            try:
                results[i] = run.call_tool("pay", {"to": f"p{i}"})
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(N_AT_ONCE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        run.append(EventType.USER_MESSAGE, content="and then?")
        run_id = run.run_id
    _assert_each_once(fast, ledger, run_id, [str(r) for r in results])

    with runlog.open_run(run_id, tools=tools, settings=fast) as again:
        assert not again.state.open_calls
        assert [again.call_tool("pay", {"to": f"p{i}"}) for i in range(N_AT_ONCE)] == results
        again.finish("succeeded")
    assert set(ledger.per_key().values()) == {1}
