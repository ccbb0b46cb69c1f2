"""One dispatch of one run: open it under its lease, execute its agent, record the end.

The worker calls ``execute`` (or ``execute_async`` for an ``async def`` agent) in a free
slot; the result says what became of the run and what the worker does next. A wait
(timer or person) is written to the lifecycle topic while the lease is still held, and the
lease is released afterwards, so a decision's or a resume's record always lands after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import traceback
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

import redis.asyncio as aioredis

from runlog._settings import Settings
from runlog.errors import (
    AgentMismatch,
    AppendOutcomeUnknown,
    Cancelled,
    Escalated,
    Fenced,
    KafkaUnavailable,
    NoKeys,
    RedisUnavailable,
    RunFinished,
    RunLocked,
    TenantMismatch,
    UnknownRun,
)
from runlog.fleet import _handoffs as handoffs
from runlog.fleet._lifecycle import LifecycleWriter, Record, rebuilt
from runlog.fleet._registry import Agent
from runlog.log._fold import read_run
from runlog.log._keys import keys_for
from runlog.log._reader import Prefetch
from runlog.producers import _timers as timers
from runlog.producers._approvals import decisions_key
from runlog.producers._async_run import AsyncRun, in_thread, open_async, recover_opened
from runlog.producers._bounds import TEXT_BYTES, bound_text
from runlog.producers._drain import HandingOver
from runlog.producers._engine import CANCELLED, Engine, RunDeps
from runlog.producers._handle import Run, engine_of
from runlog.producers._lease import Lease
from runlog.producers._opening import Batch, Claim, claim_of, open_run_with
from runlog.projections._run_state import RunState
from runlog.schemas import _codec as codec
from runlog.schemas._keys import partition_for
from runlog.schemas._sealing import ERASED
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

Kind = Literal[
    "finished",
    "waiting_person",
    "waiting_until",
    "locked",
    "retry",
    "forget",
    "erased",
    "rebuilt",
    "unserved",
    "ended",
    "handed_over",
]
INFRA = (AppendOutcomeUnknown, KafkaUnavailable, RedisUnavailable)
"""Not the agent's failure: nothing is recorded, the run is dispatched again."""
INFRA_RETRY_S = 1.0
UNKNOWN_AGENT_RETRY_S = 10.0
"""How often a worker says again that a run names an agent it does not serve."""
NO_KEYS_RETRY_S = 30.0
"""A worker without the keys a sealed start input needs retries it this much later."""


@dataclass(frozen=True)
class Result:
    kind: Kind
    record: Record | None = None
    """The lifecycle record this dispatch wrote last (None: none, or a tombstone)."""
    offset: int | None = None
    """Its offset in the lifecycle partition."""
    retry_s: float = 0.0
    why: str = ""


def _is_finished(run: Engine) -> bool:
    """Whether the agent finished the run itself (read again after it ran)."""
    return run.state.status == "finished"


def _start_fields(agent: Agent, rec: Record) -> dict[str, str]:
    fields = {"code_version": agent.version, "input_json": rec.input_json or "null"}
    if rec.subject:
        fields["subject"] = rec.subject
    return fields


def _open_args(
    deps: RunDeps,
    agent: Agent,
    rec: Record,
    prefetch: Prefetch | None = None,
    lease: Lease | None = None,
    batch: Batch | None = None,
) -> dict[str, Any]:
    """How a dispatch opens its run (sync and async alike): never waiting for a lease
    another worker holds, the RUN_STARTED fields of the request when the run is new. A
    record without an input (``open``: a resume, a handover, a dead worker's run adopted)
    never starts a run: only a start request says what a new run starts with."""
    return {
        "tenant": rec.tenant,
        "tools": agent.tools,
        "wait_s": 0,
        "agent": agent.name,
        "expect_agent": agent.name,
        "reason": f"dispatched to worker {deps.writer_id}",
        "started_with": _start_fields(agent, rec),
        "create": rec.input_json is not None or rec.input_sealed is not None,
        "prefetch": prefetch,
        "lease": lease,
        "batch": batch,
    }


