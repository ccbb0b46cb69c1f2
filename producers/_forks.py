"""Forking a run: a new run from a parent's prefix, written as one record.

``fork_run_with`` reads the parent's valid log (tenant-scoped: another tenant's run is an
unknown run), folds it to ``at_seq``, collects what the parent's timeline did after that
point, and appends the fork's first event, RUN_FORKED: the lineage (parent, seq, digest of
the parent's state there, who and why, the effects mode), the parent's state at ``at_seq``
and the other timeline's effects. One record is the whole fork: a writer killed before its
acknowledgement leaves no fork, one killed after it leaves the whole fork, and asking again
with the same ``run_id`` returns that fork instead of making a second one.

The fork is self-contained: it replays from its own log (its first event carries the
state), never from its parent's, so a parent's retention or erasure cannot break it. It is
an ordinary run from then on: ``open_run(fork_id, tools=...)`` resumes it (RUN_RESUMED),
recovery settles the uncertain calls of the prefix first, and a fleet dispatches it like
any run whose owner is gone. What its calls do about the parent's effects is
``runlog.producers._timelines``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from runlog.errors import ForkRefused, TenantMismatch, UnknownRun
from runlog.log._authority import authority_for
from runlog.log._fold import read_run
from runlog.producers._engine import Engine, RunDeps, valid_kept
from runlog.producers._opening import acquire, index_start
from runlog.projections._lineage import ForkedEffect, logical_of, pack_state
from runlog.projections._run_state import RunState, accept
from runlog.schemas import _models as m
from runlog.schemas._keys import check_run_id, new_run_id
from runlog.schemas._models import Event
from runlog.schemas._sealing import subject_of
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

EFFECTS_MODES = ("inherit", "ask", "execute")


@dataclass
class Fork:
    """A fork as made (or found made, when asked again with its run id)."""

    run_id: str
    tenant: str
    parent_run_id: str
    at_seq: int
    parent_digest: str
    effects: str
    forked_by: str
    reason: str
    created: bool
    """False: the run id already held this very fork (a retry after a crash)."""
    other_timeline: list[ForkedEffect] = field(default_factory=list)
    """The parent's timeline's effects after ``at_seq`` (as of the fork) that the fork did
    not take as its own: what an operator may have to undo."""
    agent: str | None = None
    """The registered agent the fork runs (the parent's, a run of the fleet), else None."""

    def to_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["other_timeline"] = [dict(vars(e)) for e in self.other_timeline]
        return out


@dataclass
class Parent:
    """What a fork takes from its parent: the state at the fork point and what came after."""

    state: RunState
    """The parent's state at ``at_seq``."""
    head_seq: int
    effects: list[m.ParentEffect]
    start: m.RunStarted | m.RunForked


def read_parent(deps: RunDeps, tenant: str, parent_id: str, at_seq: int) -> Parent:
    """Fold the parent's valid log to ``at_seq`` and collect its effects after it."""
    reader = deps.reader_factory()
    try:
        got = read_run(reader, deps.redis, deps.settings, tenant, parent_id, keep=True)
    finally:
        reader.close()
    head = got.state
    if head.status == "new":
        raise UnknownRun(f"run {parent_id} has no events", run_id=parent_id)
    if head.tenant != tenant:
        raise TenantMismatch(f"run {parent_id} has no events", run_id=parent_id)
    if head.erased is not None:
        # A fork begins with the parent's state: with encryption off the log still holds the
        # erased content in clear, and a fork would carry it into a new run again.
        e = head.erased
        raise ForkRefused(
            f"run {parent_id}'s content was erased (by {e.erased_by}: {e.reason}); "
            "an erased run is not forked",
            run_id=parent_id,
            seq=at_seq,
        )
    if not 1 <= at_seq <= head.seq:
        raise ForkRefused(
            f"run {parent_id} has valid seqs 1..{head.seq}; cannot fork at seq {at_seq}",
            run_id=parent_id,
            seq=at_seq,
        )
    events = valid_kept(got.folded)
    state = RunState(authority=authority_for(deps.settings))
    for ev in events[:at_seq]:
        accept(state, ev)
    assert state.seq == at_seq, (state.seq, at_seq)
    first = events[0].payload
    assert isinstance(first, m.RunStarted | m.RunForked)
    return Parent(state, head.seq, _effects_after(parent_id, state, head, events[at_seq:]), first)


def _effects_after(
    parent_id: str, at: RunState, head: RunState, after: list[Event]
) -> list[m.ParentEffect]:
    """The parent's timeline's effects after the fork point, by logical key: what it
    completed (itself or by inheriting), what it left uncertain, and the effects above it
    that it had not met by the fork point (carried down a fork of a fork)."""
    out: dict[str, m.ParentEffect] = {}
    if at.lineage is not None:
        for e in at.lineage.effects.values():
            if e.resolution is None:
                fields = {
                    k: v for k, v in vars(e).items() if k not in ("resolution", "resolved_seq")
                }
                out[e.logical_key] = m.ParentEffect(**fields)
    started: dict[str, m.ToolCallStarted] = {}
    risks = {k: (c.name, c.args_json, c.risk) for k, c in at.open_calls.items()}
    for ev in after:
        p = ev.payload
        if isinstance(p, m.ToolCallStarted):
            started[p.idempotency_key] = p
            risks[p.idempotency_key] = (p.name, p.args_json, p.risk)
        elif isinstance(p, m.ToolCallCompleted) and p.idempotency_key is not None:
            key = p.idempotency_key
            if key not in risks:
                continue  # a completion of nothing this timeline started: not an effect
            name, args_json, risk = risks[key]
            s = started.get(key)
            out[logical_of(key)] = m.ParentEffect(
                logical_key=logical_of(key),
                key=key,
                run_id=parent_id,
                seq=ev.seq,
                name=name,
                args_json=args_json,
                risk=risk,  # type: ignore[arg-type]
                status="completed",
                content=p.content,
                compensable=s.compensable if s is not None else None,
            )
        elif isinstance(p, m.ForkEffectResolved) and p.resolution == "inherited":
            above = head.lineage.effects.get(p.logical_key) if head.lineage else None
            out[p.logical_key] = m.ParentEffect(
                logical_key=p.logical_key,
                key=p.source_key,
                run_id=p.source_run_id,
                seq=p.source_seq,
                name=p.name,
                args_json=p.args_json,
                risk=above.risk if above is not None else "irreversible",  # type: ignore[arg-type]
                status="completed",
                content=p.content,
                compensable=above.compensable if above is not None else None,
            )
    for key, call in head.open_calls.items():
        if call.started_seq > at.seq:
            s = started.get(key)
            out[logical_of(key)] = m.ParentEffect(
                logical_key=logical_of(key),
                key=key,
                run_id=parent_id,
                seq=call.started_seq,
                name=call.name,
                args_json=call.args_json,
                risk=call.risk,  # type: ignore[arg-type]
                status="uncertain",
                content=None,
                compensable=s.compensable if s is not None else None,
            )
    return list(out.values())


def fork_run_with(
    deps: RunDeps,
    parent_id: str,
    *,
    tenant: str = "default",
    at_seq: int,
    run_id: str | None = None,
    input_json: str | None = None,
    effects: str = "inherit",
    forked_by: str = "",
    reason: str = "",
    wait_s: float | None = None,
) -> Fork:
    """Make the fork of ``parent_id`` at ``at_seq`` (see the module docstring)."""
    parent_id = check_run_id(parent_id)
    if effects not in EFFECTS_MODES:
        raise ValueError(f"effects must be one of {EFFECTS_MODES}, not {effects!r}")
    if input_json is not None:
        json.loads(input_json)  # refused here, before anything is read or written
    parent = read_parent(deps, tenant, parent_id, at_seq)
    rid = check_run_id(run_id) if run_id is not None else new_run_id()
    if rid == parent_id:
        raise ForkRefused(f"a fork needs a run id of its own, not {parent_id}", run_id=rid)
    lineage = parent.state.lineage
    payload = m.RunForked(
        parent_run_id=parent_id,
        at_seq=at_seq,
        parent_digest=parent.state.digest(),
        forked_by=forked_by or deps.writer_id,
        reason=reason,
        effects=effects,  # type: ignore[arg-type]
        key_scope=lineage.key_scope if lineage is not None else parent_id,
        ancestry=tuple(lineage.chain) if lineage is not None else (),
        state=pack_state(parent.state.to_dict()),
        parent_effects=tuple(parent.effects),
        input_json=input_json,
        agent=parent.start.agent,
        goal=parent.start.goal,
        labels=dict(parent.start.labels),
        # A fork is its parent's data subject's: forgetting the parent's subject erases its
        # forks too (their first event holds the parent's content).
        subject=subject_of(parent.state, parent_id),
    )
    wait = deps.settings.lease_ttl_ms / 1000 + 1 if wait_s is None else wait_s
    lease = acquire(deps, tenant, rid, wait)
    try:
        reader = deps.reader_factory()
        try:
            got = read_run(reader, deps.redis, deps.settings, tenant, rid)
            if got.state.status != "new":
                return _already(got.state, payload, rid, tenant)
            run = Engine(
                deps=deps,
                lease=lease,
                state=got.state,
                tools={},
                partition=got.partition,
                position=got.end,
            )
            with run.lock:
                ev = run.send(EventType.RUN_FORKED, payload, local=False)
                (delivered,) = run.barrier()
            accepted = run.read_back(reader, delivered.offset + 1)
            if ev.event_id not in accepted:
                # Another writer began this run id first: it is this fork, or a refusal.
                return _already(run.state, payload, rid, tenant)
            index_start(run, delivered)
        finally:
            reader.close()
        log.info("run %s forked from %s at seq %s", rid, parent_id, at_seq)
        return _made(run.state, tenant, created=True)
    finally:
        lease.release()


def _already(state: RunState, payload: m.RunForked, rid: str, tenant: str) -> Fork:
    """The run id is taken: by this very fork (asked again), or by something else."""
    if state.tenant and state.tenant != tenant:
        raise TenantMismatch(f"run id {rid} belongs to another tenant", run_id=rid)
    lin = state.lineage
    if lin is not None and (lin.parent_run_id, lin.at_seq, lin.effects_mode) == (
        payload.parent_run_id,
        payload.at_seq,
        payload.effects,
    ):
        return _made(state, tenant, created=False)
    raise ForkRefused(f"run id {rid} is already another run; choose another id", run_id=rid)


def _made(state: RunState, tenant: str, *, created: bool) -> Fork:
    lin = state.lineage
    assert lin is not None
    return Fork(
        run_id=state.run_id,
        tenant=tenant,
        parent_run_id=lin.parent_run_id,
        at_seq=lin.at_seq,
        parent_digest=lin.parent_digest,
        effects=lin.effects_mode,
        forked_by=lin.forked_by,
        reason=lin.reason,
        created=created,
        other_timeline=lin.not_inherited(),
        agent=state.agent_name,
    )
