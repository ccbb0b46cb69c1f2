"""``runlog.aio``: the asyncio API on the same rules as the sync one.

Hundreds of runs in one event loop with async tools, none of the loop's time spent in a
blocking Kafka or Redis call; the recovery table driven by ``await`` (an async reconciler
settling an uncertain call); a person's rejection through ``runlog.aio.decide``; runs
handed between the sync and the async API; fencing of an async owner taken over.
Everything is read back from Kafka and the ledger in Redis, never from the writer.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from workers.common import Ledger, assert_log_sound, payloads, read_log

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._clients import async_redis_client
from runlog.log._reader import LogReader
from runlog.producers._async_run import open_async
from runlog.producers._engine import Engine
from runlog.producers._handle import engine_of
from runlog.producers._lease import LeaseManager
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def loop_thread_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of blocking Kafka/Redis calls made in the thread that runs the event loop."""
    seen: list[str] = []
    loop_threads: set[int] = set()
    blocking = [
        (Engine, "barrier"),
        (Engine, "confirm_in_log"),
        (Engine, "since_last_turn"),
        (LeaseManager, "current"),
        (LeaseManager, "try_acquire"),
        (LogReader, "read"),
    ]
    for owner, name in blocking:
        original = getattr(owner, name)

        def spy(*args: Any, _orig: Any = original, _name: str = name, **kw: Any) -> Any:
            if threading.get_ident() in loop_threads:
                seen.append(_name)
            return _orig(*args, **kw)

        monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(
        asyncio.BaseEventLoop,
        "run_forever",
        _registering(asyncio.BaseEventLoop.run_forever, loop_threads),
    )
    yield seen


def _registering(run_forever: Any, threads: set[int]) -> Any:
    def wrapper(self: asyncio.BaseEventLoop) -> None:
        threads.add(threading.get_ident())
        try:
            run_forever(self)
        finally:
            threads.discard(threading.get_ident())

    return wrapper


def _tools(ledger: Ledger, *, fail_first_pay: bool = False) -> list[runlog.Tool]:
    failed: set[str] = set()

    async def lookup(args: dict[str, Any], *, idempotency_key: str) -> str:
        await asyncio.sleep(0)
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        return f"page {args['i']}"

    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        await asyncio.sleep(0)
        ctx = runlog.current_call()
        assert ctx is not None and ctx.idempotency_key == idempotency_key and ctx.epoch >= 1
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        if fail_first_pay and idempotency_key not in failed:
            failed.add(idempotency_key)
            raise TimeoutError("gateway timed out after accepting")
        return f"paid {args['i']}"

    async def check(args: dict[str, Any], *, idempotency_key: str) -> Any:
        await asyncio.sleep(0)
        if ledger.found(idempotency_key) is None:
            return runlog.Absent("no such payment")
        return runlog.Match(f"paid {args['i']}")

    return [
        runlog.tool("lookup")(lookup),
        runlog.tool("pay", risk="irreversible", reconcile=check, receiver="fenced")(pay),
    ]


