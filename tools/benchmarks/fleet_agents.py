"""Agents of ``runlog bench fleet``, imported by its `runlog worker` processes."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import redis

import runlog
from runlog.producers._async_run import AsyncRun
from runlog.schemas._vocabulary import EventType

PREFIX = os.environ.get("RUNLOG_REDIS_KEY_PREFIX", "runlog")


async def _step(args: dict[str, Any], *, idempotency_key: str) -> str:
    return f"step {args['i']}"


async def _lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Absent:
    return runlog.Absent("the bench's receiver keeps nothing")


# Irreversible for its barriers (the durable steps measured); it changes nothing, so a
# repeat under the key makes no second effect: what dedupes_by_key declares.
step = runlog.tool("step", risk="irreversible", reconcile=_lookup, receiver="dedupes_by_key")(_step)


@runlog.agent("bench.first")
async def first(run: AsyncRun, _input: Any) -> str:
    """Nothing but its start: the time to RUN_STARTED is the dispatch latency."""
    return "started"


@runlog.agent("bench.hold")
async def hold(run: AsyncRun, order: dict[str, Any]) -> str:
    """Stays open, appending every ``every_s``, for ``steps`` appends or until ``until``."""
    for i in range(int(order["steps"])):
        if time.time() > float(order["until"]):
            break
        await run.append(EventType.MEMORY_WRITTEN, key="tick", value=str(i))
        await asyncio.sleep(float(order["every_s"]))
    return "held"


@runlog.agent("bench.steps", tools=[step])
async def steps(run: AsyncRun, order: dict[str, Any]) -> str:
    """``steps`` irreversible tool calls: durable steps per second of the fleet."""
    for i in range(int(order["steps"])):
        await run.call_tool("step", {"i": i})
    return "done"


def _receiver() -> Any:
    """The bench's receiver: records each effect by its key (``<prefix>:effects``)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    return _client


_client: Any = None


async def _pay(args: dict[str, Any], *, idempotency_key: str) -> str:
    await asyncio.sleep(float(args["step_s"]))  # in flight: a SIGTERM or a SIGKILL lands here
    pipe = _receiver().pipeline(transaction=True)
    pipe.hincrby(f"{PREFIX}:effects", idempotency_key, 1)
    pipe.hset(f"{PREFIX}:results", idempotency_key, "paid")
    pipe.execute()
    return "paid"


async def _paid(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
    if _receiver().hget(f"{PREFIX}:results", idempotency_key) is None:
        return runlog.Absent("no effect recorded under the key")
    return runlog.Match("paid")


pay = runlog.tool("pay", risk="irreversible", reconcile=_paid)(_pay)


@runlog.agent("bench.pay", tools=[pay])
async def pay_steps(run: AsyncRun, order: dict[str, Any]) -> str:
    """``steps`` irreversible calls of ``step_s`` each, a durable sleep of ``sleep_s``
    after each when it is not 0: ``runlog bench handover``'s runs mid-step and mid-sleep."""
    for i in range(int(order["steps"])):
        await run.call_tool("pay", {"i": i, "step_s": order["step_s"]})
        if float(order["sleep_s"]):
            await run.sleep(float(order["sleep_s"]))
    return "paid"


@runlog.agent("bench.nap")
async def nap(run: AsyncRun, order: dict[str, Any]) -> str:
    """A durable sleep until ``until`` (epoch seconds), then done: ``runlog bench scale``'s
    runs waiting on timers that fall due in the same second. Waiting holds no worker: the
    sleep releases the run, and its due time dispatches it again."""
    await run.sleep(max(0.0, float(order["until"]) - time.time()))
    return "woke"


@runlog.agent("bench.ask")
async def ask(run: AsyncRun, order: dict[str, Any]) -> str:
    """Waits for a person (an action approval), then done: ``runlog bench scale``'s runs
    waiting on people. Waiting holds no worker: ``Escalated`` releases the run, and the
    decision dispatches it again."""
    mine = [a for a in run.state.approvals.values() if a.kind == "action"]
    if not mine:
        aid = await run.request_approval(str(order.get("question", "go on?")))
        raise runlog.Escalated("waiting for a person", approval_id=aid, run_id=run.run_id)
    if mine[0].approved is None:
        raise runlog.Escalated("waiting for a person", run_id=run.run_id)
    return "approved" if mine[0].approved else "rejected"
