"""Agents of ``runlog bench fleet``, imported by its `runlog worker` processes."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import runlog
from runlog.producers.async_run import AsyncRun
from runlog.schemas.vocabulary import EventType

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
