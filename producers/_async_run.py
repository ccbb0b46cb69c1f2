"""A run for asyncio workers: the same rules as ``Run``, with every wait awaited.

``AsyncRun`` wraps the ``Run`` that ``open_run`` claimed and drives the same rule
generators (``runlog.producers._calls``, ``runlog.producers._approvals``) as the sync API,
performing their requests with ``await``: an acknowledgement is awaited on the delivery
future, the ownership check after a barrier is one awaited Redis GET, async tools and
reconcilers are awaited, sync ones run in a worker thread, and what has no awaitable form
(a log read, the claim itself) runs in a worker thread too. The event loop's thread
never blocks on the network, so hundreds of runs can be open in one loop.

An ``AsyncRun`` belongs to the event loop that opened it. Its tasks may use it at once
(``asyncio.gather`` over its calls): each call, append and barrier takes the run's turn,
so they are served one after another in the order they asked, as the sync ``Run``
serves threads under its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis.asyncio as aioredis

from runlog.errors import RedisUnavailable, RunlogError
from runlog.log._clients import REDIS_ERRORS, loop_get, loop_mget
from runlog.producers import _approvals as approvals
from runlog.producers import _calls as calls
from runlog.producers import _timers as timers
from runlog.producers._context import call_context
from runlog.producers._engine import CANCELLED, Engine, RunDeps
from runlog.producers._handle import Handle, Run
from runlog.producers._opening import open_run_with
from runlog.producers._ops import Append, Blocking, Done, Invoke, Lookup, Op, Peek, Steps, advance
from runlog.producers._tools import is_async
from runlog.producers._writer import Ack, AckGroup, EventWriter
from runlog.schemas._models import Event, Payload
from runlog.schemas._signing import Signature
from runlog.schemas._vocabulary import EventType

T = TypeVar("T")
log = logging.getLogger(__name__)


_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="runlog-aio")
"""runlog's own threads for what has no awaitable form (claims, log reads, sync tools):
the loop's default executor has about as many threads as cores, and hundreds of runs
confirming at once would queue behind each other there."""


_OPENING_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="runlog-open")
"""The threads of claims (``open_async``): a burst of opens (a worker taking over a
partition's orphans, a batch of starts) waits in these, never in the pool the open runs'
own steps need, so runs already going are not held up behind runs opening."""


async def in_thread(fn: Callable[..., T], /, *args: Any, pool: ThreadPoolExecutor = _POOL) -> T:
    """``fn(*args)`` in runlog's pool, with this task's context (``current_call()``)."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(ctx.run, fn, *args)
    )


async def open_async(
    deps: RunDeps,
    aredis: aioredis.Redis,
    run_id: str | None = None,
    *,
    recover: bool = True,
    **kw: Any,
) -> AsyncRun:
    """``open_run_with`` for an event loop: the claim in a worker thread, then (as the
    sync open does) queued decisions and recovery of open calls, awaited."""
    claim = functools.partial(open_run_with, deps, run_id, recover=False, **kw)
    run = await in_thread(claim, pool=_OPENING_POOL)
    arun = AsyncRun(run, aredis)
    if recover:
        await recover_opened(arun)
    return arun


async def recover_opened(arun: AsyncRun) -> None:
    """What an open does once its claim counts (``open_async`` with ``recover``): the
    decisions people queued meanwhile, then the recovery of open calls. A dispatch that
    bounds its opens at once does this outside the bound (``runner.execute_async``): the
    claim is what the bound is for. On failure the lease is released and it raises."""
    engine = arun._engine
    if engine.state.status == "finished":
        return
    try:
        await arun.poll_decisions()
        await arun._recover()
    except BaseException:
        arun._leave_loop()
        await in_thread(engine.lease.release)
        raise


