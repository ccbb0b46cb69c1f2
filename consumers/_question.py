"""The question put to a person: what may have happened, and what each answer does.

"Try again?" is not a question a person can answer about an irreversible effect whose
outcome nobody knows. This says, from the run's log alone (no tools at hand, so the CLI
and the console can say it too): the tool, its canonical arguments (redacted like every
printer's), the idempotency key, when the call started and how many attempts it had, each
attempt's error, every reconciliation step with its evidence and outcome, and what
approving and rejecting do to the world, from what the tool declared on its STARTED
(``dedupes_by_key``, ``compensable``) and the recovery rules of ``producers._calls``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runlog.consumers._timeline import Timeline
from runlog.errors import UnknownApproval
from runlog.projections._lineage import FORK_QUESTION
from runlog.projections._run_state import decision_text, standing_decision

CALL_KINDS = frozenset({"uncertain_call", "conflict"})
"""Approval kinds about a call whose outcome is not known: approve retries it."""


@dataclass(frozen=True)
class Attempt:
    """One TOOL_CALL_STARTED of the key and what the log says became of it."""

    attempt: int
    seq: int
    started_at: str
    outcome: str
    """open | uncertain | failed | completed."""
    error: str | None = None
    detected_by: str | None = None


@dataclass(frozen=True)
class Reconciliation:
    """One RECONCILIATION_ATTEMPTED of the key: the evidence, the rule and the action."""

    seq: int
    at: str
    outcome: str
    action: str
    rule: str
    evidence: str = ""


@dataclass(frozen=True)
class Question:
    """An approval request with everything a person needs to answer it."""

    run_id: str
    tenant: str
    approval_id: str
    kind: str
    """action | uncertain_call | conflict."""
    reason: str
    requested_at: str
    approve: str
    """What approving does, in words (for a call: retry with the same key, and whether the
    receiver is declared to deduplicate by it)."""
    reject: str
    """What rejecting does (close without retrying; undo first when the tool has an
    inverse)."""
    tool: str | None = None
    risk: str | None = None
    args_json: str | None = None
    """The intended payload: the call's canonical arguments, secret fields redacted."""
    idempotency_key: str | None = None
    started_at: str | None = None
    """When the first attempt started."""
    attempts: tuple[Attempt, ...] = ()
    last_error: str | None = None
    """The last error recorded for the key (the transport's, when a live attempt saw one)."""
    reconciliations: tuple[Reconciliation, ...] = ()
    detail: str | None = None
    """For a conflict: the intended and the found effect."""
    dedupes_by_key: bool | None = None
    """What the tool declared on its latest STARTED; None: not recorded (a v1 record)."""
    compensable: bool | None = None
    decided: str | None = None
    """The decision that stands, if one does (a decision is final)."""
    undo_and_retry: str | None = None
    """What the third answer does, where the tool declared an inverse (``undoable``):
    undo what may have happened, then run the call again under a fresh key. None: not
    offered (``runlog.decide(undo_and_retry=True)`` is refused with ``NotUndoable``)."""
    ended: str | None = None
    """The run's outcome when it has ended (a terminate during the call): an ended run
    invokes nothing, so approving records the decision and retries nothing."""

    @property
    def about_a_call(self) -> bool:
        return self.kind in CALL_KINDS and self.idempotency_key is not None

    @property
    def undoable(self) -> bool:
        """ "Undo and retry" is an answer: an uncertain or conflicting call of a reversible
        tool that declared an inverse (``compensate=``) on its STARTED."""
        return (
            self.about_a_call
            and self.risk == "reversible"
            and self.compensable is True
            and self.ended is None
        )

    def undo_confirmation(self) -> str:
        """The sentence a person confirms before "undo and retry" is recorded."""
        return (
            f"Undo and retry {self.tool} ({self.idempotency_key}): {_undo_effect(self.tool)}. "
            "Confirm?"
        )

    def confirmation(self, approved: bool) -> str:
        """The sentence a person confirms before the decision is recorded: the
        consequence restated, with the tool and the key."""
        if not self.about_a_call:
            verb = "Approve" if approved else "Reject"
            return f"{verb}: {self.reason}. Confirm?"
        landed = _landed(len(self.attempts))
        if self.ended is not None:
            verb = "Approve" if approved else "Reject"
            what = _on_ended(self, approved)
            return f"{verb} {self.tool} ({self.idempotency_key}): {what}. Confirm?"
        if approved:
            if self.dedupes_by_key:
                then = (
                    "the receiver is declared to deduplicate by this key, so an effect "
                    "that landed is not repeated"
                )
            else:
                then = (
                    f"if {landed} landed, this REPEATS its effect (the receiver is not "
                    "declared to deduplicate by this key)"
                )
            return f"Retry {self.tool} with key {self.idempotency_key}: {then}. Confirm?"
        effect = _reject_effect(self.risk, self.compensable, self.tool or "", landed)
        return f"Reject {self.tool} ({self.idempotency_key}): {effect}. Confirm?"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["confirm_approve"] = self.confirmation(True)
        out["confirm_reject"] = self.confirmation(False)
        out["undoable"] = self.undoable
        out["confirm_undo_and_retry"] = self.undo_confirmation() if self.undoable else None
        return out

    def lines(self) -> list[str]:
        """The question as text, one fact a line (``runlog explain``, ``runlog show``)."""
        out = [
            f"approval {self.approval_id} ({self.kind}) asked {self.requested_at}: {self.reason}"
        ]
        if self.decided:
            out.append(f"  DECIDED: {self.decided}")
        if self.tool is not None:
            out.append(f"  tool:            {self.tool} (risk {self.risk or '?'})")
            out.append(f"  arguments:       {self.args_json}")
            out.append(f"  key:             {self.idempotency_key}")
            out.append(f"  started:         {self.started_at} ({len(self.attempts)} attempt(s))")
            out.append(f"  last error:      {self.last_error or '-'}")
            out.append(f"  dedupes by key:  {_declared(self.dedupes_by_key)}")
            if self.risk == "reversible":
                out.append(f"  inverse:         {_declared(self.compensable)}")
        for a in self.attempts:
            why = f": {a.error}" if a.error else ""
            by = f" ({a.detected_by})" if a.detected_by else ""
            out.append(f"  attempt {a.attempt} #{a.seq} {a.started_at} -> {a.outcome}{by}{why}")
        for r in self.reconciliations:
            ev = f"; evidence {r.evidence}" if r.evidence else ""
            out.append(
                f"  reconciliation #{r.seq} {r.at}: {r.outcome} -> {r.action} ({r.rule}){ev}"
            )
        if self.detail:
            out.append(f"  found:           {self.detail}")
        out.append(f"  {self.approve}")
        out.append(f"  {self.reject}")
        if self.undo_and_retry:
            out.append(f"  {self.undo_and_retry}")
        return out


