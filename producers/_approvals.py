"""Approvals and decisions: requests a person answers, and the decisions that settle them.

A decision is recorded by whoever holds the run: directly when it is free (taking it is an
ownership change like any other), else through the owner's inbox in Redis, which the owner
reads before it acts (``open_run`` and the agent loop's waits).

A person's cancellation (``runlog cancel``) travels the same way, through the same inbox:
an entry of kind ``cancel``, plus a flag key the owner reads at each step (one GET), so it
learns of the request before its next model turn or tool call (the engine's step check,
``Engine.cancel_check``, which comes here only when the flag is set: ``poll_cancel``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from runlog.errors import (
    CallUncertain,
    DecisionConflict,
    Escalated,
    NotADecider,
    RedisUnavailable,
    ToolFailed,
)
from runlog.log import _copies as copies
from runlog.log._authority import signer_for
from runlog.log._clients import REDIS_ERRORS
from runlog.producers._ops import Steps, append, blocking
from runlog.projections._run_state import Approval, decision_text, standing_decision
from runlog.schemas._codec import now_utc
from runlog.schemas._models import ANSWERS
from runlog.schemas._signing import DecisionAuthority, Signature, decision_message
from runlog.schemas._vocabulary import EventType

if TYPE_CHECKING:
    from runlog.producers._engine import Engine, RunDeps

log = logging.getLogger(__name__)


def request_approval(
    run: Engine,
    reason: str,
    *,
    kind: str = "action",
    deadline_s: float | None = None,
    **fields: Any,
) -> Steps[str]:
    """Append APPROVAL_REQUESTED; its id. ``deadline_s``: the decision is due that many
    seconds from now, recorded as an absolute time (``due_at``, UTC) on the request."""
    approval_id = f"ap-{uuid.uuid4().hex[:12]}"
    if deadline_s is not None:
        fields["due_at"] = due_at(deadline_s)
    yield from append(
        EventType.APPROVAL_REQUESTED,
        approval_id=approval_id,
        kind=kind,
        reason=reason,
        **fields,
    )
    return approval_id


def due_at(deadline_s: float) -> datetime:
    """``deadline_s`` from now, in UTC; ``ValueError`` unless it is a positive number."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        raise ValueError(f"deadline_s must be a number of seconds, not {deadline_s!r}")
    if not math.isfinite(deadline_s) or deadline_s <= 0:
        raise ValueError(f"deadline_s must be a positive number of seconds, not {deadline_s!r}")
    return now_utc() + timedelta(seconds=deadline_s)


def sign_decision(
    deps: RunDeps,
    tenant: str,
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str,
    answer: str | None = None,
) -> Signature | None:
    """This process' signature of a decision, when it holds a decider key (else None).

    Called where a person decides (the CLI, the console, ``runlog.decide``, ``Run.decide``
    by a decider's code); a worker applying a queued decision passes the signature it
    received instead and never signs.
    """
    signer = signer_for(deps.settings)
    if signer is None:
        return None
    return signer.sign_decision(
        run_id=run_id,
        tenant=tenant,
        approval_id=approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        decided_at=datetime.now(UTC).isoformat(timespec="microseconds"),
        answer=answer,
    )


def refuse_forged(
    authority: DecisionAuthority,
    tenant: str,
    run_id: str,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str,
    signature: Signature | None,
    answer: str | None = None,
) -> None:
    """Raise ``NotADecider`` if readers trusting ``authority`` would reject this decision:
    it is refused where it is made rather than appended as a forgery."""
    if not authority.enforcing:
        return
    message = decision_message(
        run_id=run_id,
        tenant=tenant,
        approval_id=approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        decided_at=None if signature is None else signature.decided_at,
        answer=answer,
    )
    verdict = authority.verdict(
        message,
        None if signature is None else signature.key_id,
        None if signature is None else signature.signature,
    )
    if not verdict.accepted:
        raise NotADecider(
            f"decision on {approval_id} of run {run_id} by {decided_by}: {verdict.why}; "
            "decisions are signed with a decider's key (RUNLOG_DECIDER_KEY_FILE), which "
            "workers never hold",
            run_id=run_id,
        )


