"""Settling uncertain calls: evidence first, then the risk class; every step is an event.

A started call without a completion is uncertain, not failed. Recovery runs inside
``open_run`` before the model may act, and again whenever the live path meets an
uncertain outcome. Its decisions:

====================  ===========================================================
evidence              action
====================  ===========================================================
Match(result)         append a completion with source=reconciliation
Absent()              retry with the same key
Conflict(detail)      stop the run; escalate to a person with both payloads; a
                      tool with ``compensate`` first undoes the conflicting effect
                      (a call of its own) and, once undone, retries with the key
Unavailable(reason)   keep the call uncertain (absence of evidence is not permission)
no reconciler         safe: retry; reversible: retry, compensation may be needed;
                      irreversible: escalate to a person
person decided        approved: retry with the same key; rejected: close the call
                      with the person's note as its result (it is never executed again);
                      a tool with ``compensate`` first undoes what may have happened
====================  ===========================================================
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from runlog.errors import CallUncertain, Escalated, ToolFailed
from runlog.producers.bounds import bound_result
from runlog.producers.context import CallContext, call_context
from runlog.producers.tools import Absent, Conflict, Match, Unavailable
from runlog.projections.run_state import OpenCall
from runlog.schemas.canonical import canonical_json
from runlog.schemas.keys import COMPENSATION_SUFFIX, compensation_name
from runlog.schemas.vocabulary import EventType

if TYPE_CHECKING:
    from runlog.producers.run import Run

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
"""Attempts per key before recovery stops retrying and asks a person."""


def recover(run: Run) -> None:
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
            recover_call(run, run.state.open_calls[call.idempotency_key])
        except (ToolFailed, CallUncertain, Escalated) as exc:
            # Recorded in the log already; open_run still returns the run.
            log.info("recovery of %s left it %s: %s", call.idempotency_key, type(exc).__name__, exc)


def _reconciliation(
    run: Run, call: OpenCall, outcome: str, rule: str, action: str, evidence: str = ""
) -> None:
    run.append(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=call.started_seq,
        idempotency_key=call.idempotency_key,
        name=call.name,
        outcome=outcome,
        evidence=evidence,
        rule=rule,
        action=action,
    )


def _complete(run: Run, call: OpenCall, content: str) -> None:
    tool = run.tools.get(call.name)
    content = bound_result(content, call.idempotency_key, tool.on_large_result if tool else None)
    run.append(
        EventType.TOOL_CALL_COMPLETED,
        call_id=call.call_id,
        name=call.name,
        started_seq=call.started_seq,
        content=content,
        is_error=False,
        idempotency_key=call.idempotency_key,
        source="reconciliation",
    )


def _escalate(run: Run, call: OpenCall, kind: str, reason: str, detail: str | None) -> None:
    run.request_approval(
        reason,
        kind=kind,
        name=call.name,
        args_json=call.args_json,
        idempotency_key=call.idempotency_key,
        started_seq=call.started_seq,
        started_at=call.started_at,
        last_error=call.last_error,
        detail=detail,
    )


def _re_request(run: Run, call: OpenCall) -> None:
    if call.status == "conflict":
        found = (call.last_evidence or "").removeprefix("conflict: ")
        both = json.dumps({"intended": json.loads(call.args_json), "found": found}, sort_keys=True)
        _escalate(run, call, "conflict", f"conflicting {call.name} effect found", both)
    else:
        reason = f"{call.name} may or may not have taken effect ({call.last_evidence or ''})"
        _escalate(run, call, "uncertain_call", reason, None)


def _compensable(run: Run, call: OpenCall) -> bool:
    """The call's tool has an inverse, and no earlier inverse of this call completed (a
    conflict that outlives its compensation is a person's to decide)."""
    tool = run.tools.get(call.name)
    if tool is None or tool.compensate is None:
        return False
    return _compensation_key(run, call) not in run.state.completed_calls


def _compensation_args(call: OpenCall) -> str:
    return canonical_json({"args": json.loads(call.args_json), "of": call.idempotency_key})


def _compensation_key(run: Run, call: OpenCall) -> str:
    # Scoped by the key it undoes: one inverse per call, the same key on every retry of it.
    return run.idempotency_key(
        call.idempotency_key, compensation_name(call.name), _compensation_args(call), 0
    )