def batch_claim(deps: RunDeps, agent: Agent, rec: Record, lease: Lease) -> Claim:
    """The claim a dispatch of ``rec`` makes (``_open_args``), under ``lease`` taken
    already: what a worker opens a batch of adopted runs with (``Batch``)."""
    return claim_of(lease, **_open_args(deps, agent, rec))


def _input(run_input: str | None, rec: Record) -> Any:
    return json.loads(run_input or rec.input_json or "null")


def locked_retry_s(settings: Settings, holder_ttl_ms: int | None) -> float:
    """When a dispatch tries again a run whose lease another holder has for
    ``holder_ttl_ms`` more (None: unknown)."""
    ttl = holder_ttl_ms if holder_ttl_ms is not None else settings.lease_ttl_ms
    if settings.liveness_ttl_ms:
        # A holder's session lives as long as its worker: trying again at every liveness
        # TTL would cost each run held elsewhere Redis commands every few seconds. A dead
        # worker's runs are adopted when its session ends, a drained one's are announced
        # (an ``open`` record): only a holder outside the fleet waits this long.
        ttl = max(ttl, settings.lease_ttl_ms)
    return max(0.02, ttl / 1000 + 0.02)


def _locked(exc: RunLocked, deps: RunDeps) -> Result:
    return Result("locked", retry_s=locked_retry_s(deps.settings, exc.holder_ttl_ms), why=str(exc))


def _fenced(deps: RunDeps, exc: BaseException) -> Result:
    return Result("locked", retry_s=deps.settings.lease_ttl_ms / 1000, why=str(exc))


def _failure_text(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return bound_text(f"agent failed: {type(exc).__name__}: {exc}\n{text}", TEXT_BYTES)


def _waiting_until(
    lw: LifecycleWriter, run_id: str, tenant: str, agent: str, due: datetime
) -> Result:
    rec = Record("waiting_until", tenant, agent, due_at=due)
    return Result("waiting_until", rec, lw.write(run_id, rec))


def _waiting_person(lw: LifecycleWriter, run_id: str, tenant: str, agent: str) -> Result:
    rec = Record("waiting_person", tenant, agent)
    return Result("waiting_person", rec, lw.write(run_id, rec))


def _decided_meanwhile(deps: RunDeps, lw: LifecycleWriter, res: Result, run_id: str) -> Result:
    """After the lease is released: a decision queued while this worker held the run is in
    its inbox, and no one else will dispatch it; write ``open`` for it (a decision that comes
    later finds the run free, is recorded by its decider, who writes ``open`` then)."""
    assert res.record is not None
    try:
        queued = int(deps.redis.llen(decisions_key(deps, res.record.tenant, run_id)))
    except Exception:  # noqa: BLE001 - Redis down: the decider's own record still wakes it
        return res
    if not queued:
        return res
    rec = Record("open", res.record.tenant, res.record.agent)
    return Result("waiting_person", rec, lw.write(run_id, rec))


def _handed_over(lw: LifecycleWriter, run: Engine, tenant: str, agent: str) -> Result:
    """The worker drains and the run reached a step's boundary: its lease is released as a
    handover, announced to the live workers (``fleet.handoffs``: one takes it at once),
    then ``open`` is written to its lifecycle record, so whichever worker owns the
    partition now (the drainer gave its partitions up) dispatches it too, even if it
    found the run locked a moment before: the lease decides."""
    try:
        run.hand_over()
        rec = Record("open", tenant, agent)
        # The live workers first (one Redis push): they take the run now, without waiting
        # for this record's acknowledgement nor for the group to move its partition.
        handoffs.announce(run.deps.redis, run.deps.settings, [(run.run_id, rec)])
        return Result("handed_over", rec, lw.write(run.run_id, rec))
    except (Fenced, RunLocked) as exc:
        return _fenced(run.deps, exc)
    except INFRA as exc:
        # The lease is free: the partition's new owner still dispatches the run when its
        # retry comes (or at once, if it had not tried yet).
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))


def _finished(lw: LifecycleWriter, run_id: str) -> Result:
    return Result("finished", None, lw.write(run_id, None))