def record_decision(
    run: Engine,
    approval_id: str,
    *,
    approved: bool,
    decided_by: str,
    note: str = "",
    signature: Signature | None = None,
    sign: bool = True,
    answer: str | None = None,
) -> Steps[str | None]:
    """Append a person's decision; the key of the call it concerns, if any (the caller
    settles that call: ``calls.decide``).

    The first valid decision stands: on a decided approval this refuses with
    ``DecisionConflict`` and appends nothing. The decision counts once the log's order
    says so (read back to it, like an irreversible call's STARTED), not when Redis says
    this worker still owns the run: Redis can go back in time, and a stale owner's record
    is fenced in the log; ``Fenced`` then, and the caller must not drop the decision.
    """
    if approval_id not in run.state.approvals:
        raise KeyError(f"run {run.run_id} has no approval request {approval_id!r}")
    check_answer(approved, answer)
    standing = standing_decision(run.state, approval_id)
    if standing is not None:
        raise conflict(run.run_id, standing)
    if signature is None and sign:
        signature = sign_decision(
            run.deps,
            run.tenant,
            run.run_id,
            approval_id,
            approved=approved,
            decided_by=decided_by,
            note=note,
            answer=answer,
        )
    refuse_forged(
        run.state.authority,
        run.tenant,
        run.run_id,
        approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        signature=signature,
        answer=answer,
    )
    signed = signature.fields() if signature is not None else {}
    ev = yield from append(
        EventType.APPROVAL_DECIDED,
        approval_id=approval_id,
        approved=approved,
        decided_by=decided_by,
        note=note,
        answer=answer,
        **signed,
    )
    if not run.confirmed_locally(ev):
        yield from blocking(functools.partial(run.confirm_in_log, ev))
    return run.state.approvals[approval_id].idempotency_key


def check_answer(approved: bool, answer: str | None) -> None:
    """``ValueError`` unless ``answer`` is one a reader knows, with the ``approved`` it
    goes with ("undo and retry" is an approval: the call runs again, after its undo)."""
    if answer is None:
        return
    if answer not in ANSWERS:
        raise ValueError(f"unknown answer {answer!r}; known: {sorted(ANSWERS)}")
    if not approved:
        raise ValueError(f"answer {answer!r} approves a retry: approved must be true")


def conflict(run_id: str, standing: Approval) -> DecisionConflict:
    return DecisionConflict(
        decision_text(
            standing.approval_id,
            standing.decided_by,
            standing.approved,
            standing.note,
            None,
            standing.answer,
        ),
        approval_id=standing.approval_id,
        decided_by=standing.decided_by or "",
        approved=bool(standing.approved),
        note=standing.note,
        run_id=run_id,
        answer=standing.answer,
    )


def poll_decisions(run: Engine, decide: Callable[..., Steps[None]]) -> Steps[int]:
    """Record decisions people submitted while this worker held the lease.

    An entry is removed only after its APPROVAL_DECIDED is valid in the log's order
    (``record_decision`` reads back to it), so a crash, or a stale owner fenced in the log
    though Redis vouched for it, leaves it for the next owner, which records it or finds it
    already decided (the first valid decision stands) and drops it.
    """
    key = inbox_key(run)
    entries, run.inbox = run.inbox, None
    if entries is None:
        entries = yield from blocking(functools.partial(_entries, run, key))
    recorded = 0
    for raw in entries:
        cancel = cancel_of(raw)
        if cancel is not None:
            yield from record_cancel(run, *cancel)
            yield from blocking(functools.partial(_done, run, key, raw))
            continue
        try:
            d = json.loads(raw)
            approval_id, approved = str(d["approval_id"]), bool(d["approved"])
            decided_by, note = str(d["decided_by"]), str(d.get("note", ""))
            answer = None if d.get("answer") is None else str(d["answer"])
            check_answer(approved, answer)
            signature = Signature.from_fields(d)  # the decider's; a worker never signs
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Never lose it, never let it block the run: keep it aside for a person.
            log.warning("malformed decision for %s set aside: %r (%s)", run.run_id, raw, exc)
            yield from blocking(functools.partial(_set_aside, run, key, raw))
            continue
        approval = run.state.approvals.get(approval_id)
        standing = standing_decision(run.state, approval_id)
        if standing is not None and (
            standing.decided_by,
            standing.approved,
            standing.note,
            standing.answer,
        ) != (decided_by, approved, note, answer):
            # The first valid decision stands; this one's decider was told if it waited.
            log.warning(
                "decision by %s on %s of %s dropped: %s",
                decided_by,
                approval_id,
                run.run_id,
                decision_text(
                    approval_id, standing.decided_by, standing.approved, standing.note, None
                ),
            )
        if approval is not None and standing is None:
            try:
                yield from decide(
                    run,
                    approval_id,
                    approved=approved,
                    decided_by=decided_by,
                    note=note,
                    signature=signature,
                    queued=True,
                    answer=answer,
                )
            except NotADecider as exc:
                # Forged or unsigned while the readers trust decider keys: never recorded.
                log.warning("decision on %s of %s set aside: %s", approval_id, run.run_id, exc)
                yield from blocking(functools.partial(_set_aside, run, key, raw))
                continue
            except (ToolFailed, CallUncertain, Escalated) as exc:
                # The decision is durable; what its retry led to is in the log too.
                log.info("decision %s on %s settled as %s", approval_id, run.run_id, exc)
            recorded += 1
        yield from blocking(functools.partial(_done, run, key, raw))
    return recorded