async def _thread_to_its_end(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread; a cancellation waits until the thread is done.

    A thread cannot be cancelled: one left running (a log read extending the run's view)
    would overlap the run's next step once the cancelled task gave up its turn.
    """
    fut = asyncio.ensure_future(in_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


class _Turn:
    """Whose turn it is on one run: an ``asyncio.Lock`` (first come, first served) that the
    task holding it may take again (an async tool appending to its own run), as the sync
    ``Run``'s ``RLock`` is re-entrant for its thread. A task that a tool starts is another
    task: it waits for the turn, so the tool must not wait for it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[Any] | None = None
        self._left: asyncio.Future[Any] | None = None

    def leave_running(self, work: asyncio.Future[Any]) -> None:
        """The holder gives up waiting for ``work`` (a thread with a request of this run):
        the turn passes on only once it is done."""
        self._left = work

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        me = asyncio.current_task()
        if me is not None and me is self._holder:
            yield
            return
        await self._lock.acquire()
        self._holder = me
        try:
            yield
        finally:
            self._holder = None
            left, self._left = self._left, None
            if left is None or left.done():
                self._lock.release()
            else:
                left.add_done_callback(lambda _: self._lock.release())


async def _call(fn: Any, op: Invoke | Lookup, turn: _Turn) -> Any:
    """Await an async tool or reconciler ``fn`` here; run a sync one in a worker thread (it
    may block on its own network call). The call context travels with it either way, and
    the call itself is ``op.request()``, the one the sync driver makes (key and fence).

    A cancellation cannot stop the thread: the request in it is still in flight and may
    still take effect, so the run's turn passes on only when it ends (a retry's lookup
    asked meanwhile could find the effect absent, and run it a second time).
    """

    def call() -> Any:
        with call_context(op.ctx):
            return op.request()

    if is_async(fn):
        with call_context(op.ctx):
            out = op.request()
    else:
        running = asyncio.ensure_future(in_thread(call))
        try:
            out = await asyncio.shield(running)
        except asyncio.CancelledError:
            running.add_done_callback(_retrieved)
            turn.leave_running(running)
            raise
    if inspect.isawaitable(out):
        with call_context(op.ctx):
            out = await out
    return out


def _retrieved(done: asyncio.Future[Any]) -> None:
    """Nobody awaits a left thread's outcome: read it, so asyncio does not report it."""
    if not done.cancelled():
        done.exception()


class AsyncRun(Handle):
    """An owned run in an event loop. ``async with`` closes it (releasing the lease)."""

    def __init__(self, run: Engine, aredis: aioredis.Redis) -> None:
        self._engine = run
        self._get = loop_mget(aredis)
        self._peek = loop_get(aredis)
        self._keys = (run.deps.leases.lease_key(run.tenant, run.run_id), run.cancel_flag_key)
        self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        self._turn = _Turn()
        _OPEN_RUNS[self._loop] = _OPEN_RUNS.get(self._loop, 0) + 1

    def __getattr__(self, name: str) -> Any:
        if name == "sync":  # a ``Run`` over the same engine, to call from a thread
            return self._deprecated(name, Run(self._engine))
        if name == "lease":
            return self._deprecated(name, self._engine.lease)
        if name == "recover":
            return self._deprecated(name, self._recover)
        raise AttributeError(f"'AsyncRun' object has no attribute {name!r}")

    async def __aenter__(self) -> AsyncRun:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # Driving the rules -------------------------------------------------------------------
    async def _perform(self, op: Op) -> Any:
        if isinstance(op, Append):
            if op.durable:
                return await self._append(op.event_type, op.payload)
            return await self._emit(op.event_type, op.payload)
        if isinstance(op, Invoke):
            return await _call(op.tool, op, self._turn)
        if isinstance(op, Lookup):
            return await _call(op.tool.reconcile, op, self._turn)
        if isinstance(op, Peek):
            try:
                return await self._peek(op.key)
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"GET {op.key}: {exc}") from exc
        assert isinstance(op, Blocking)
        return await _thread_to_its_end(op.fn)

    async def _drive(self, steps: Steps[T]) -> T:
        """``ops.drive`` with ``await``: the same loop over the same rules, in the run's
        turn from the rule's first step to its result."""
        async with self._turn():
            nxt = advance(steps)
            while not isinstance(nxt, Done):
                try:
                    answer, error = await self._perform(nxt), None
                except BaseException as exc:  # noqa: BLE001 - handed to the rule, which re-raises
                    answer, error = None, exc
                nxt = advance(steps, answer, error)
            return nxt.value

    # Appending ---------------------------------------------------------------------------
    def emit(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Pipeline an event without waiting; ``await barrier()`` makes it durable."""
        return self._engine.emit(event_type, payload, **kw)

    async def _emit(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """``emit`` with the lease's Redis check awaited, when one is due: a lease whose
        local validity ran out (its renewal late, the process busy) is confirmed before the
        append (``Run._guard``), and that check must not block the loop's thread."""
        run = self._engine
        lease = run.lease
        if lease.locally_valid() or lease.lost or lease.released:
            # Valid: no check is due. Lost or released: ``_guard`` refuses without Redis.
            return run.emit(event_type, payload, **kw)
        try:
            raw = await self._peek(self._keys[0])
        except REDIS_ERRORS as exc:
            raise run.fenced(f"no valid lease and Redis cannot confirm one: {exc}") from exc
        if not lease.confirm(raw.decode() if isinstance(raw, bytes) else raw):
            raise run.fenced(f"lease of epoch {run.epoch} is no longer current")
        return run.emit_confirmed(event_type, payload if payload is not None else kw)

    async def barrier(self) -> None:
        """Await every emitted event's acknowledgement, then one Redis check of ownership."""
        async with self._turn():
            await self._barrier()

    async def _barrier(self) -> None:
        run = self._engine
        pending = run.take_pending()
        if pending:
            try:
                await _acknowledged(
                    run.deps.writer,
                    run.acks,
                    [p.ack for p in pending],
                    run.delivery_wait_s,
                    inline=self._loop is not None and _OPEN_RUNS.get(self._loop) == 1,
                )
            except BaseException:
                run.interrupted(pending)
                raise
        for p in pending:
            run.delivered(p, p.ack.outcome)
        if pending:
            flag = None
            if run.lease.released:
                ok = False
            else:
                try:
                    raw, flag = await self._get(self._keys)
                except REDIS_ERRORS as exc:
                    raise run.unconfirmed(exc) from exc
                ok = run.lease.confirm(raw.decode() if isinstance(raw, bytes) else raw)
            run.owned_after(pending, ok, flag)  # the sync barrier's verdict, the same rule

    async def append(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Append one event; returns once acknowledged and ownership re-checked.

        A step of the agent's: a person's cancellation is raised here first (``Cancelled``,
        once), as at ``call_tool``."""
        async with self._turn():
            if EventType(event_type) is not EventType.RUN_FINISHED:
                await self._drive(self._engine.cancel_check())
            return await self._append(event_type, payload, **kw)

    async def check_cancelled(self) -> None:
        """``Run.check_cancelled``: raise ``Cancelled`` (once) if a person cancelled the run."""
        await self._drive(self._engine.cancel_check())

    async def _append(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        ev = await self._emit(event_type, payload, **kw)
        await self._barrier()
        snapshots = self._engine.deps.snapshots
        if snapshots is not None and snapshots.due(self._engine):
            await _thread_to_its_end(functools.partial(snapshots.maybe_write, self._engine))
        return ev

    # Tools, approvals, the end -----------------------------------------------------------
    async def call_tool(
        self,
        name: str,
        args: dict[str, Any],
        *,
        operation_id: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Invoke a tool at most once per logical action (see docs/concepts/effects.md).

        Calls made at once on one run (``asyncio.gather``, several tasks) are served one
        after another, in the order they were made, each in the run's turn from its
        STARTED to its outcome: a run is one ordered log whose every step is decided on
        what the steps before it left (a key's ordinal, a conflict that stops the run, an
        uncertain call recovered first), and its tools get its requests one at a time.
        Effects meant to overlap in time belong to runs of their own.

        A call cancelled (``asyncio.wait_for``, ``task.cancel()``) before its tool was
        handed the request records that it did not run (a completion without a key), so
        asking again with the same arguments runs the tool once; cancelled while the tool
        ran, the call is uncertain and the recovery rules settle it. A plain-function tool
        goes on in its thread (a thread cannot be cancelled): the run's next step, and
        ``close``, wait until that thread is done.
        """
        return await self._drive(
            calls.call_tool(self._engine, name, args, operation_id=operation_id, call_id=call_id)
        )

    async def request_approval(
        self,
        reason: str,
        *,
        kind: str = "action",
        deadline_s: float | None = None,
        **fields: Any,
    ) -> str:
        """``Run.request_approval``: ask a person, optionally by a deadline."""
        return await self._drive(
            approvals.request_approval(
                self._engine, reason, kind=kind, deadline_s=deadline_s, **fields
            )
        )

    async def decide(
        self,
        approval_id: str,
        *,
        approved: bool,
        decided_by: str,
        note: str = "",
        signature: Signature | None = None,
        answer: str | None = None,
    ) -> None:
        await self._drive(
            calls.decide(
                self._engine,
                approval_id,
                approved=approved,
                decided_by=decided_by,
                note=note,
                signature=signature,
                answer=answer,
            )
        )

    async def poll_decisions(self) -> int:
        return await self._drive(approvals.poll_decisions(self._engine, calls.decide))

    async def _recover(self) -> None:
        await self._drive(calls.recover(self._engine))

    async def since_last_turn(self) -> list[Event]:
        async with self._turn():
            if self._engine.pending:
                await self._barrier()
            return await _thread_to_its_end(self._engine.since_last_turn)

    async def sleep(self, seconds: float) -> None:
        """``Run.sleep`` for an event loop: the same durable timer, awaited (in a worker
        of the fleet, a timer not yet due releases the run instead)."""
        run = self._engine
        async with self._turn():
            await self._drive(run.cancel_check())  # a step (``Run.sleep``)
            nxt = timers.next_timer(run.state, run.sleeps)
            run.sleeps += 1
            if nxt.recorded is not None:
                due = nxt.recorded.due_at
            else:
                fields = timers.payload(nxt.ordinal, seconds, timers.SLEEP)
                await self.append(EventType.TIMER_STARTED, fields)
                due = run.state.timers[nxt.ordinal].due_at
        if run.dispatched:
            timers.wait_or_raise(run.run_id, due, block=False)
        else:
            await asyncio.sleep(max(0.0, timers.remaining_s(due)))

    async def finish(self, outcome: str, summary: str = "") -> Event:
        """Append RUN_FINISHED (durable) and release the lease; see ``Run.finish``."""
        run = self._engine
        outcome, summary = run.final_outcome(outcome, summary)
        async with self._turn():
            try:
                if run.state.status == "finished" and run.state.outcome == outcome:
                    for ev in reversed(await self.since_last_turn()):
                        if ev.type is EventType.RUN_FINISHED:
                            return ev
                return await self._append(EventType.RUN_FINISHED, outcome=outcome, summary=summary)
            finally:
                self._leave_loop()
                await in_thread(run.lease.release)

    async def close(self) -> None:
        """Await pipelined appends (best effort) and release the lease."""
        run = self._engine
        if run.ends_cancelled():
            try:
                await self.finish(CANCELLED)
            except RunlogError as exc:
                # The request stays in the log: the next owner ends the run.
                log.warning("run %s: could not end cancelled: %s", run.run_id, exc)
        async with self._turn():
            try:
                if run.pending and run.poisoned is None:
                    await self._barrier()
            finally:
                self._leave_loop()
                await in_thread(run.close)

    def _leave_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and _OPEN_RUNS.get(loop):
            _OPEN_RUNS[loop] -= 1


_OPEN_RUNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()
"""Open ``AsyncRun``s per event loop: a barrier serves its report in the loop's thread
only when its run is the loop's one (with others, the loop has their work to do meanwhile)."""


class _Wakes:
    """The wake-ups of one loop's barriers, handed to the loop in batches.

    The thread serving delivery reports wakes every barrier whose last report it served;
    the barriers of many runs come in together (one flush serves them all). Each wake-up
    through its own ``call_soon_threadsafe`` is a write to the loop's self-pipe and a
    read of it in the loop; here the first wake-up of a batch makes that one call and the
    others join it, until the loop runs the batch. The barriers woken together resume in
    one tick, so their ownership checks go to Redis in one command
    (``runlog.log._clients.LoopGet``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._due: list[Callable[[], None]] = []

    def add(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the loop (from any thread); RuntimeError if the loop closed."""
        with self._lock:
            self._due.append(fn)
            if len(self._due) > 1:
                return  # the batch's call is made: it runs this one too
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:
            with self._lock:
                self._due.clear()
            raise

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for fn in due:
            fn()


_WAKES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Wakes] = weakref.WeakKeyDictionary()


INLINE_S = 0.003
"""The longest a lone asyncio barrier holds its loop serving its own delivery report."""


async def _acknowledged(
    writer: EventWriter, group: AckGroup, acks: list[Ack], timeout: float, *, inline: bool
) -> None:
    """Await every ack's outcome (or ``timeout``: those left without one are unknown).

    With ``inline`` (its run is the loop's one) a lone barrier first serves its reports in
    the loop's thread for at most ``INLINE_S`` (``EventWriter.serve_briefly``). Otherwise,
    or when they are not in by then, the barrier follows: the writer's serving thread
    flushes (sending what is queued at once) and wakes it from the thread that serves its
    last report, through ``call_soon_threadsafe``. Cancelling the waiting task
    cancels only ``done`` (this wait's own): the appends are left to the next barrier,
    which waits for them anew.
    """
    if inline and writer.serve_briefly(group, acks, INLINE_S):
        return
    loop = asyncio.get_running_loop()
    wakes = _WAKES.get(loop)
    if wakes is None:
        wakes = _WAKES[loop] = _Wakes(loop)
    done: asyncio.Future[None] = loop.create_future()
    follower = writer.follow()

    def resolve() -> None:
        if not done.done():
            done.set_result(None)

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            wakes.add(resolve)
        follower.leave()  # last: it may end the serving thread's flush

    try:
        if not group.watch(acks, wake):
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await done
    finally:
        follower.leave()
