"""A fork's lineage in its run state, and the fold rules of the two fork records.

A fork (``runlog.producers._forks``) is a run whose first event is RUN_FORKED: it names the
parent run and the seq it forks at, the digest of the parent's state there, and carries
that state whole, so the fork replays from its own log alone (it never reads its parent's
log to resume). It also carries what the other timeline did after the fork point: each
effect the parent's timeline completed (or left uncertain) after ``at_seq``, by its logical
key (tool, canonical arguments, occurrence, in the lineage's key scope).

FORK_EFFECT_RESOLVED records what the fork did when it met one of those actions itself:
``inherited`` (the parent's result is the fork's: the key completes with it), ``repeated``
(a deliberate repeat under a key bound to the fork: nothing completes here, the repeat is
a call of its own) or ``declined`` (a person refused to repeat an effect whose outcome in
the other timeline is unknown: the key completes with that refusal).

Pure, like every fold: no Kafka, Redis, clock or I/O.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from runlog.projections._messages import Message, ToolResult
from runlog.schemas import _models as m
from runlog.schemas._models import Event
from runlog.schemas._sealing import ERASED

if TYPE_CHECKING:
    from runlog.projections._run_state import RunState

FORK_KEY_SEPARATOR = "@"
"""A fork's own key of an action is ``LOGICAL@FORK_RUN_ID``: bound to the fork, so a
receiver never deduplicates it against another timeline's effect, and the logical key
(what every timeline of the lineage agrees on) is the part before the separator."""


FORK_QUESTION = "fork: repeat what the other timeline did?"
"""The reason of a fork's approval request (``--effects ask``): how it is found again."""


def pack_state(state: dict[str, Any]) -> str:
    """A state dict as RUN_FORKED carries it: canonical JSON, zlib-compressed, base64 (a
    conversation compresses several times over, so a longer parent fits the record)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return base64.b64encode(zlib.compress(text.encode(), 6)).decode()


def unpack_state(packed: str) -> dict[str, Any]:
    """Inverse of ``pack_state``."""
    out: dict[str, Any] = json.loads(zlib.decompress(base64.b64decode(packed)))
    return out


def fork_key(logical_key: str, run_id: str) -> str:
    """The key a fork executes the action ``logical_key`` under (a new action or a repeat)."""
    return f"{logical_key}{FORK_KEY_SEPARATOR}{run_id}"


def logical_of(key: str) -> str:
    """The logical key of a key any timeline of a lineage executed."""
    return key.split(FORK_KEY_SEPARATOR, 1)[0]


@dataclass
class ForkedEffect:
    """An effect of another timeline after the fork point, and what this fork did with it."""

    logical_key: str
    key: str
    run_id: str
    seq: int
    name: str
    args_json: str
    risk: str
    status: str
    """completed | uncertain (started, no outcome known when the fork was made)."""
    content: str | None = None
    compensable: bool | None = None
    resolution: str | None = None
    """None: not met by the fork (yet); inherited | repeated | declined | settled (an open
    call of the prefix that the parent completed after the fork point)."""
    resolved_seq: int | None = None


@dataclass
class Lineage:
    parent_run_id: str
    at_seq: int
    parent_digest: str
    forked_by: str
    reason: str
    effects_mode: str
    key_scope: str
    ancestry: list[str]
    forked_at: datetime | None = None
    input_json: str | None = None
    effects: dict[str, ForkedEffect] = field(default_factory=dict)
    """Logical key -> the other timeline's effect after the fork point."""

    @property
    def chain(self) -> list[str]:
        """Every run above this fork, root first, the parent last."""
        return [*self.ancestry, self.parent_run_id]

    def not_inherited(self) -> list[ForkedEffect]:
        """What the other timeline did that this fork did not take as its own."""
        return [e for e in self.effects.values() if e.resolution not in ("inherited", "settled")]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lineage:
        d = dict(data)
        d["forked_at"] = datetime.fromisoformat(d["forked_at"]) if d.get("forked_at") else None
        d["effects"] = {k: ForkedEffect(**v) for k, v in d.get("effects", {}).items()}
        return cls(**d)