def question(tl: Timeline, approval_id: str) -> Question:
    """The question of ``approval_id`` in ``tl``'s run; ``UnknownApproval`` if never asked."""
    st = tl.state
    asked = st.approvals.get(approval_id)
    request = next(
        (
            e
            for e in tl.entries
            if e["valid"] and e["type"] == "approval_requested" and e["approval_id"] == approval_id
        ),
        None,
    )
    if asked is None or request is None:
        pending = ", ".join(sorted(st.pending_approvals)) or "none"
        raise UnknownApproval(
            f"run {tl.run_id} never requested approval {approval_id!r} "
            f"(pending approval ids: {pending})",
            run_id=tl.run_id,
        )
    standing = standing_decision(st, approval_id)
    decided = None
    if standing is not None:
        at = tl.decided.get(approval_id, {}).get("at")
        decided = decision_text(
            approval_id, standing.decided_by, standing.approved, standing.note, at, standing.answer
        )
    key = request.get("idempotency_key")
    base: dict[str, Any] = {
        "run_id": tl.run_id,
        "tenant": tl.tenant,
        "approval_id": approval_id,
        "kind": asked.kind,
        "reason": asked.reason,
        "requested_at": request["at"],
        "decided": decided,
    }
    if asked.reason == FORK_QUESTION:
        tool = request.get("tool") or "?"
        return Question(
            **base,
            approve=f"approve = repeat {tool} in this fork under a key of its own: the world "
            "sees it once more",
            reject="reject = do not repeat it: the fork takes the other timeline's result "
            "(if that outcome is unknown, the call returns the refusal)",
            tool=tool,
            args_json=request.get("args_json"),
            idempotency_key=key,
            detail=request.get("detail"),
        )
    if asked.kind not in CALL_KINDS or key is None:
        return Question(
            **base,
            approve="approve = let the action run",
            reject="reject = deny it (the run is told, and goes on without it)",
            tool=request.get("tool"),
            args_json=request.get("args_json"),
        )
    mine = [e for e in tl.entries if e["valid"] and e.get("idempotency_key") == key]
    started = [e for e in mine if e["type"] == "tool_call_started"]
    attempts = _attempts(tl, started)
    latest = started[-1] if started else {}
    errors = [e["error"] for e in mine if e["type"] == "tool_call_uncertain"]
    tool = request.get("tool") or latest.get("tool") or "?"
    risk = latest.get("risk")
    dedupes, compensable = latest.get("dedupes_by_key"), latest.get("compensable")
    landed = _landed(len(attempts))
    if dedupes:
        how = (
            "the receiver is declared to deduplicate by this key: it will not repeat an "
            "effect that landed"
        )
    elif dedupes is None:
        how = (
            "the receiver's deduplication was not recorded for this call: if "
            f"{landed} landed and the receiver does not deduplicate, this REPEATS it"
        )
    else:
        how = (
            "the receiver is NOT declared to deduplicate by this key: if "
            f"{landed} landed, this REPEATS it"
        )
    approve = f"approve = retry {tool} with the same key {key} ({how})"
    reject = f"reject = {_reject_effect(risk, compensable, tool, landed)}"
    ended = st.outcome if st.status == "finished" else None
    if ended is not None:
        approve = f"approve = {_ENDED_APPROVE.format(outcome=ended)}"
        reject = f"reject = {_ended_reject(risk, ended)}"
    return Question(
        **base,
        approve=approve,
        reject=reject,
        ended=ended,
        tool=tool,
        risk=risk,
        args_json=request.get("args_json") or latest.get("args_json"),
        idempotency_key=key,
        started_at=started[0]["at"] if started else None,
        attempts=attempts,
        last_error=(errors[-1] if errors else None) or request.get("last_error"),
        reconciliations=tuple(
            Reconciliation(
                seq=e["seq"],
                at=e["at"],
                outcome=e["outcome"],
                action=e["action"],
                rule=e["rule"],
                evidence=e.get("evidence") or "",
            )
            for e in mine
            if e["type"] == "reconciliation_attempted"
        ),
        detail=request.get("detail"),
        dedupes_by_key=dedupes,
        compensable=compensable,
        undo_and_retry=f"undo and retry = {_undo_effect(tool)}"
        if risk == "reversible" and compensable is True
        else None,
    )