def _erased(lw: LifecycleWriter, run_id: str) -> Result:
    """The run's content was erased (``runlog forget``; its fold says ``erased``): it is
    never dispatched, whatever record is left for it (a worker that died after the finish,
    a resume racing the forget): an erased run has ended, and its agent input and carried
    state read ``ERASED``, which no agent can run on. Its lifecycle record is tombstoned."""
    log.warning("dispatch of %s dropped: its content was erased (runlog forget)", run_id)
    try:
        return Result("erased", None, lw.write(run_id, None), why="erased")
    except INFRA as exc:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))


def _cancelled(lw: LifecycleWriter, run: Engine, exc: BaseException | None) -> Result:
    """A person cancelled the run: it ends ``cancelled`` (``Run.final_outcome``), whether
    the agent let ``Cancelled`` out or was about to wait (a cancelled run waits for no
    person and no time), never ``failed`` and never dispatched again."""
    try:
        if not _is_finished(run):
            run.finish(CANCELLED, "" if exc is None else str(exc))
        return _finished(lw, run.run_id)
    except (Fenced, RunLocked) as err:
        return _fenced(run.deps, err)
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))


def _retry_or_fail_due(agent: Agent, state_timers: tuple[Any, ...]) -> float | None:
    """Seconds until the agent's next retry, or None when its policy has none left."""
    used = sum(1 for t in state_timers if t.purpose == timers.RETRY)
    if used >= agent.retry.retries:
        return None
    return agent.retry.delay(used)


def _not_opened(
    deps: RunDeps, lw: LifecycleWriter, run_id: str, rec: Record, exc: Exception
) -> Result:
    """What a dispatch does when opening the run failed for a reason not the agent's (the
    sync and the asyncio dispatch alike)."""
    if isinstance(exc, RunLocked):
        return _locked(exc, deps)
    if isinstance(exc, TenantMismatch | AgentMismatch):
        return _rebuild(deps, lw, run_id, rec, exc)
    if isinstance(exc, UnknownRun):
        log.error("dispatch of %s dropped: %s (and no start input to start it with)", run_id, exc)
        return Result("forget", why=str(exc))
    if isinstance(exc, Fenced):
        return _fenced(deps, exc)
    return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))


def _rebuild(
    deps: RunDeps, lw: LifecycleWriter, run_id: str, rec: Record, exc: Exception
) -> Result:
    """The lifecycle record names another tenant or agent than the run's log, or holds an
    input that does not open for the run: the log wins.
    The record is written again as the log implies (``lifecycle.rebuilt``: its tenant, its
    agent, a timer's due time; a tombstone for a run that ended), never dropped, so the
    run goes on as before and a worker that reads the topic again finds it so. What the
    disagreeing record asked for is refused here, and said in the worker's log."""
    try:
        state = _log_state(deps, rec.tenant, run_id)
        if state.status == "new":
            return Result("forget", why=str(exc))  # no log: the record is all there is
        if state.erased is not None:
            # Its agent may be unreadable now (a fork's is in its sealed first record).
            return _erased(lw, run_id)
        log.error(
            "lifecycle record of %s (%s, tenant %r, agent %r) disagrees with its log: %s; "
            "rebuilt from the log",
            run_id,
            rec.state,
            rec.tenant,
            rec.agent,
            exc,
        )
        record = rebuilt(state, codec.now_utc())
        return Result("rebuilt", record, lw.write(run_id, record), why=str(exc))
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))


def _log_state(deps: RunDeps, tenant: str, run_id: str, *, tail: bool = False) -> RunState:
    """The run's state from its log. ``tail``: the process's log tail may say the run has
    no record yet (as the open of a requested run asks it), which spares a read of the
    partition from its beginning for each request no worker here can serve; only for a
    caller that acts on nothing when the run is new."""
    reader = deps.reader_factory()
    try:
        # The fold does not depend on the tenant asked for: it only names the start index
        # to try, and a miss falls back to the run id's time or a scan.
        return read_run(
            reader,
            deps.redis,
            deps.settings,
            tenant,
            run_id,
            tail=deps.tail if tail else None,
            partition=partition_for(run_id, deps.partition_count()) if tail else None,
        ).state
    finally:
        reader.close()