# ---------------------------------------------------------------------------- cancellation

CANCEL = "cancel"
"""The ``kind`` of an inbox entry that asks the run to stop (a decision has none)."""


def cancel_entry(requested_by: str, reason: str) -> str:
    """The inbox entry of a person's cancellation."""
    return json.dumps(
        {"kind": CANCEL, "requested_by": requested_by, "reason": reason}, sort_keys=True
    )


def cancel_of(raw: bytes | str) -> tuple[str, str] | None:
    """``(requested_by, reason)`` of a cancellation entry; None for anything else."""
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("kind") != CANCEL:
        return None
    return str(d.get("requested_by", "")), str(d.get("reason", ""))


def record_cancel(run: Engine, requested_by: str, reason: str) -> Steps[bool]:
    """Append RUN_CANCEL_REQUESTED unless a cancellation stands or the run ended; True if
    this call appended it. It counts once the log's order says so (read back to it), like
    a decision: a stale owner's record is fenced there (``Fenced``)."""
    if run.state.cancel is not None or run.state.status == "finished":
        return False
    ev = yield from append(EventType.RUN_CANCEL_REQUESTED, requested_by=requested_by, reason=reason)
    if not run.confirmed_locally(ev):
        yield from blocking(functools.partial(run.confirm_in_log, ev))
    log.info("run %s: cancellation by %s recorded (%s)", run.run_id, requested_by, reason)
    return True


def poll_cancel(run: Engine) -> Steps[None]:
    """Record the cancellation waiting in the inbox (decisions there are left for
    ``poll_decisions``), then clear the flag."""
    key = inbox_key(run)
    entries = yield from blocking(functools.partial(_entries, run, key))
    for raw in entries:
        cancel = cancel_of(raw)
        if cancel is not None:
            yield from record_cancel(run, *cancel)
            yield from blocking(functools.partial(_done, run, key, raw))
    flag = cancel_flag_key(run.deps, run.tenant, run.run_id)
    yield from blocking(
        functools.partial(_redis, run, functools.partial(run.deps.redis.delete, flag))
    )


def cancel_flag_key(deps: RunDeps, tenant: str, run_id: str) -> str:
    """Set beside a cancellation entry in the inbox: what a step's one GET looks at."""
    return copies.cancel_flag_key(deps.leases.prefix, tenant, run_id)


def inbox_key(run: Engine) -> str:
    return decisions_key(run.deps, run.tenant, run.run_id)


def _entries(run: Engine, key: str) -> list[bytes]:
    entries: list[bytes] = _redis(run, functools.partial(run.deps.redis.lrange, key, 0, -1))
    return entries


def _set_aside(run: Engine, key: str, raw: bytes) -> None:
    malformed = copies.malformed_key(run.deps.leases.prefix, run.tenant, run.run_id)
    _redis(run, functools.partial(run.deps.redis.rpush, malformed, raw))
    _done(run, key, raw)


def _done(run: Engine, key: str, raw: bytes) -> None:
    _redis(run, functools.partial(run.deps.redis.lrem, key, 1, raw))  # type: ignore[arg-type]


def _redis(run: Engine, op: Callable[[], Any]) -> Any:
    try:
        return op()
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"Redis for run {run.run_id}: {exc}") from exc


def decisions_key(deps: RunDeps, tenant: str, run_id: str) -> str:
    return copies.inbox_key(deps.leases.prefix, tenant, run_id)