def _attempts(tl: Timeline, started: list[dict[str, Any]]) -> tuple[Attempt, ...]:
    """Each STARTED with the first outcome recorded for it (by its seq)."""
    out = []
    for s in started:
        outcome, error, by = "open", None, None
        for e in tl.entries:
            if not e["valid"] or e["seq"] <= s["seq"] or e.get("started_seq") != s["seq"]:
                continue
            if e["type"] == "tool_call_uncertain":
                outcome, error, by = "uncertain", e.get("error"), e.get("detected_by")
                break
            if e["type"] == "tool_call_completed":
                outcome = "failed" if e.get("is_error") else "completed"
                error = e.get("result") if e.get("is_error") else None
                break
        out.append(Attempt(s["attempt"], s["seq"], s["at"], outcome, error, by))
    return tuple(out)


def _landed(attempts: int) -> str:
    return "the first attempt" if attempts <= 1 else "an earlier attempt"


def _declared(flag: bool | None) -> str:
    return {True: "declared", False: "not declared", None: "not recorded"}[flag]


def _undo_effect(tool: str | None) -> str:
    """What "undo and retry" does, by ``producers._calls._undo_and_retry``."""
    return (
        f"undo what may have happened with {tool}'s inverse (a call with its own key), and "
        f"only once the inverse is recorded completed run {tool} again under a FRESH key "
        "(a receiver that deduplicates by key makes it anew): one effect stands in the end; "
        "if the inverse fails or its outcome is lost, nothing is retried and a person is "
        "asked again"
    )


def _reject_effect(risk: str | None, compensable: bool | None, tool: str, landed: str) -> str:
    """What a rejection does, by ``producers._calls._on_decision``."""
    if risk == "reversible" and compensable:
        return (
            f"undo what may have happened with {tool}'s inverse (a call with its own key, "
            "run by the worker that holds the run with its tools, or by its next owner), "
            "then close it without retrying; if the inverse does not complete, a person is "
            "asked again"
        )
    if risk == "reversible" and compensable is None:
        return (
            "close it without retrying; the run's next owner with its tools first runs the "
            f"tool's inverse if it declares one, otherwise, if {landed} landed, its effect "
            "stands"
        )
    return (
        f"close it without retrying (if {landed} landed, its effect stands; the note is "
        "recorded as its result)"
    )


_ENDED_APPROVE = (
    "record that it may run again; the run has ended ({outcome}) and invokes nothing, so "
    "nothing is retried: make the effect at the receiver yourself if it must happen"
)


def _ended_reject(risk: str | None, outcome: str) -> str:
    if risk == "reversible":
        return (
            f"record that it must not stand; the run has ended ({outcome}) and runs no "
            "inverse: undo it at the receiver yourself if it happened"
        )
    return "close it without retrying: nothing is invoked (the run has ended)"


def _on_ended(q: Question, approved: bool) -> str:
    return (q.approve if approved else q.reject).split(" = ", 1)[1]