def test_hundreds_of_runs_in_one_event_loop_never_block_it(
    steady: Settings, ledger: Ledger, loop_thread_calls: list[str]
) -> None:
    tools = _tools(ledger)
    n = 200

    async def one(i: int) -> tuple[str, str, str]:
        async with runlog.aio.open_run(
            f"aio-{i}-{uuid.uuid4().hex[:6]}", tools=tools, settings=steady
        ) as run:
            page = await run.call_tool("lookup", {"i": i})
            paid = await run.call_tool("pay", {"i": i})
            await run.finish("succeeded")
            return run.run_id, page, paid

    async def main() -> list[tuple[str, str, str]]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    done = asyncio.run(main())
    assert [(p, q) for _, p, q in done] == [(f"page {i}", f"paid {i}") for i in range(n)]
    assert loop_thread_calls == [], f"blocking calls in the loop's thread: {set(loop_thread_calls)}"
    counts = ledger.per_key()
    assert len(counts) == 2 * n and set(counts.values()) == {1}
    for run_id, _, _ in done[:: n // 8]:
        events = [rec.event for rec in read_log(steady, run_id)]
        state = assert_log_sound(events)
        assert state.status == "finished" and not state.open_calls
        assert len(state.completed_calls) == 2


def test_a_lease_whose_renewal_is_late_is_confirmed_without_blocking_the_loop(
    fast: Settings, ledger: Ledger, loop_thread_calls: list[str]
) -> None:
    """A busy process renews late: the lease's local validity runs out, and the next append
    must ask Redis first (``Run._guard``). In an event loop that question is awaited."""
    tools = _tools(ledger)

    async def main() -> tuple[str, str, int]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            lease = engine_of(run).lease
            lease.valid_until = 0.0  # as if every renewal had been late
            paid = await run.call_tool("pay", {"i": 7})
            lease.valid_until = 0.0
            await run.append(EventType.USER_MESSAGE, content="still mine")
            await run.finish("succeeded")
            return run.run_id, paid, engine_of(run).epoch

    run_id, paid, epoch = asyncio.run(main())
    assert paid == "paid 7"
    assert loop_thread_calls == [], f"blocking calls in the loop's thread: {set(loop_thread_calls)}"
    state = assert_log_sound([rec.event for rec in read_log(fast, run_id)])
    assert state.status == "finished" and state.epoch == epoch
    assert list(ledger.per_key().values()) == [1]


def test_a_lost_lease_found_by_the_awaited_check_fences_the_append(
    fast: Settings, ledger: Ledger, redis_client: Any
) -> None:
    tools = _tools(ledger)

    async def main() -> str:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            lease = engine_of(run).lease
            redis_client.delete(engine_of(run).deps.leases.lease_key(run.tenant, run.run_id))
            lease.valid_until = 0.0
            with pytest.raises(runlog.Fenced):
                await run.call_tool("pay", {"i": 8})
            return run.run_id

    asyncio.run(main())
    assert ledger.per_key() == {}, "a fenced owner ran the tool"


def test_an_async_reconciler_settles_an_uncertain_async_call(
    fast: Settings, ledger: Ledger
) -> None:
    tools = _tools(ledger, fail_first_pay=True)

    async def main() -> tuple[str, str]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            paid = await run.call_tool("pay", {"i": 1})
            await run.finish("succeeded")
            return run.run_id, paid

    run_id, paid = asyncio.run(main())
    assert paid == "paid 1"
    assert list(ledger.per_key().values()) == [1], "the reconciled call ran twice"
    events = [rec.event for rec in read_log(fast, run_id)]
    assert_log_sound(events)
    rec = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert [(r.outcome, r.action) for r in rec] == [("match", "complete")]
    assert [p.source for p in payloads(events, EventType.TOOL_CALL_COMPLETED)] == ["reconciliation"]


def test_sync_and_async_owners_hand_a_run_over(fast: Settings, ledger: Ledger) -> None:
    tools = _tools(ledger)
    with runlog.open_run(tools=tools, settings=fast) as run:
        run_id = run.run_id
        assert run.call_tool("pay", {"i": 1}) == "paid 1"  # an async tool from the sync API

    async def resume() -> tuple[str, str]:
        async with runlog.aio.open_run(run_id, tools=tools, settings=fast) as arun:
            again = await arun.call_tool("pay", {"i": 1})  # recorded: not run again
            fresh = await arun.call_tool("lookup", {"i": 2})
            return again, fresh

    assert asyncio.run(resume()) == ("paid 1", "page 2")
    with runlog.open_run(run_id, tools=tools, settings=fast) as run:
        assert run.state.resumptions == 2
        run.finish("succeeded")
    assert sorted(ledger.per_key().values()) == [1, 1]
    state = assert_log_sound([rec.event for rec in read_log(fast, run_id)])
    assert state.status == "finished"


def test_a_rejection_through_aio_decide_closes_the_escalated_call(
    fast: Settings, ledger: Ledger
) -> None:
    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        raise TimeoutError("gateway timed out after accepting")

    tools = [runlog.tool("pay", risk="irreversible")(pay)]  # no lookup: a person decides

    async def main() -> tuple[str, str]:
        async with runlog.aio.open_run(tools=tools, settings=fast) as run:
            with pytest.raises(runlog.Escalated) as esc:
                await run.call_tool("pay", {"i": 1})
            assert esc.value.approval_id is not None
            return run.run_id, esc.value.approval_id

    run_id, approval_id = asyncio.run(main())

    async def decide_and_resume() -> str:
        how = await runlog.aio.decide(
            run_id,
            approval_id,
            approved=False,
            decided_by="ops@example",
            note="refunded by hand",
            tools=tools,
            settings=fast,
        )
        async with runlog.aio.open_run(run_id, tools=tools, settings=fast) as run:
            out = await run.call_tool("pay", {"i": 1})  # closed by the person: no effect
            await run.finish("succeeded")
            return f"{how}: {out}"

    assert asyncio.run(decide_and_resume()) == "recorded: resolved by ops@example: refunded by hand"
    assert list(ledger.per_key().values()) == [1]
    events = [rec.event for rec in read_log(fast, run_id)]
    assert_log_sound(events)
    assert [d.approved for d in payloads(events, EventType.APPROVAL_DECIDED)] == [False]


def test_an_async_owner_taken_over_is_fenced(fast: Settings, ledger: Ledger) -> None:
    tools = _tools(ledger)

    async def main() -> None:
        first = await runlog.aio.open_run(tools=tools, settings=fast)
        await first.call_tool("lookup", {"i": 1})
        second = await runlog.aio.open_run(first.run_id, tools=tools, settings=fast, takeover=True)
        assert second.epoch > first.epoch
        with pytest.raises(runlog.Fenced):
            await first.call_tool("pay", {"i": 2})
        assert await second.call_tool("pay", {"i": 2}) == "paid 2"
        await second.finish("succeeded")
        await first.close()

    asyncio.run(main())
    assert sorted(ledger.per_key().values()) == [1, 1]


def test_a_cancelled_barrier_leaves_its_appends_for_the_next_one(
    fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No inline budget: a lone barrier would serve its report before the task could be
    # cancelled; this one must be awaiting it.
    monkeypatch.setattr("runlog.producers._async_run.INLINE_S", 0.0)

    async def main() -> tuple[str, int]:
        async with runlog.aio.open_run(settings=fast) as run:
            ev = run.emit(EventType.USER_MESSAGE, content="hello")
            waiting = asyncio.create_task(run.barrier())
            await asyncio.sleep(0)  # the task is now awaiting the acknowledgement
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            unchecked = [p.event.event_id for p in engine_of(run).pending]
            assert unchecked == [ev.event_id], "a cancelled wait dropped its append unchecked"
            await run.barrier()
            assert engine_of(run).pending == []
            await run.finish("succeeded")
            return run.run_id, ev.seq

    run_id, seq = asyncio.run(main())
    events = [rec.event for rec in read_log(fast, run_id)]
    assert_log_sound(events)
    assert [e.seq for e in events if e.type is EventType.USER_MESSAGE] == [seq]


def test_an_async_barrier_that_cannot_ask_redis_fences_before_the_effect(
    fast: Settings, ledger: Ledger
) -> None:
    """The asyncio ownership check (its own pipelined connection) cannot reach Redis: the
    irreversible call's STARTED is acknowledged, but the tool never runs and the run is
    fenced; a later owner finds the call open and settles it by its reconciler."""
    unreachable = fast.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})

    async def main() -> str:
        dead = async_redis_client(unreachable)
        run = await open_async(
            Services.shared(fast).run_deps(), dead, None, tools=_tools(ledger), recover=False
        )
        with pytest.raises(runlog.Fenced, match="ownership unconfirmed after append"):
            await run.call_tool("pay", {"i": 1})
        await run.close()
        await dead.aclose()
        return run.run_id

    run_id = asyncio.run(main())
    assert ledger.per_key() == {}, "the effect ran though ownership was never confirmed"
    started = [e for e in (r.event for r in read_log(fast, run_id))]
    assert [e.type for e in started].count(EventType.TOOL_CALL_STARTED) == 1

    async def resume() -> str:
        async with runlog.aio.open_run(run_id, tools=_tools(ledger), settings=fast) as run:
            return await run.call_tool("pay", {"i": 1})

    assert asyncio.run(resume()) == "paid 1"  # recovered: absent, so run once, now owned
    assert sorted(ledger.per_key().values()) == [1]