def _compensate(run: Run, call: OpenCall) -> str | None:
    """Run the inverse of ``call``'s effect as a call of its own (started, completed,
    failed or uncertain, like any); returns its key once it completed, else None."""
    inverse = run.tools[compensation_name(call.name)]
    key = _compensation_key(run, call)
    if key in run.state.completed_calls:
        return key
    try:
        if key in run.state.open_calls:
            recover_call(run, run.state.open_calls[key])
        else:
            run.attempt(
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
    return key if key in run.state.completed_calls else None


def _retry(run: Run, call: OpenCall, outcome: str, *, approved: bool = False) -> None:
    """Retry with the same key; after ``MAX_ATTEMPTS`` a person decides (unless one did)."""
    tool = run.tools[call.name]
    if call.attempt >= MAX_ATTEMPTS and not approved:
        _reconciliation(
            run,
            call,
            outcome,
            f"{call.attempt} attempts with this key; a person must decide",
            "escalate",
        )
        _escalate(run, call, "uncertain_call", f"{call.attempt} attempts left it unsettled", None)
        return
    run.attempt(
        tool,
        call.args_json,
        call.idempotency_key,
        call_id=call.call_id,
        attempt=call.attempt + 1,
        operation_id=call.operation_id,
    )


def recover_call(run: Run, call: OpenCall) -> None:
    """Take the next recovery step for ``call`` (see the module table)."""
    key = call.idempotency_key
    if key not in run.state.open_calls:
        return
    if not call.uncertain_recorded and call.status in ("started", "uncertain"):
        # The owner that started it died before recording an outcome.
        run.append(
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
        if tool is None and call.decision:
            return  # the retry needs the tool; a worker that has it will do it
        if call.decision:
            _reconciliation(
                run,
                call,
                "decided",
                f"{call.decided_by} approved a retry with the same key",
                "retry",
                call.decision_note,
            )
            _retry(run, run.state.open_calls[key], "decided", approved=True)
        elif tool is not None and tool.compensate is not None:
            # The person ruled the effect must not stand, and its author gave an inverse:
            # undo whatever may have happened, then close the call.
            _reconciliation(
                run,
                call,
                "decided",
                f"{call.decided_by} ruled it must not stand: compensate, then close",
                "resolve",
                call.decision_note,
            )
            undone = _compensate(run, run.state.open_calls[key])
            if undone is None:
                _reconciliation(
                    run,
                    run.state.open_calls[key],
                    "decided",
                    "its compensation did not complete: a person must decide again",
                    "escalate",
                )
                _escalate(
                    run,
                    run.state.open_calls[key],
                    "uncertain_call",
                    f"the compensation of {call.name} did not complete",
                    None,
                )
                return
            _complete(
                run,
                run.state.open_calls[key],
                f"resolved by {call.decided_by}: {call.decision_note} (compensated by {undone})",
            )
        else:
            _reconciliation(
                run,
                call,
                "decided",
                f"{call.decided_by} ruled it must not run again",
                "resolve",
                call.decision_note,
            )
            _complete(
                run,
                run.state.open_calls[key],
                f"resolved by {call.decided_by}: {call.decision_note}",
            )
        return
    if call.status in ("escalated", "conflict"):
        if call.approval_id is None:
            # Escalated by a reconciliation event whose approval request never followed
            # (the writer died between the two appends): without a request nobody can
            # decide it, so ask now, with what the reconciliation recorded.
            _re_request(run, call)
        return  # waiting for a person
    if tool is None:
        log.info("call %s (%s) stays uncertain: tool not given to open_run", key, call.name)
        return

    args = json.loads(call.args_json)
    if tool.reconcile is not None:
        ctx = CallContext(run.run_id, run.tenant, run.epoch, key, call.attempt, call.started_seq)
        try:
            with call_context(ctx):
                evidence = tool.reconcile(args, idempotency_key=key)
        except Exception as exc:  # noqa: BLE001 - a failing lookup is simply no evidence
            evidence = Unavailable(f"lookup raised {type(exc).__name__}: {exc}")
        if not isinstance(evidence, Match | Absent | Conflict | Unavailable):
            # A reconciler bug is no evidence either; never let it block the run forever.
            evidence = Unavailable(f"reconciler returned {evidence!r}, not Match/Absent/...")
        if isinstance(evidence, Match):
            _reconciliation(
                run,
                call,
                "match",
                "authoritative lookup found the same effect",
                "complete",
                evidence.result,
            )
            _complete(run, run.state.open_calls[key], evidence.result)
        elif isinstance(evidence, Absent):
            _reconciliation(
                run,
                call,
                "absent",
                "authoritative absence and the original request can no longer commit",
                "retry",
                evidence.evidence,
            )
            _retry(run, run.state.open_calls[key], "absent")
        elif isinstance(evidence, Conflict) and _compensable(run, call):
            _reconciliation(
                run,
                call,
                "conflict",
                "a conflicting effect of a reversible tool: compensate it, then retry",
                "retry_compensate",
                evidence.detail,
            )
            if _compensate(run, run.state.open_calls[key]) is not None:
                _retry(run, run.state.open_calls[key], "conflict")
                return
            _reconciliation(
                run,
                run.state.open_calls[key],
                "conflict",
                "the compensation did not complete: a person must decide",
                "escalate",
                evidence.detail,
            )
            both = json.dumps({"intended": args, "found": evidence.detail}, sort_keys=True)
            _escalate(
                run,
                run.state.open_calls[key],
                "conflict",
                f"conflicting {call.name} effect found; its compensation did not complete",
                both,
            )
        elif isinstance(evidence, Conflict):
            _reconciliation(
                run,
                call,
                "conflict",
                "an effect with this identity differs from the intended one",
                "escalate",
                evidence.detail,
            )
            both = json.dumps({"intended": args, "found": evidence.detail}, sort_keys=True)
            _escalate(
                run,
                run.state.open_calls[key],
                "conflict",
                f"conflicting {call.name} effect found",
                both,
            )
        elif isinstance(evidence, Unavailable):
            _reconciliation(
                run,
                call,
                "unavailable",
                "no evidence either way: never retry on absence of evidence",
                "keep_uncertain",
                evidence.reason,
            )
        else:  # pragma: no cover - normalised above
            raise AssertionError(evidence)
        return

    if tool.risk == "safe":
        _reconciliation(run, call, "no_reconciler", "risk=safe: repeating it is harmless", "retry")
        _retry(run, run.state.open_calls[key], "no_reconciler")
    elif tool.risk == "reversible":
        _reconciliation(
            run,
            call,
            "no_reconciler",
            "risk=reversible: retry; compensate if the first attempt also took effect",
            "retry_compensate",
        )
        _retry(run, run.state.open_calls[key], "no_reconciler")
    else:
        _reconciliation(
            run,
            call,
            "no_reconciler",
            "risk=irreversible without lookup: a person must decide",
            "escalate",
        )
        _escalate(
            run,
            run.state.open_calls[key],
            "uncertain_call",
            f"{call.name} may or may not have taken effect",
            None,
        )