def run_forked(st: RunState, ev: Event) -> None:
    """The fork's first event: the parent's state at the fork point, under the fork's name."""
    p = ev.payload
    assert isinstance(p, m.RunForked)
    if p.state == ERASED:
        # The parent's content at the fork point was sealed under the subject's key and the
        # key is destroyed: the fork folds as structure only (an empty prefix, its lineage
        # and its own later events kept). Its subject was forgotten, so is its content.
        parent = type(st)(authority=st.authority)
    else:
        parent = type(st).from_dict(unpack_state(p.state), st.authority)
    for name in ("messages", "turns", "input_tokens", "output_tokens", "cost_usd"):
        setattr(st, name, getattr(parent, name))
    for name in ("completed_calls", "open_calls", "approvals", "compactions", "denials"):
        setattr(st, name, getattr(parent, name))
    st.retries = parent.retries
    # The registered agent the parent ran (the fleet dispatches the fork to it), with the
    # fork's own input when it was given one.
    st.agent_name, st.agent_version = parent.agent_name, parent.agent_version
    st.agent_input = p.input_json if p.input_json is not None else parent.agent_input
    st.run_id, st.tenant, st.epoch = ev.run_id, ev.tenant, ev.epoch
    st.started_at = ev.occurred_at
    st.subject = p.subject  # v3: the parent's subject (None: the fork is its own)
    # A conflict awaiting a person at the fork point still stops the fork; a finished
    # parent's outcome is not the fork's.
    st.status = "escalated" if parent.status == "escalated" else "running"
    for call in st.open_calls.values():
        if call.status == "started":
            call.status = "uncertain"  # its writer was the parent's: only evidence settles it
    if st.authority.enforcing:
        # A decision on a call still open is signed for the parent's run, and its signature
        # is not carried: under trusted deciders it does not count in the fork (a writer
        # could otherwise carry in a "decision" nobody signed). A person decides again.
        for call in st.open_calls.values():
            if call.status == "decided":
                call.status, call.decision = "escalated", None
                call.decided_by, call.decision_note = "", ""
                approval = st.approvals.get(call.approval_id or "")
                if approval is not None:
                    approval.approved, approval.decided_by = None, None
                    approval.note, approval.key_id = "", None
    lineage = Lineage(
        parent_run_id=p.parent_run_id,
        at_seq=p.at_seq,
        parent_digest=p.parent_digest,
        forked_by=p.forked_by,
        reason=p.reason,
        effects_mode=p.effects,
        key_scope=p.key_scope,
        ancestry=list(p.ancestry),
        forked_at=ev.occurred_at,
        input_json=p.input_json,
    )
    for e in p.parent_effects:
        effect = ForkedEffect(**e.model_dump())
        if e.status == "completed" and e.key in st.open_calls:
            # Started in the prefix, completed by the parent after the fork point: the same
            # attempt, whose outcome the parent's log proves. The fork's own call, settled.
            del st.open_calls[e.key]
            st.completed_calls[e.key] = e.content or ""
            effect.resolution, effect.resolved_seq = "settled", ev.seq
        lineage.effects[e.logical_key] = effect
    st.lineage = lineage


def fork_effect_resolved(st: RunState, ev: Event) -> None:
    p = ev.payload
    assert isinstance(p, m.ForkEffectResolved)
    lineage = st.lineage
    if lineage is not None and p.logical_key in lineage.effects:
        effect = lineage.effects[p.logical_key]
        effect.resolution, effect.resolved_seq = p.resolution, ev.seq
    if p.resolution in ("inherited", "declined"):
        # The fork's call returns this result, as a completed call of its own would.
        st.messages.append(
            Message(
                "tool",
                trust="tool",
                tool_result=ToolResult(p.call_id, p.name, p.content, p.resolution == "declined"),
            )
        )
        st.completed_calls[p.logical_key] = p.content
