"""Operators stop runs: a cooperative cancel and a terminate that needs no cooperation.

**Cancel** records a person's request in the run's log (RUN_CANCEL_REQUESTED: who, why,
when), by the decision path's mechanism: directly when no one holds the run (taking it is
the person's act, not a resumption), else through the owner's inbox, which the owner reads
at its next step and records (``Engine.cancel_check``). The owner then raises
``Cancelled`` into the agent, which may clean up, and the run ends ``cancelled``. A run
nobody holds shows as cancelling until it is next opened. Open calls are never closed by a
cancellation: they stay governed by the recovery rules.

**Terminate** takes the run at once with a higher epoch (a takeover: the owner's lease is
broken, so its next append is fenced and it never invokes another tool), and records the
run ended ``terminated`` with a person's reason. Its open calls are left open, listed for
reconciliation (``runlog show``, the console, the uncertain-call queue).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from runlog.errors import Fenced, RunFinished, UnknownRun
from runlog.producers._approvals import cancel_entry, cancel_flag_key, decisions_key, record_cancel
from runlog.producers._engine import TERMINATED, RunDeps
from runlog.producers._opening import decision_inbox, open_run_with, read_state, take_if_free
from runlog.producers._ops import drive
from runlog.projections._run_state import OpenCall, RunState
from runlog.schemas._keys import check_run_id, check_tenant
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0
"""How long ``request_cancel`` watches the log for a queued request to be recorded."""


def check_words(reason: str, by: str) -> None:
    if not reason.strip():
        raise ValueError("a reason is required: it is recorded with the request")
    if not by.strip():
        raise ValueError("who asks is required (by): it is recorded with the request")


def known_state(deps: RunDeps, tenant: str, run_id: str) -> RunState:
    """The run's state from its log; another tenant's run is refused as unknown."""
    check_run_id(run_id)
    check_tenant(tenant)
    state = read_state(deps, tenant, run_id)
    if not state.run_id or state.tenant != tenant:
        raise UnknownRun(f"no run {run_id} for tenant {tenant}", run_id=run_id)
    return state


def _ended(state: RunState) -> RunFinished:
    return RunFinished(
        f"run {state.run_id} already ended: {state.outcome}"
        + (f" ({state.summary})" if state.summary else ""),
        run_id=state.run_id,
        seq=state.seq,
    )


def request_cancel(
    deps: RunDeps,
    run_id: str,
    *,
    tenant: str,
    reason: str,
    by: str,
    wait_s: float = CANCEL_WAIT_S,
    wake: Callable[[RunState], None] | None = None,
) -> str:
    """Record a person's cancellation of ``run_id``.

    ``wake``: called with the run's state once the request stands (recorded, queued or
    already there) and the run is not over: the fleet's composition root passes one that
    dispatches a run of the fleet (one waiting for a person or a time holds no worker, so
    nobody would see the request otherwise).

    Returns ``"recorded"`` (the request is in the log: this call appended it, or the owner
    did within ``wait_s``), ``"queued"`` (it waits in the owner's inbox: the owner records
    it at its next step, or the next owner when it opens the run) or ``"already"`` (a
    cancellation stands; the first one is kept). Raises ``RunFinished`` when the run has
    ended (nothing to cancel), ``UnknownRun`` for a run this tenant does not have.
    """
    check_words(reason, by)
    state = known_state(deps, tenant, run_id)
    if state.status == "finished":
        raise _ended(state)
    if wake is not None:
        how = _request_cancel(deps, state, tenant=tenant, reason=reason, by=by, wait_s=wait_s)
        if state.agent_name is not None:
            wake(state)
        return how
    return _request_cancel(deps, state, tenant=tenant, reason=reason, by=by, wait_s=wait_s)


def _request_cancel(
    deps: RunDeps, state: RunState, *, tenant: str, reason: str, by: str, wait_s: float
) -> str:
    run_id = state.run_id
    if state.cancel is not None:
        return "already"
    key = decisions_key(deps, tenant, run_id)
    flag = cancel_flag_key(deps, tenant, run_id)
    entry = cancel_entry(by, reason)
    why = f"cancel requested by {by}"

    def record_if_free() -> bool | None:
        """True/False: the run was free and this call recorded (or found) the request;
        None: someone holds it."""
        run = take_if_free(deps, run_id, tenant=tenant, reason=why, by=by)
        if run is None:
            return None
        with run:
            if run.state.status == "finished":
                raise _ended(run.state)
            return drive(run, record_cancel(run, by, reason))

    try:
        took = record_if_free()
    except Fenced:
        took = None  # a terminate (or another owner) took it meanwhile: read the log below
    if took is not None:
        return "recorded" if took else "already"

    def push() -> None:
        pipe = deps.redis.pipeline(transaction=True)
        pipe.rpush(key, entry)
        pipe.set(flag, "1")
        pipe.execute()

    decision_inbox(deps, run_id, push)
    deadline = time.monotonic() + wait_s
    while True:
        state = read_state(deps, tenant, run_id)
        if state.cancel is None and state.status != "finished":
            try:
                took = record_if_free()
            except (Fenced, RunFinished):
                took = None
            if took is not None:
                state = read_state(deps, tenant, run_id)
        if state.cancel is not None:
            return "recorded"
        if state.status == "finished":
            # Ended before anyone recorded the request: it has nothing left to stop.
            decision_inbox(deps, run_id, functools.partial(deps.redis.lrem, key, 1, entry))
            raise _ended(state)
        if time.monotonic() >= deadline:
            return "queued"
        time.sleep(0.1)


@dataclass(frozen=True)
class Termination:
    """What ``terminate`` recorded: the run's end and the calls left for reconciliation."""

    run_id: str
    epoch: int
    """The epoch that fenced the previous owner."""
    seq: int
    """Seq of the RUN_FINISHED ``terminated``."""
    open_calls: list[OpenCall]
    agent: str | None = None
    """The agent the run was started for (a run of the fleet), else None."""


def terminate(deps: RunDeps, run_id: str, *, tenant: str, reason: str, by: str) -> Termination:
    """End ``run_id`` now, without its owner's cooperation: take it with a higher epoch
    (the owner is fenced at its next append) and record RUN_FINISHED ``terminated``.

    Nothing is recovered and no tool is called: the open calls stay open, listed in the
    result (and by ``runlog show``) for reconciliation. Raises ``RunFinished`` when the
    run has already ended (a cancel or another terminate may have won a race), and
    ``Fenced`` if yet another owner took the run between the takeover and the record.
    """
    check_words(reason, by)
    state = known_state(deps, tenant, run_id)
    if state.status == "finished":
        raise _ended(state)
    run = open_run_with(
        deps,
        run_id,
        tenant=tenant,
        wait_s=0,
        recover=False,
        create=False,
        takeover=True,
        reason=f"terminate by {by}: {reason}",
        operator=by,
    )
    with run:
        if run.state.status == "finished":
            raise _ended(run.state)
        ev = run.append(
            EventType.RUN_FINISHED, outcome=TERMINATED, summary=f"terminated by {by}: {reason}"
        )
        if not run.confirmed_locally(ev):
            run.confirm_in_log(ev)
        calls = sorted(run.state.open_calls.values(), key=lambda c: c.started_seq)
        log.warning(
            "run %s terminated by %s at epoch %s (%s); %d open call(s) left to reconcile",
            run_id,
            by,
            run.epoch,
            reason,
            len(calls),
        )
        return Termination(run_id, run.epoch, ev.seq, calls, run.state.agent_name)