def check_end(deps: RunDeps, lw: LifecycleWriter, run_id: str, rec: Record) -> Result:
    """A tombstone someone else wrote over a run this worker knew as ``rec`` (open or
    waiting): only the log may end a run. A run whose log has not ended gets the record
    its log implies again (its timer, its agent); an ended one stays forgotten."""
    try:
        state = _log_state(deps, rec.tenant, run_id)
        record = rebuilt(state, codec.now_utc())
        if record is None:
            return Result("ended", why="ended in its log")
        log.error(
            "lifecycle record of %s was tombstoned, but its log has not ended (%s): "
            "rebuilt from the log",
            run_id,
            state.status,
        )
        return Result("rebuilt", record, lw.write(run_id, record), why="tombstone over a live run")
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))


def check_unserved(deps: RunDeps, lw: LifecycleWriter, run_id: str, rec: Record) -> Result:
    """The record names an agent this worker does not serve: only the log can say whether
    it is the run's (a request written over a run of another agent or tenant must not
    leave that run undispatched). A log that disagrees with the record rebuilds it; a run
    with no log, or one whose log agrees, waits for a worker that serves its agent."""
    try:
        state = _log_state(deps, rec.tenant, run_id, tail=True)
        if state.status == "new" or (state.tenant, state.agent_name) == (rec.tenant, rec.agent):
            return Result("unserved", retry_s=UNKNOWN_AGENT_RETRY_S)
        log.error(
            "lifecycle record of %s (%s, tenant %r, agent %r) disagrees with its log "
            "(tenant %r, agent %r): rebuilt from the log",
            run_id,
            rec.state,
            rec.tenant,
            rec.agent,
            state.tenant,
            state.agent_name,
        )
        record = rebuilt(state, codec.now_utc())
        return Result("rebuilt", record, lw.write(run_id, record), why="disagrees with the log")
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))


def _opened(deps: RunDeps, lw: LifecycleWriter, run_id: str, rec: Record) -> Record | Result:
    """``rec`` with its start input opened (``Record.open_input``), or what the dispatch
    does instead: a request whose subject was forgotten (its input ``ERASED``) is dropped,
    its lifecycle record tombstoned, never started (starting it would make the forgotten
    subject a new key) nor retried; a worker without keys retries (a setting to fix)."""
    if rec.input_sealed is None:
        return rec
    try:
        text = rec.open_input(keys_for(deps.settings), run_id)
    except NoKeys as exc:
        log.error("start of %s: %s", run_id, exc)
        return Result("retry", retry_s=NO_KEYS_RETRY_S, why=str(exc))
    except ValueError as exc:
        log.error("start of %s: its sealed input does not open: %s", run_id, exc)
        return _rebuild(deps, lw, run_id, rec, exc)
    except INFRA as exc:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))
    if text == ERASED:
        log.warning("start of %s dropped: its input is erased (its subject was forgotten)", run_id)
        try:
            return Result("erased", None, lw.write(run_id, None), why="erased")
        except INFRA as exc:
            return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))
    return replace(rec, input_json=text, input_sealed=None)


def _not_dispatched(run_id: str, lease: Lease | None, batch: Batch | None) -> None:
    """The dispatch ends before opening its run: the lease taken for it is let go."""
    if lease is not None:
        lease.release()
    if batch is not None:
        batch.drop(run_id)


