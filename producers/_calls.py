"""The tool-call path and the recovery of uncertain calls: one module, one set of rules.

A call goes STARTED (durable) -> the tool, with its idempotency key -> COMPLETED; anything
but a proven failure is UNCERTAIN and settled here by the same rules that settle, on the
next ``open_run``, a call whose owner died. Evidence first, then the risk class; every step
is an event.

A started call without a completion is uncertain, not failed. Recovery runs inside
``open_run`` before the model may act, and again whenever the live path meets an
uncertain outcome. Its decisions:

====================  ===========================================================
evidence              action
====================  ===========================================================
Match(result)         append a completion with source=reconciliation
Absent()              retry with the same key only if the tool's ``receiver`` makes the
                      absence final (``_absence``): dedupes_by_key; fenced, when the
                      lookup carried a token above every attempt's; deadline, once the
                      original request's deadline passed. A deadline still ahead is
                      waited for (then the lookup is asked again); a safe tool retries;
                      any other call goes to a person (a lookup can say "not yet",
                      never "never")
Conflict(detail)      stop the run; escalate to a person with both payloads; a
                      tool with ``compensate`` first undoes the conflicting effect
                      (a call of its own) and, once undone, retries with the key
Inconclusive(reason)  keep the call uncertain (absence of evidence is not permission)
no reconciler         safe: retry; reversible: retry, compensation may be needed;
                      irreversible: escalate to a person
person decided        approved: retry with the same key; rejected: close the call
                      with the person's note as its result (it is never executed again);
                      a tool with ``compensate`` first undoes what may have happened.
                      A rejection recorded without the tools (``runlog reject``, the
                      console) leaves a reversible call open: the next owner with its
                      tools undoes it, as recovery, and only then closes it
====================  ===========================================================

A compensation's key is bound to the effect it undoes (the call's key and the attempt
that made the effect), so each wrong effect gets an inverse of its own and a completion
says "compensated by K" only when the inverse K of that effect completed.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from runlog.errors import CallUncertain, Escalated, ToolFailed, UnknownTool
from runlog.producers import _timelines as timelines
from runlog.producers._approvals import record_decision, request_approval
from runlog.producers._bounds import bound_result
from runlog.producers._context import CallContext
from runlog.producers._ops import Steps, append, blocking, emit, invoke, lookup
from runlog.producers._tools import (
    Absent,
    Conflict,
    Evidence,
    Inconclusive,
    Match,
    Tool,
    ToolError,
)
from runlog.projections._run_state import OpenCall, inverse_completed
from runlog.schemas import _models as m
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import COMPENSATION_SUFFIX, compensation_name
from runlog.schemas._models import Event
from runlog.schemas._signing import Signature
from runlog.schemas._vocabulary import EventType

if TYPE_CHECKING:
    from runlog.producers._engine import Engine

log = logging.getLogger(__name__)


def call_tool(
    run: Engine,
    name: str,
    args: dict[str, Any],
    *,
    operation_id: str | None = None,
    call_id: str | None = None,
) -> Steps[str]:
    """Invoke a tool at most once per logical action; see docs/concepts/effects.md."""
    tool = run.tools.get(name)
    if tool is None:
        raise UnknownTool(f"run {run.run_id} has no tool {name!r}; pass it to open_run")
    yield from run.cancel_check()  # a person's cancellation stops the run before this call
    occurrence, args_json, key = run.next_call(name, args, operation_id)  # before STARTED
    call_id = call_id or f"call-{random.getrandbits(48):012x}"
    run.occurrences[occurrence] += 1
    try:
        return (
            yield from execute_logical(
                run, tool, args_json, key, call_id=call_id, operation_id=operation_id
            )
        )
    except BaseException:
        # No completed key (a proven failure, or unsettled: uncertain, escalated,
        # fenced): asking again must reach the same key. A fresh one would make a
        # retry-after-failure a *different* action, and a re-execution after a crash
        # would then recompute the failed key and run the effect a second time.
        run.occurrences[occurrence] -= 1
        raise


def execute_logical(
    run: Engine,
    tool: Tool,
    args_json: str,
    key: str,
    *,
    call_id: str,
    operation_id: str | None = None,
) -> Steps[str]:
    """``execute`` the call whose logical key is ``key`` (the key in the run's own scope).

    In a fork the logical key may name an effect of another timeline: inherited, asked
    about or repeated, as the fork was made to (``producers._timelines``), or a new action
    under the fork's own key. Elsewhere it is the key itself."""
    if run.state.lineage is not None:
        got = yield from timelines.resolve(run, tool, args_json, key, call_id=call_id)
        if isinstance(got, timelines.Inherited):
            return got.content
        key = got.key
    return (
        yield from execute(run, tool, args_json, key, call_id=call_id, operation_id=operation_id)
    )


def execute(
    run: Engine,
    tool: Tool,
    args_json: str,
    key: str,
    *,
    call_id: str,
    operation_id: str | None = None,
) -> Steps[str]:
    """Run the call with key ``key`` unless the log already settles it."""

    if key not in run.state.completed_calls:
        _stop_if_conflict(run)
    if key in run.state.completed_calls:
        return run.state.completed_calls[key]
    if key in run.state.open_calls:
        yield from recover_call(run, run.state.open_calls[key])
        return _settled(run, key)
    return (
        yield from attempt(
            run, tool, args_json, key, call_id=call_id, attempt=1, operation_id=operation_id
        )
    )


def decide(
    run: Engine,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    signature: Signature | None = None,
    queued: bool = False,
    answer: str | None = None,
) -> Steps[None]:
    """Record a person's decision; settle the call it concerns when it is open here.

    ``signature``: the decider's, for a decision that came through the inbox (``queued``:
    then this worker records it as received and never signs it itself).
    """
    key = yield from record_decision(
        run,
        approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        signature=signature,
        sign=not queued,
        answer=answer,
    )
    if key is not None and key in run.state.open_calls:
        yield from recover_call(run, run.state.open_calls[key])


def _stop_if_conflict(run: Engine) -> None:
    """A conflict stops the run: no effect of any call until a person decides.

    The run is stopped by the conflict's approval request, and also by a conflict
    whose request is not in the log yet (its writer died between the two appends):
    recovery then asks again, but nothing may run meanwhile.
    """
    conflict = [c for c in run.state.open_calls.values() if c.status == "conflict"]
    if run.state.status != "escalated" and not conflict:
        return
    pending = [a.approval_id for a in run.state.pending_approvals.values()]
    pending += [c.approval_id for c in conflict if c.approval_id is not None]
    raise Escalated(
        f"run {run.run_id} is stopped by a conflict awaiting a person",
        approval_id=pending[0] if pending else None,
        run_id=run.run_id,
    )


def _settled(run: Engine, key: str) -> str:
    if key in run.state.completed_calls:
        return run.state.completed_calls[key]
    call = run.state.open_calls.get(key)
    if call is None:
        raise ToolFailed(f"call {key} failed", run_id=run.run_id, seq=run.state.seq)
    if call.status in ("escalated", "conflict"):
        raise Escalated(
            f"call {call.name} ({key}) awaits a person's decision",
            approval_id=call.approval_id,
            run_id=run.run_id,
            seq=call.started_seq,
        )
    raise CallUncertain(
        f"outcome of {call.name} ({key}) is unknown: {call.last_evidence or call.last_error}",
        run_id=run.run_id,
        seq=call.started_seq,
    )


def attempt(
    run: Engine,
    tool: Tool,
    args_json: str,
    key: str,
    *,
    call_id: str,
    attempt: int,
    operation_id: str | None = None,
) -> Steps[str]:
    """STARTED -> invoke with the key -> COMPLETED, or UNCERTAIN and recovery.

    The barriers follow the effect model ("Barriers" in docs/concepts/runs-and-events.md):
    a ``safe`` call's STARTED and COMPLETED are pipelined (losing them can only repeat a
    harmless call, and the next barrier makes them durable in order); any other call's
    STARTED is durable and confirmed in the log before the tool runs, and its outcome is
    durable before it is returned.
    """

    _stop_if_conflict(run)
    record = emit if tool.risk == "safe" else append
    try:
        started = yield from record(
            EventType.TOOL_CALL_STARTED,
            call_id=call_id,
            name=tool.name,
            args_json=args_json,
            idempotency_key=key,
            attempt=attempt,
            risk=tool.risk,
            operation_id=operation_id,
            dedupes_by_key=tool.dedupes_by_key,
            compensable=tool.compensate is not None,
        )
        if tool.risk != "safe" and not run.confirmed_locally(started):
            yield from blocking(functools.partial(run.confirm_in_log, started))
    except GeneratorExit:
        raise
    except BaseException as exc:
        yield from _not_invoked(run, key, attempt, exc)
        raise
    t0 = time.monotonic()
    deadline = commit_deadline(started.occurred_at, tool)
    ctx = CallContext(run.run_id, run.tenant, run.epoch, key, attempt, started.seq, deadline)
    run.attempted.add(key)  # from here on a request under this owner's token may exist
    try:
        result = yield from invoke(tool, json.loads(args_json), ctx)
    except GeneratorExit:
        raise
    except ToolError as exc:
        if attempt > 1 and not run.state.open_calls[key].proven_absent:
            # Only a retry follows an attempt whose outcome nobody knows: this failure
            # proves that *this* attempt did nothing, not the earlier one. Closing the
            # call as failed would let a re-proposal run the key afresh with no one
            # asked, so it stays uncertain and the uncertain-call rules go on (unless
            # an authoritative lookup proved the earlier attempts absent: then this
            # failure is the whole truth).
            return (
                yield from _uncertain(
                    run,
                    started,
                    f"attempt {attempt} failed ({exc}); an earlier attempt's outcome "
                    "is still unknown",
                )
            )
        yield from _completed(record, started, str(exc), error=True, t0=t0)
        raise ToolFailed(str(exc), run_id=run.run_id, seq=started.seq) from exc
    except Exception as exc:  # noqa: BLE001 - anything but a proven failure is uncertain
        return (yield from _uncertain(run, started, f"{type(exc).__name__}: {exc}"))
    except BaseException as exc:
        # Interrupted (a task cancelled, ^C) while the tool had the request: its outcome
        # is unknown. Said so now, pipelined (the interruption is not held up); the next
        # barrier or owner settles the call by the recovery rules.
        yield from _pipelined_if_able(
            run,
            EventType.TOOL_CALL_UNCERTAIN,
            started_seq=started.seq,
            call_id=call_id,
            name=tool.name,
            idempotency_key=key,
            error=f"interrupted ({type(exc).__name__}) while the tool ran: outcome unknown",
            detected_by="live",
        )
        raise
    # What is recorded is what every later call with this key returns, so the live
    # caller gets the same (possibly cut) text as a re-execution after a crash.
    content = bound_result(str(result), key, tool.on_large_result)
    yield from _completed(record, started, content, error=False, t0=t0)
    return run.state.completed_calls.get(key, content)


def _not_invoked(run: Engine, key: str, attempt: int, exc: BaseException) -> Steps[None]:
    """``exc`` stopped the attempt before its tool was handed the request (a task cancelled
    or ^C in the STARTED's barrier or confirmation): in this process that is a proof that
    this attempt had no effect, so it is recorded (pipelined; the next barrier makes it
    durable after the STARTED) and a later owner reading the log reaches the same verdict.

    Like a proven failure it closes the call without a key, and asking again under the
    same key runs the tool once; a retry whose earlier attempts are still unknown stays
    uncertain instead (what ``attempt`` does with a ``ToolError`` on a retry). Only this
    process can give the proof: a writer killed here leaves a bare STARTED, which every
    reader takes as uncertain. A run that can no longer append (fenced, an append's
    outcome unknown) records nothing, and the call stays uncertain.
    """
    call = run.state.open_calls.get(key)
    if call is None or call.attempt != attempt or call.status != "started":
        return  # this attempt's STARTED was never emitted: nothing is open for it
    why = f"interrupted ({type(exc).__name__}) before the tool was called"
    if attempt > 1 and not call.proven_absent:
        yield from _pipelined_if_able(
            run,
            EventType.TOOL_CALL_UNCERTAIN,
            started_seq=call.started_seq,
            call_id=call.call_id,
            name=call.name,
            idempotency_key=key,
            error=f"attempt {attempt} was {why}; an earlier attempt's outcome is still unknown",
            detected_by="live",
        )
        return
    yield from _pipelined_if_able(
        run,
        EventType.TOOL_CALL_COMPLETED,
        call_id=call.call_id,
        name=call.name,
        started_seq=call.started_seq,
        content=f"not invoked: {why}",
        is_error=True,
        idempotency_key=None,
        source="live",
        duration_ms=0,
    )


def _pipelined_if_able(run: Engine, event_type: EventType, **payload: Any) -> Steps[None]:
    """Record what an interrupted attempt proves, without waiting (the interruption goes
    on at once), if the run can still append; else the call stays open, which every
    reader takes as uncertain (the safe side)."""
    try:
        yield from emit(event_type, **payload)
    except Exception as exc:  # noqa: BLE001 - the interruption is what the caller sees
        log.info("run %s: %s not recorded: %s", run.run_id, event_type.value, exc)


def _uncertain(run: Engine, started: Event, error: str) -> Steps[str]:
    """The live attempt's outcome is unknown: say so, then let the recovery rules decide."""
    p = started.payload
    assert isinstance(p, m.ToolCallStarted)
    yield from append(
        EventType.TOOL_CALL_UNCERTAIN,
        started_seq=started.seq,
        call_id=p.call_id,
        name=p.name,
        idempotency_key=p.idempotency_key,
        error=error,
        detected_by="live",
    )
    yield from recover_call(run, run.state.open_calls[p.idempotency_key])
    return _settled(run, p.idempotency_key)


def _completed(
    record: Callable[..., Steps[Event]], started: Event, content: str, *, error: bool, t0: float
) -> Steps[None]:
    """The live attempt's outcome. A proven failure carries no key, so the action may be
    tried again later."""
    p = started.payload
    assert isinstance(p, m.ToolCallStarted)
    yield from record(
        EventType.TOOL_CALL_COMPLETED,
        call_id=p.call_id,
        name=p.name,
        started_seq=started.seq,
        content=content,
        is_error=error,
        idempotency_key=None if error else p.idempotency_key,
        source="live",
        duration_ms=int((time.monotonic() - t0) * 1000),
    )


MAX_ATTEMPTS = 5
"""Attempts per key before recovery stops retrying and asks a person."""


def recover(run: Engine) -> Steps[None]:
    """Settle every open call of ``run`` that its tools allow settling now."""
    # Conflicts first: a conflict whose request was lost must stop the run before any
    # other call is retried.
    calls = sorted(run.state.open_calls.values(), key=lambda c: c.status != "conflict")
    for call in calls:
        if call.idempotency_key not in run.state.open_calls:
            continue
        if run.state.status == "escalated" and call.status != "conflict":
            log.info("run %s is stopped by a conflict; recovery waits for a person", run.run_id)
            return
        try:
            yield from recover_call(run, run.state.open_calls[call.idempotency_key])
        except (ToolFailed, CallUncertain, Escalated) as exc:
            # Recorded in the log already; open_run still returns the run.
            log.info("recovery of %s left it %s: %s", call.idempotency_key, type(exc).__name__, exc)


def _reconciliation(
    run: Engine, call: OpenCall, outcome: str, rule: str, action: str, evidence: str = ""
) -> Steps[None]:
    yield from append(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=call.started_seq,
        idempotency_key=call.idempotency_key,
        name=call.name,
        outcome=outcome,
        evidence=evidence,
        rule=rule,
        action=action,
    )


def _complete(run: Engine, call: OpenCall, content: str) -> Steps[None]:
    tool = run.tools.get(call.name)
    content = bound_result(content, call.idempotency_key, tool.on_large_result if tool else None)
    yield from append(
        EventType.TOOL_CALL_COMPLETED,
        call_id=call.call_id,
        name=call.name,
        started_seq=call.started_seq,
        content=content,
        is_error=False,
        idempotency_key=call.idempotency_key,
        source="reconciliation",
    )


def _escalate(
    run: Engine, call: OpenCall, kind: str, reason: str, detail: str | None
) -> Steps[None]:
    yield from request_approval(
        run,
        reason,
        kind=kind,
        deadline_s=run.deps.settings.approval_deadline_s,
        name=call.name,
        args_json=call.args_json,
        idempotency_key=call.idempotency_key,
        started_seq=call.started_seq,
        started_at=call.started_at,
        last_error=call.last_error,
        detail=detail,
    )


def _re_request(run: Engine, call: OpenCall) -> Steps[None]:
    if call.status == "conflict":
        found = (call.last_evidence or "").removeprefix("conflict: ")
        both = json.dumps({"intended": json.loads(call.args_json), "found": found}, sort_keys=True)
        yield from _escalate(run, call, "conflict", f"conflicting {call.name} effect found", both)
    else:
        reason = f"{call.name} may or may not have taken effect ({call.last_evidence or ''})"
        yield from _escalate(run, call, "uncertain_call", reason, None)


def _compensable(run: Engine, call: OpenCall) -> bool:
    """The call's tool has an inverse, and no inverse of an earlier effect of this call
    completed (a conflict that outlives its compensation is a person's to decide)."""
    tool = run.tools.get(call.name)
    if tool is None or tool.compensate is None:
        return False
    return not any(
        inverse_completed(run.state, _compensation_key(run, call, attempt))
        for attempt in range(1, call.attempt + 1)
    )


def _compensation_args(call: OpenCall) -> str:
    return canonical_json({"args": json.loads(call.args_json), "of": call.idempotency_key})


def _compensation_key(run: Engine, call: OpenCall, attempt: int | None = None) -> str:
    """The key of the inverse of the effect ``call``'s attempt ``attempt`` (default: its
    latest, the one whose effect recovery or a person is looking at) had.

    Bound to the effect it undoes: to the key of the call and, as the ordinal, to the
    attempt. Every retry of one inverse keeps its key (a receiver undoes that effect once);
    a later attempt that made a wrong effect again gets an inverse of its own, never one
    skipped as already done. The first attempt's inverse has ordinal 0, the key it always had.
    """
    n = call.attempt if attempt is None else attempt
    return run.idempotency_key(
        call.idempotency_key, compensation_name(call.name), _compensation_args(call), n - 1
    )


def _compensate(run: Engine, call: OpenCall) -> Steps[str | None]:
    """Run the inverse of the effect of ``call``'s latest attempt as a call of its own
    (started, completed, failed or uncertain, like any); returns its key once it
    completed, else None: "compensated" is recorded only for an effect actually undone."""
    inverse = run.tools[compensation_name(call.name)]
    key = _compensation_key(run, call)
    if key in run.state.completed_calls:
        # Settled: undone, or closed unrun by a person (never run again, undid nothing).
        return key if inverse_completed(run.state, key) else None
    try:
        if key in run.state.open_calls:
            yield from recover_call(run, run.state.open_calls[key])
        else:
            yield from attempt(
                run,
                inverse,
                _compensation_args(call),
                key,
                call_id=f"{call.call_id}{COMPENSATION_SUFFIX}",
                attempt=1,
                operation_id=call.idempotency_key,
            )
    except (ToolFailed, CallUncertain, Escalated) as exc:
        # Recorded already (a failed inverse closes with no key; an uncertain one is
        # escalated as its own call): the call it was to undo goes to a person.
        log.warning("compensation of %s did not complete: %s", call.idempotency_key, exc)
    return key if inverse_completed(run.state, key) else None


def _not_undone(run: Engine, call: OpenCall) -> str:
    """Why the effect of ``call`` is not known to be undone, for the person asked next."""
    key = _compensation_key(run, call)
    if key in run.state.completed_calls:
        return (
            f"the compensation of {call.name} ({key}) was closed by a person's rejection "
            "without evidence that it ran: nothing shows the effect was undone"
        )
    return f"the compensation of {call.name} did not complete"


def _retry(run: Engine, call: OpenCall, outcome: str, *, approved: bool = False) -> Steps[None]:
    """Retry with the same key; after ``MAX_ATTEMPTS`` a person decides (unless one did)."""
    tool = run.tools[call.name]
    if call.attempt >= MAX_ATTEMPTS and not approved:
        yield from _reconciliation(
            run,
            call,
            outcome,
            f"{call.attempt} attempts with this key; a person must decide",
            "escalate",
        )
        yield from _escalate(
            run, call, "uncertain_call", f"{call.attempt} attempts left it unsettled", None
        )
        return
    yield from attempt(
        run,
        tool,
        call.args_json,
        call.idempotency_key,
        call_id=call.call_id,
        attempt=call.attempt + 1,
        operation_id=call.operation_id,
    )


def recover_call(run: Engine, call: OpenCall) -> Steps[None]:
    """Take the next recovery step for ``call``: the module table, read top to bottom."""
    key = call.idempotency_key
    if key not in run.state.open_calls:
        return
    if not call.uncertain_recorded and call.status in ("started", "uncertain"):
        # The owner that started it died before recording an outcome.
        yield from append(
            EventType.TOOL_CALL_UNCERTAIN,
            started_seq=call.started_seq,
            call_id=call.call_id,
            name=call.name,
            idempotency_key=key,
            error="started but never completed: the previous owner stopped first",
            detected_by="recovery",
        )
        call = run.state.open_calls[key]
    tool = run.tools.get(call.name)
    if call.status == "decided":
        yield from _on_decision(run, call, tool)
    elif call.status in ("escalated", "conflict"):
        if call.approval_id is None:
            # Escalated by a reconciliation event whose approval request never followed
            # (the writer died between the two appends): without a request nobody can
            # decide it, so ask now, with what the reconciliation recorded.
            yield from _re_request(run, call)
        # otherwise it waits for a person
    elif tool is None:
        log.info("call %s (%s) stays uncertain: tool not given to open_run", key, call.name)
    elif tool.reconcile is not None:
        evidence = yield from _lookup(run, call, tool)
        yield from _ON_EVIDENCE[type(evidence)](run, call, tool, evidence)
    else:
        yield from _on_risk(run, call, tool)


def _lookup(run: Engine, call: OpenCall, tool: Tool) -> Steps[Evidence]:
    """The tool's reconciler's answer; a failing or buggy lookup is no evidence. It is
    asked with this owner's token (``ctx.epoch``): a fenced receiver raises its floor."""
    assert tool.reconcile is not None
    key = call.idempotency_key
    ctx = CallContext(run.run_id, run.tenant, run.epoch, key, call.attempt, call.started_seq)
    try:
        evidence = yield from lookup(tool, json.loads(call.args_json), ctx)
    except Exception as exc:  # noqa: BLE001 - a failing lookup is simply no evidence
        return Inconclusive(f"lookup raised {type(exc).__name__}: {exc}")
    if not isinstance(evidence, Match | Absent | Conflict | Inconclusive):
        # A reconciler bug is no evidence either; never let it block the run forever.
        return Inconclusive(f"reconciler returned {evidence!r}, not Match/Absent/...")
    return evidence


def _on_decision(run: Engine, call: OpenCall, tool: Tool | None) -> Steps[None]:
    """A person decided: approved retries with the same key; rejected closes the call
    (after undoing what may have happened, when the tool has an inverse)."""
    key = call.idempotency_key
    if call.decision and call.undo_first:
        if tool is not None:
            yield from _undo_and_retry(run, call, tool)
        # else: the inverse and the retry need the tools; the next owner with them does it
    elif call.decision:
        if tool is None:
            return  # the retry needs the tool; a worker that has it will do it
        yield from _reconciliation(
            run,
            call,
            "decided",
            f"{call.decided_by} approved a retry with the same key",
            "retry",
            call.decision_note,
        )
        yield from _retry(run, run.state.open_calls[key], "decided", approved=True)
    elif tool is None and call.risk == "reversible":
        # Recorded by someone without the tools at hand (``runlog reject``, the console):
        # a reversible effect may have an inverse, and closing the call now would leave a
        # wrong effect standing for good. The compensation stays owed: the call stays
        # open, decided, and the owner that next opens the run with its tools runs the
        # inverse as recovery, before anything else acts, then closes it.
        log.info("call %s was rejected; its compensation waits for its tools", key)
    elif tool is not None and tool.compensate is not None:
        yield from _reconciliation(
            run,
            call,
            "decided",
            f"{call.decided_by} ruled it must not stand: compensate, then close",
            "resolve",
            call.decision_note,
        )
        undone = yield from _compensate(run, run.state.open_calls[key])
        if undone is None:
            yield from _not_undone_to_a_person(
                run, key, "its compensation did not complete: a person must decide again"
            )
            return
        yield from _complete(
            run,
            run.state.open_calls[key],
            f"resolved by {call.decided_by}: {call.decision_note} (compensated by {undone})",
        )
    else:
        yield from _reconciliation(
            run,
            call,
            "decided",
            f"{call.decided_by} ruled it must not run again",
            "resolve",
            call.decision_note,
        )
        yield from _complete(
            run, run.state.open_calls[key], f"resolved by {call.decided_by}: {call.decision_note}"
        )


def _not_undone_to_a_person(run: Engine, key: str, why: str) -> Steps[None]:
    """A decided call whose inverse did not complete goes back to a person: the
    reconciliation says ``why``, and the call is escalated as uncertain again."""
    yield from _reconciliation(run, run.state.open_calls[key], "decided", why, "escalate")
    call = run.state.open_calls[key]
    yield from _escalate(run, call, "uncertain_call", _not_undone(run, call), None)


def retry_key(run: Engine, call: OpenCall) -> str:
    """The fresh key the call runs under after "undo and retry" undid its latest attempt:
    bound to the call's key and to that attempt, so a receiver that deduplicates by key
    makes the effect anew (the same key would return the undone one), and every retry
    of it (a crash, its own recovery) keeps it."""
    return run.idempotency_key(call.idempotency_key, call.name, call.args_json, call.attempt)


def _undo_and_retry(run: Engine, call: OpenCall, tool: Tool) -> Steps[None]:
    """A person chose "undo and retry": the inverse of what the latest attempt may have done
    runs as a call of its own (its own key, like any compensation); only once the log says
    it completed (``inverse_completed``) does the call run again, as a call of its own under
    a fresh key (``retry_key``), whose completion then closes this one with its result.
    An inverse that fails or whose outcome is lost goes back to a person, as compensation
    does. Each step is an event, so a crash anywhere resumes at the step that is next."""
    key = call.idempotency_key
    if tool.compensate is None:
        # The decision was taken from the log's declaration; the tool given here has no
        # inverse now, so nothing can be undone: back to a person.
        yield from _reconciliation(
            run,
            call,
            "decided",
            f"{call.decided_by} chose undo and retry, but {call.name} declares no inverse "
            "here: a person must decide again",
            "escalate",
            call.decision_note,
        )
        yield from _escalate(
            run, run.state.open_calls[key], "uncertain_call", f"{call.name} has no inverse", None
        )
        return
    inverse, fresh = _compensation_key(run, call), retry_key(run, call)
    if not inverse_completed(run.state, inverse):
        if inverse not in run.state.open_calls:
            yield from _reconciliation(
                run,
                call,
                "decided",
                f"{call.decided_by} chose undo and retry: run the inverse, then the call "
                f"again under the fresh key {fresh}",
                "retry_compensate",
                call.decision_note,
            )
        if (yield from _compensate(run, run.state.open_calls[key])) is None:
            yield from _not_undone_to_a_person(
                run,
                key,
                "its compensation did not complete: nothing is retried; a person must decide again",
            )
            return
    # The inverse is recorded completed: now, and only now, the call again.
    try:
        if fresh in run.state.open_calls:
            yield from recover_call(run, run.state.open_calls[fresh])
        elif fresh not in run.state.completed_calls:
            yield from attempt(
                run,
                tool,
                call.args_json,
                fresh,
                call_id=f"{call.call_id}-retry",
                attempt=1,
                operation_id=call.operation_id,
            )
    except ToolFailed as exc:
        # A proven failure of the retry: the effect is undone and not made again. The call
        # stays open for a person (asking again under its key could reach a receiver that
        # still remembers the undone effect by it).
        yield from _reconciliation(
            run,
            run.state.open_calls[key],
            "decided",
            f"the retry under {fresh} failed after the undo: a person must decide again",
            "escalate",
            str(exc),
        )
        yield from _escalate(
            run,
            run.state.open_calls[key],
            "uncertain_call",
            f"{call.name} was undone; its retry under {fresh} failed",
            None,
        )
        return
    except (CallUncertain, Escalated) as exc:
        # The retry is an uncertain call of its own, settled by its own rules; this call
        # closes once it completed.
        log.info("retry %s of %s is unsettled: %s", fresh, key, exc)
        return
    if fresh in run.state.completed_calls and key in run.state.open_calls:
        yield from _complete(run, run.state.open_calls[key], run.state.completed_calls[fresh])


def _on_match(run: Engine, call: OpenCall, tool: Tool, evidence: Evidence) -> Steps[None]:
    assert isinstance(evidence, Match)
    yield from _reconciliation(
        run,
        call,
        "match",
        "authoritative lookup found the same effect",
        "complete",
        evidence.result,
    )
    yield from _complete(run, run.state.open_calls[call.idempotency_key], evidence.result)


def commit_deadline(started_at: datetime, tool: Tool) -> datetime:
    """The deadline an attempt's request carries: its STARTED's occurred-at plus the tool's
    commit window. Derived from the log, so recovery computes the one the receiver got."""
    return started_at + timedelta(seconds=tool.commit_window_s)


CLOCK_MARGIN = timedelta(seconds=1)
"""How far the receiver's clock may lag this worker's: a deadline counts as passed only
this long after it, by our clock."""

MAX_DEADLINE_WAIT_S = 60.0
"""Recovery waits in place for a deadline at most this far ahead; a later one leaves the
call uncertain, and the next recovery of it asks again."""


@dataclass(frozen=True)
class _Absence:
    """What a lookup's ``Absent`` allows, by the tool's declaration."""

    action: Literal["retry", "wait", "escalate"]
    rule: str
    until: datetime | None = None


def _absence(run: Engine, call: OpenCall, tool: Tool, now: datetime) -> _Absence:
    """Whether ``Absent`` is final: only the receiver can stop the original request (still
    in flight from a paused or partitioned owner, or from this one) from landing after a
    retry. The tool's declared guarantees are tried in order; the first that makes the
    absence final allows the retry."""
    declared = tool.guarantees
    if "dedupes_by_key" in declared:
        return _Absence(
            "retry",
            "absent; the receiver deduplicates by key: a late original and the retry make "
            "one effect",
        )
    own = call.idempotency_key in run.attempted
    if "fenced" in declared and not own:
        return _Absence(
            "retry",
            f"absent; the receiver refuses tokens below {run.epoch}, and the lookup raised "
            "its floor to that token: every earlier request (an older token) can no longer "
            "commit",
        )
    if "deadline" in declared:
        until = commit_deadline(call.started_at, tool)
        if now >= until + CLOCK_MARGIN:
            return _Absence(
                "retry",
                f"absent after the original request's commit deadline {until.isoformat()}, "
                "which the receiver enforces: it can no longer commit",
            )
        return _Absence(
            "wait",
            f"absent now, but the original request may commit until its deadline "
            f"{until.isoformat()}, which the receiver enforces: ask again after it",
            until + CLOCK_MARGIN,
        )
    if tool.risk == "safe":
        return _Absence(
            "retry", "absent; risk=safe: a repeat is harmless even if the original lands late"
        )
    if "fenced" in declared:
        why = (
            f"the request in doubt was sent under this owner's own token {run.epoch}, so the "
            "lookup could not raise the receiver's floor above it"
        )
    else:
        why = (
            f"{tool.name} declares no receiver guarantee (fencing token, deadline or "
            "deduplication by key)"
        )
    return _Absence(
        "escalate",
        f"absent now, but {why}: the original request could still commit and a retry could "
        "make the effect twice; a person must decide",
    )


def _on_absent(run: Engine, call: OpenCall, tool: Tool, evidence: Evidence) -> Steps[None]:
    """Retry only on a final absence (``_absence``); otherwise wait for the deadline and
    ask again, or ask a person. The recorded rule says which applied, and why."""
    assert isinstance(evidence, Absent)
    key = call.idempotency_key
    verdict = _absence(run, call, tool, datetime.now(UTC))
    final_on_ended = verdict.action == "retry" and run.state.status == "finished"
    if final_on_ended:
        # The record says what is done: an ended run invokes nothing more, so the retry
        # the evidence allows is not made, and a person closes the call.
        verdict = _Absence(
            "escalate",
            f"{verdict.rule}; the run has ended, so nothing is retried: a person closes the call",
        )
    action = {"retry": "retry", "wait": "keep_uncertain", "escalate": "escalate"}[verdict.action]
    yield from _reconciliation(run, call, "absent", verdict.rule, action, evidence.evidence)
    call = run.state.open_calls[key]
    if verdict.action == "retry":
        yield from _retry(run, call, "absent")
    elif verdict.action == "escalate":
        reason = (
            f"{call.name} was absent at the lookup, but nothing stops its original request "
            f"(started {call.started_at.isoformat()}) from landing later"
        )
        if final_on_ended:
            reason = f"{call.name} was absent for good at the lookup; the run has ended"
        yield from _escalate(run, call, "uncertain_call", reason, None)
    else:
        assert verdict.until is not None
        left = (verdict.until - datetime.now(UTC)).total_seconds()
        if left > MAX_DEADLINE_WAIT_S:
            return  # stays uncertain; the next recovery of the call asks again
        # The request may still land meanwhile: the lookup after the deadline sees it.
        yield from blocking(functools.partial(time.sleep, max(left, 0.0)))
        if key in run.state.open_calls:
            yield from recover_call(run, run.state.open_calls[key])


def _on_conflict(run: Engine, call: OpenCall, tool: Tool, evidence: Evidence) -> Steps[None]:
    """Stop the run and ask a person with both payloads; a reversible tool with an inverse
    first undoes the conflicting effect and, once undone, retries with the key."""
    assert isinstance(evidence, Conflict)
    key = call.idempotency_key
    both = json.dumps(
        {"intended": json.loads(call.args_json), "found": evidence.detail}, sort_keys=True
    )
    if _compensable(run, call):
        yield from _reconciliation(
            run,
            call,
            "conflict",
            "a conflicting effect of a reversible tool: compensate it, then retry",
            "retry_compensate",
            evidence.detail,
        )
        if (yield from _compensate(run, run.state.open_calls[key])) is not None:
            yield from _retry(run, run.state.open_calls[key], "conflict")
            return
        yield from _reconciliation(
            run,
            run.state.open_calls[key],
            "conflict",
            "the compensation did not complete: a person must decide",
            "escalate",
            evidence.detail,
        )
        reason = f"conflicting {call.name} effect found; its compensation did not complete"
        yield from _escalate(run, run.state.open_calls[key], "conflict", reason, both)
        return
    yield from _reconciliation(
        run,
        call,
        "conflict",
        "an effect with this identity differs from the intended one",
        "escalate",
        evidence.detail,
    )
    yield from _escalate(
        run, run.state.open_calls[key], "conflict", f"conflicting {call.name} effect found", both
    )


def _on_inconclusive(run: Engine, call: OpenCall, tool: Tool, evidence: Evidence) -> Steps[None]:
    assert isinstance(evidence, Inconclusive)
    yield from _reconciliation(
        run,
        call,
        "unavailable",
        "no evidence either way: never retry on absence of evidence",
        "keep_uncertain",
        evidence.reason,
    )


def _on_risk(run: Engine, call: OpenCall, tool: Tool) -> Steps[None]:
    """No reconciler: the tool's risk class decides, by ``_BY_RISK``."""
    rule, action = _BY_RISK[tool.risk]
    yield from _reconciliation(run, call, "no_reconciler", rule, action)
    call = run.state.open_calls[call.idempotency_key]
    if action == "escalate":
        reason = f"{call.name} may or may not have taken effect"
        yield from _escalate(run, call, "uncertain_call", reason, None)
    else:
        yield from _retry(run, call, "no_reconciler")


# The module table as code: evidence first, then (without a lookup) the risk class.
_ON_EVIDENCE: dict[type, Callable[[Engine, OpenCall, Tool, Evidence], Steps[None]]] = {
    Match: _on_match,
    Absent: _on_absent,
    Conflict: _on_conflict,
    Inconclusive: _on_inconclusive,
}
_BY_RISK: dict[str, tuple[str, str]] = {
    "safe": ("risk=safe: repeating it is harmless", "retry"),
    "reversible": (
        "risk=reversible: retry; compensate if the first attempt also took effect",
        "retry_compensate",
    ),
    "irreversible": ("risk=irreversible without lookup: a person must decide", "escalate"),
}
"""Without a lookup: (the rule recorded, the action taken) per risk class."""
