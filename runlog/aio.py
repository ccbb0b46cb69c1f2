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
import inspect
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis

from runlog import _api as api
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._clients import async_redis_client
from runlog.producers._async_run import AsyncRun, in_thread, open_async
from runlog.producers._handle import Run
from runlog.schemas._keys import check_run_id

__all__ = [
    "AsyncRun",
    "cancel",
    "decide",
    "forget",
    "fork",
    "open_run",
    "question",
    "reconcile",
    "resume",
    "start",
    "terminate",
]

P = ParamSpec("P")
R = TypeVar("R")

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

    def __init__(self, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        bound = _OPEN.bind(*args, **kw)  # refuses what runlog.open_run would refuse
        bound.apply_defaults()
        self._kw = dict(bound.arguments)
        if self._kw["run_id"] is not None:
            check_run_id(self._kw["run_id"])
        self._run: AsyncRun | None = None

    async def _open(self) -> AsyncRun:
        kw = dict(self._kw)
        services = Services.shared(kw.pop("settings") or Settings())
        return await open_async(services.run_deps(), _redis(services.settings), **kw)

    def __await__(self) -> Generator[Any, None, AsyncRun]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncRun:
        self._run = await self._open()
        return self._run

    async def __aexit__(self, *exc: object) -> None:
        if self._run is not None:
            await self._run.close()


_OPEN = inspect.signature(api.open_run)


def _opening(sync: Callable[P, Run]) -> Callable[P, Opening]:
    def open_run(*args: P.args, **kw: P.kwargs) -> Opening:
        return Opening(args, kw)

    open_run.__doc__ = """``runlog.open_run`` for an event loop: ``await`` it, or ``async with`` it.

    The arguments and the semantics are ``runlog.open_run``'s. Tools and reconcilers may be
    ``async def`` (awaited in the loop) or plain functions (run in a worker thread, so a
    blocking call inside them never stalls the loop).
    """
    return open_run


def _awaitable(sync: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    @functools.wraps(sync)
    async def in_worker(*args: P.args, **kw: P.kwargs) -> R:
        return await in_thread(functools.partial(sync, *args, **kw))

    return in_worker


open_run = _opening(api.open_run)
decide = _awaitable(api.decide)
"""``runlog.decide``, run in a worker thread."""
fork = _awaitable(api.fork)
"""``runlog.fork``, run in a worker thread."""
question = _awaitable(api.question)
"""``runlog.question``, run in a worker thread."""
cancel = _awaitable(api.cancel)
"""``runlog.cancel``, run in a worker thread."""
terminate = _awaitable(api.terminate)
"""``runlog.terminate``, run in a worker thread."""
start = _awaitable(api.start)
"""``runlog.start``, run in a worker thread: returns once the request is acknowledged."""
resume = _awaitable(api.resume)
"""``runlog.resume``, run in a worker thread."""
reconcile = _awaitable(api.reconcile)
"""``runlog.reconcile``, run in a worker thread."""
forget = _awaitable(api.forget)
"""``runlog.forget``, run in a worker thread."""