def execute(
    deps: RunDeps,
    lw: LifecycleWriter,
    run_id: str,
    rec: Record,
    agent: Agent,
    opening: threading.Semaphore | None = None,
    prefetch: Prefetch | None = None,
    lease: Lease | None = None,
    batch: Batch | None = None,
) -> Result:
    """Dispatch ``run_id`` once in this thread (a sync agent). ``opening``: the worker's
    bound on opens at once (``Worker.OPENING``); ``prefetch``: a pass over the run's
    partition made for many adopted runs at once (``Prefetch``); ``lease``: the run's
    lease when the worker took it already (``LeaseManager.acquire_dead``); ``batch``: the
    runs adopted with it, claimed together (``Batch``)."""
    opened = _opened(deps, lw, run_id, rec)
    if isinstance(opened, Result):
        _not_dispatched(run_id, lease, batch)
        return opened
    rec = opened
    try:
        with opening or contextlib.nullcontext():
            args = _open_args(deps, agent, rec, prefetch, lease, batch)
            run = open_run_with(deps, run_id, **args)
    except (RunLocked, TenantMismatch, AgentMismatch, UnknownRun, Fenced, *INFRA) as exc:
        return _not_opened(deps, lw, run_id, rec, exc)
    except Escalated:
        return _decided_meanwhile(
            deps, lw, _waiting_person(lw, run_id, rec.tenant, agent.name), run_id
        )
    run.dispatched = True
    try:
        if run.state.erased is not None:
            run.close()
            return _erased(lw, run_id)
        if run.state.status == "finished":
            run.close()
            return _finished(lw, run_id)
        summary = agent.fn(Run(run), _input(run.state.agent_input, rec))
        if not _is_finished(run):
            run.finish("succeeded", "" if summary is None else str(summary))
        return _finished(lw, run_id)
    except HandingOver:
        return _handed_over(lw, run, rec.tenant, agent.name)
    except Cancelled as exc:
        return _cancelled(lw, run, exc)
    except timers.TimerPending as wait:
        if run.state.cancel is not None:
            return _cancelled(lw, run, None)
        res = _waiting_until(lw, run_id, rec.tenant, agent.name, wait.due_at)
        run.close()
        return res
    except Escalated:
        if run.state.cancel is not None:
            return _cancelled(lw, run, None)
        res = _waiting_person(lw, run_id, rec.tenant, agent.name)
        run.close()
        return _decided_meanwhile(deps, lw, res, run_id)
    except RunFinished:
        run.close()
        return _finished(lw, run_id)
    except (Fenced, RunLocked) as exc:
        run.lease.release()
        return _fenced(deps, exc)
    except INFRA as exc:
        run.lease.release()
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))
    except Exception as exc:  # noqa: BLE001 - the agent's failure: recorded, the run ends
        return _agent_failed(lw, run, agent, rec, exc)
    finally:
        run.lease.release()


def _agent_failed(
    lw: LifecycleWriter, run: Engine, agent: Agent, rec: Record, exc: Exception
) -> Result:
    """The agent raised: a retry after its policy's delay, or the run ends failed; a run a
    person cancelled meanwhile ends cancelled (never retried), also when the retry's own
    record is the step that learns of the cancel."""
    if run.state.cancel is not None:
        return _cancelled(lw, run, exc)
    try:
        delay = _retry_or_fail_due(agent, run.state.timers)
        if delay is not None:
            nxt = timers.next_timer(run.state, 1 << 30, timers.RETRY)
            run.append(EventType.TIMER_STARTED, timers.payload(nxt.ordinal, delay, timers.RETRY))
            due = run.state.timers[nxt.ordinal].due_at
            log.warning("agent %s failed on %s (%s); retry at %s", agent.name, run.run_id, exc, due)
            res = _waiting_until(lw, run.run_id, rec.tenant, agent.name, due)
            run.close()
            return res
        log.warning("agent %s failed on %s: %s", agent.name, run.run_id, exc)
        run.finish("failed", _failure_text(exc))
        return _finished(lw, run.run_id)
    except Cancelled:
        return _cancelled(lw, run, exc)
    except (Fenced, RunLocked) as err:
        return _fenced(run.deps, err)
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))


