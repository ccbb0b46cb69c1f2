"""The worker API for asyncio: ``await runlog.aio.open_run(...)`` and ``AsyncRun``.

The same runs, rules and guarantees as ``runlog.open_run``: a run opened here and one
opened by the sync API can take each other over. Opening (the lease, the replay of the
log, the claim) runs in a worker thread; everything after it is awaited in the loop.

    async with runlog.aio.open_run("order-7", tools=[refund]) as run:
        await run.call_tool("refund", {"order": 7})
        await run.finish("done")
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Generator, Iterable
from typing import Any

import redis.asyncio as aioredis

from runlog.api import decide as _decide
from runlog.bootstrap import Services
from runlog.log.clients import async_redis_client
from runlog.producers.async_run import AsyncRun, in_thread, open_async
from runlog.producers.tools import Tool
from runlog.schemas.keys import check_run_id
from runlog.settings import Settings

__all__ = ["AsyncRun", "decide", "open_run"]

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = (
    weakref.WeakKeyDictionary()
)


def _redis(settings: Settings) -> aioredis.Redis:
    """One asyncio Redis client per event loop and settings (its connections are the
    loop's)."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    key = settings.fingerprint()
    if key not in per_loop:
        per_loop[key] = async_redis_client(settings)
    return per_loop[key]


class Opening:
    """What ``open_run`` returns: await it for the run, or ``async with`` it to close
    the run (releasing its lease) on the way out."""

    def __init__(self, **kw: Any) -> None:
        self._kw = kw
        self._run: AsyncRun | None = None

    def __await__(self) -> Generator[Any, None, AsyncRun]:
        return _open(**self._kw).__await__()

    async def __aenter__(self) -> AsyncRun:
        self._run = await _open(**self._kw)
        return self._run

    async def __aexit__(self, *exc: object) -> None:
        if self._run is not None:
            await self._run.close()


def open_run(
    run_id: str | None = None,
    *,
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    settings: Settings | None = None,
    wait_s: float | None = None,
    agent: str = "",
    goal: str = "",
    reason: str = "",
    recover: bool = True,
    takeover: bool = False,
) -> Opening:
    """Start a new run (``run_id=None``) or resume one; see ``runlog.open_run``.

    Tools and reconcilers may be ``async def`` (awaited in the loop) or plain functions
    (run in a worker thread, so a blocking call inside them never stalls the loop).
    """
    if run_id is not None:
        check_run_id(run_id)
    return Opening(
        run_id=run_id,
        tenant=tenant,
        tools=list(tools),
        settings=settings,
        wait_s=wait_s,
        agent=agent,
        goal=goal,
        reason=reason,
        recover=recover,
        takeover=takeover,
    )


async def _open(*, settings: Settings | None, **kw: Any) -> AsyncRun:
    services = Services.shared(settings or Settings())
    return await open_async(services.run_deps(), _redis(services.settings), **kw)


async def decide(
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    tenant: str = "default",
    tools: Iterable[Tool] = (),
    settings: Settings | None = None,
) -> str:
    """Record a person's decision; see ``runlog.decide`` (run in a worker thread)."""
    return await in_thread(
        functools.partial(
            _decide,
            run_id,
            approval_id,
            approved=approved,
            decided_by=decided_by,
            note=note,
            tenant=tenant,
            tools=list(tools),
            settings=settings,
        )
    )
