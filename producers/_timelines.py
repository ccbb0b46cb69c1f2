"""Effects across timelines: what a fork's tool call does, decided, never by accident.

A fork's calls compute their logical key in the lineage's key scope (``Run.key_scope``: the
root run), so the same tool with the same canonical arguments and occurrence is the same
logical action in every timeline. Before the call path runs a key, this module decides
which key, or whether anything runs at all:

==============================================  =========================================
the action                                      the fork
==============================================  =========================================
completed (or open) in the prefix, in this      its own: the recorded result (an open one
timeline or one above it                        is settled by the recovery rules)
completed by the other timeline after the fork  ``--effects``: inherit returns the parent's
point (same logical key)                        result (FORK_EFFECT_RESOLVED inherited);
                                                ask stops for a person with the parent's
                                                evidence (an approval request); execute
                                                repeats it under the fork's own key
                                                (FORK_EFFECT_RESOLVED repeated)
left uncertain by the other timeline            inherit has no result to take: a person
                                                decides (as ask); execute repeats it
a safe tool, or an action nobody did            a new action under the fork's own key
==============================================  =========================================

The fork's own key is ``LOGICAL@FORK_RUN_ID`` (``projections._lineage.fork_key``): bound to
the fork, so a receiver that deduplicates by key never confuses two timelines, and the
log of a fork's fork still names the logical action.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runlog.errors import Escalated
from runlog.producers._approvals import request_approval
from runlog.producers._ops import Steps, append
from runlog.producers._tools import Tool
from runlog.projections._lineage import FORK_QUESTION, ForkedEffect, fork_key
from runlog.projections._run_state import Approval, RunState
from runlog.schemas._vocabulary import EventType

if TYPE_CHECKING:
    from runlog.producers._engine import Engine

QUESTION = FORK_QUESTION


@dataclass(frozen=True)
class Inherited:
    """The call is settled without running anything: this is its result."""

    content: str


@dataclass(frozen=True)
class Execute:
    """Run the call path with this key (completed or open keys settle as usual there)."""

    key: str


def own_key(run: Engine, logical: str) -> str | None:
    """The key under which this timeline (its prefix included) holds the action: completed
    first, else open; None if it never met it."""
    lineage = run.state.lineage
    assert lineage is not None
    forks = [*lineage.chain[1:], run.run_id]  # the root ran it under the logical key itself
    candidates = [logical, *(fork_key(logical, r) for r in forks)]
    for key in candidates:
        if key in run.state.completed_calls:
            return key
    for key in candidates:
        if key in run.state.open_calls:
            return key
    return None


def resolve(
    run: Engine, tool: Tool, args_json: str, logical: str, *, call_id: str
) -> Steps[Inherited | Execute]:
    """What the fork's call with logical key ``logical`` does (the module table)."""
    lineage = run.state.lineage
    assert lineage is not None
    own = own_key(run, logical)
    if own is not None:
        return Execute(own)
    mine = fork_key(logical, run.run_id)
    effect = lineage.effects.get(logical)
    if effect is None or tool.risk == "safe" or effect.resolution == "repeated":
        return Execute(mine)
    mode = lineage.effects_mode
    if mode == "inherit" and effect.status == "completed":
        content = effect.content or ""
        yield from _resolved(run, effect, call_id, "inherited", content, "effects=inherit")
        return Inherited(content)
    if mode == "execute":
        yield from _resolved(run, effect, call_id, "repeated", "", "effects=execute", mine)
        return Execute(mine)
    approval = asked(run.state, logical)
    if approval is None:
        approval_id = yield from request_approval(
            run,
            QUESTION,
            kind="action",
            name=effect.name,
            args_json=effect.args_json,
            idempotency_key=logical,
            detail=json.dumps(evidence(effect), sort_keys=True),
        )
        raise Escalated(
            f"fork {run.run_id}: {effect.name} was done by run {effect.run_id} after the "
            "fork point; a person decides whether to repeat it (approve) or not (reject)",
            approval_id=approval_id,
            run_id=run.run_id,
        )
    if approval.approved is None:
        raise Escalated(
            f"fork {run.run_id}: {effect.name} awaits a person's decision",
            approval_id=approval.approval_id,
            run_id=run.run_id,
        )
    who = approval.decided_by or ""
    if approval.approved:
        yield from _resolved(run, effect, call_id, "repeated", "", who, mine, approval)
        return Execute(mine)
    if effect.status == "completed":
        content = effect.content or ""
        yield from _resolved(run, effect, call_id, "inherited", content, who, None, approval)
        return Inherited(content)
    content = f"not repeated: {who} declined ({approval.note})"
    yield from _resolved(run, effect, call_id, "declined", content, who, None, approval)
    return Inherited(content)


def asked(state: RunState, logical: str) -> Approval | None:
    """The fork's latest approval request about the action ``logical``."""
    found = [
        a
        for a in state.approvals.values()
        if a.kind == "action" and a.idempotency_key == logical and a.reason == QUESTION
    ]
    return max(found, key=lambda a: a.requested_seq) if found else None


def evidence(effect: ForkedEffect) -> dict[str, object]:
    """What the other timeline's log says about the effect, for the person asked."""
    return {
        "run_id": effect.run_id,
        "seq": effect.seq,
        "key": effect.key,
        "status": effect.status,
        "result": effect.content,
        "risk": effect.risk,
    }


def _resolved(
    run: Engine,
    effect: ForkedEffect,
    call_id: str,
    resolution: str,
    content: str,
    decided_by: str,
    repeat_key: str | None = None,
    approval: Approval | None = None,
) -> Steps[None]:
    yield from append(
        EventType.FORK_EFFECT_RESOLVED,
        logical_key=effect.logical_key,
        call_id=call_id,
        name=effect.name,
        args_json=effect.args_json,
        resolution=resolution,
        source_run_id=effect.run_id,
        source_seq=effect.seq,
        source_key=effect.key,
        content=content,
        repeat_key=repeat_key,
        decided_by=decided_by,
        approval_id=approval.approval_id if approval is not None else None,
    )