async def execute_async(
    deps: RunDeps,
    aredis: aioredis.Redis,
    lw: LifecycleWriter,
    run_id: str,
    rec: Record,
    agent: Agent,
    opening: asyncio.Semaphore | None = None,
    prefetch: Prefetch | None = None,
    lease: Lease | None = None,
    batch: Batch | None = None,
) -> Result:
    """Dispatch ``run_id`` once in this event loop (an ``async def`` agent). ``opening``:
    the worker's bound on opens at once (``Worker.OPENING``); ``prefetch``, ``lease`` and
    ``batch`` as ``execute``'s."""
    opened = rec if rec.input_sealed is None else await in_thread(_opened, deps, lw, run_id, rec)
    if isinstance(opened, Result):
        await in_thread(_not_dispatched, run_id, lease, batch)
        return opened
    rec = opened
    try:
        claimed = None
        if batch is not None:
            # Its batch is opened by the worker's pool (``Worker._batch``): awaited here,
            # holding no thread and no bound of opens, then taken without blocking.
            await asyncio.wrap_future(batch.opened)
            claimed = batch.take(run_id)
        if claimed is not None:
            arun = AsyncRun(claimed, aredis)
        else:
            async with opening or contextlib.nullcontext():
                args = _open_args(deps, agent, rec, prefetch, lease)
                arun = await open_async(deps, aredis, run_id, recover=False, **args)
        await recover_opened(arun)
    except (RunLocked, TenantMismatch, AgentMismatch, UnknownRun, Fenced, *INFRA) as exc:
        return await in_thread(_not_opened, deps, lw, run_id, rec, exc)
    except Escalated:
        res = await in_thread(_waiting_person, lw, run_id, rec.tenant, agent.name)
        return await in_thread(_decided_meanwhile, deps, lw, res, run_id)
    run = engine_of(arun)
    run.dispatched = True
    try:
        if run.state.erased is not None:
            await arun.close()
            return await in_thread(_erased, lw, run_id)
        if run.state.status == "finished":
            await arun.close()
            return await in_thread(_finished, lw, run_id)
        summary = await agent.fn(arun, _input(run.state.agent_input, rec))
        if not _is_finished(run):
            await arun.finish("succeeded", "" if summary is None else str(summary))
        await arun.close()
        return await in_thread(_finished, lw, run_id)
    except HandingOver:
        return await in_thread(_handed_over, lw, run, rec.tenant, agent.name)
    except Cancelled as exc:
        return await in_thread(_cancelled, lw, run, exc)
    except timers.TimerPending as wait:
        if run.state.cancel is not None:
            return await in_thread(_cancelled, lw, run, None)
        res = await in_thread(_waiting_until, lw, run_id, rec.tenant, agent.name, wait.due_at)
        await arun.close()
        return res
    except Escalated:
        if run.state.cancel is not None:
            return await in_thread(_cancelled, lw, run, None)
        res = await in_thread(_waiting_person, lw, run_id, rec.tenant, agent.name)
        await arun.close()
        return await in_thread(_decided_meanwhile, deps, lw, res, run_id)
    except RunFinished:
        await arun.close()
        return await in_thread(_finished, lw, run_id)
    except (Fenced, RunLocked) as exc:
        await in_thread(run.lease.release)
        return _fenced(deps, exc)
    except INFRA as exc:
        await in_thread(run.lease.release)
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(exc))
    except Exception as exc:  # noqa: BLE001 - the agent's failure: recorded, the run ends
        return await _agent_failed_async(lw, arun, agent, rec, exc)
    finally:
        await in_thread(run.lease.release)


async def _agent_failed_async(
    lw: LifecycleWriter, arun: AsyncRun, agent: Agent, rec: Record, exc: Exception
) -> Result:
    run = engine_of(arun)
    if run.state.cancel is not None:
        return await in_thread(_cancelled, lw, run, exc)
    try:
        delay = _retry_or_fail_due(agent, run.state.timers)
        if delay is not None:
            nxt = timers.next_timer(run.state, 1 << 30, timers.RETRY)
            await arun.append(
                EventType.TIMER_STARTED, timers.payload(nxt.ordinal, delay, timers.RETRY)
            )
            due = run.state.timers[nxt.ordinal].due_at
            res = await in_thread(_waiting_until, lw, run.run_id, rec.tenant, agent.name, due)
            await arun.close()
            return res
        log.warning("agent %s failed on %s: %s", agent.name, run.run_id, exc)
        await arun.finish("failed", _failure_text(exc))
        await arun.close()
        return await in_thread(_finished, lw, run.run_id)
    except Cancelled:
        return await in_thread(_cancelled, lw, run, exc)
    except (Fenced, RunLocked) as err:
        return _fenced(run.deps, err)
    except INFRA as err:
        return Result("retry", retry_s=INFRA_RETRY_S, why=str(err))
