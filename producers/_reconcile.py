"""An operator settles uncertain calls with their tools' lookups (``runlog reconcile``).

Recovery runs a call's lookup when a run is opened; a run nobody opens again (it was
terminated, or waits for a time or a person) keeps its uncertain calls for good. This is
the same recovery step, asked for by a person, on a process that has the run's tools:

1. take the run's lease as any owner does (a live owner is waited for, never broken: the
   reconcile cannot race it), replay the log, and refuse (``NotReconcilable``, nothing
   appended) a key that is not an open call, that waits for a person's decision, or whose
   tool declares no lookup here and is not irreversible (an irreversible one without a
   lookup is put to a person, as recovery's risk rule does: its question then offers what
   the evidence allows);
2. claim the run with a person's RUN_RESUMED (``operator``), confirmed by reading the log
   back. On a finished run (terminated) that claim makes its epoch the settling one: the
   fold then accepts recovery's records about an open call and nothing else, so the run
   stays finished and no tool of it is invoked again (``projections._run_state``);
3. run ``calls.recover_call`` for each key, the rule recovery itself runs: its records
   (TOOL_CALL_UNCERTAIN, RECONCILIATION_ATTEMPTED, a completion with
   ``source=reconciliation``, an escalation) are the outcome;
4. release the lease without running the agent: a run in progress goes on when its fleet
   dispatches it, as before.

What each key became is read from the run's state after the steps (the log's answer), never
from what this process meant to do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runlog.errors import NotReconcilable, RunFinished
from runlog.producers import _calls as calls
from runlog.producers._engine import Engine, RunDeps
from runlog.producers._opening import claim_settlement, open_run_with
from runlog.producers._ops import drive
from runlog.producers._tools import Tool
from runlog.projections._run_state import OpenCall, RunState
from runlog.schemas._models import Event, ReconciliationAttempted

log = logging.getLogger(__name__)

WAITS_FOR_A_PERSON = ("escalated", "conflict")


@dataclass(frozen=True)
class Settled:
    """What one key is after a reconciliation, as the run's log says."""

    key: str
    name: str
    outcome: str
    """``completed``: closed by evidence (``source=reconciliation``); ``escalated``: a person
    decides now (a conflict, or the lookup's absence on an ended run); ``uncertain``: the
    lookup had no evidence either way (the call stays open, nothing retried);
    ``retried``: recovery retried it with the same key (a run in progress); ``decided``: a
    person's decision stands that this process could not carry out (an approved retry on an
    ended run, which invokes nothing, or one whose tool is not here)."""
    evidence: str = ""
    """The last RECONCILIATION_ATTEMPTED's outcome and evidence for the key."""


@dataclass(frozen=True)
class Reconciliation:
    """The outcome of ``reconcile``: each key asked for, and the run's state after."""

    run_id: str
    epoch: int
    """The epoch under which the reconciliation was recorded."""
    settled: list[Settled]
    finished: bool
    """The run had ended (terminated): settled after its finish, not resumed."""


def reconcilable(state: RunState, tools: Iterable[Tool], keys: Sequence[str] = ()) -> list[str]:
    """The open calls of ``state`` a reconciliation with ``tools`` would settle: ``keys``
    (each checked) or, with none given, every open call that waits for no person and whose
    tool declares a lookup or is irreversible (then put to a person), or that a person
    decided (the decision applied). Raises ``NotReconcilable`` naming the first key refused."""
    by_name = {t.name: t for t in tools}
    rid = state.run_id
    check_open(state, keys)
    if keys:
        for key in keys:
            _check(rid, state.open_calls[key], by_name)
        return list(keys)
    found = [
        c.idempotency_key
        for c in sorted(state.open_calls.values(), key=lambda c: c.started_seq)
        if c.status == "decided"
        or (c.status not in WAITS_FOR_A_PERSON and _settleable_by(c, by_name) is not None)
    ]
    if not found:
        raise NotReconcilable(
            f"run {rid} has no uncertain call a lookup can settle "
            f"({len(state.open_calls)} open, each waiting for a person or without a lookup)",
            key=None,
            why="none",
            run_id=rid,
        )
    return found


def _settleable_by(call: OpenCall, by_name: dict[str, Tool]) -> Tool | None:
    """The call's tool when recovery can settle it here: by its lookup, or, for an
    irreversible tool without one, by putting it to a person (the risk rule's escalation:
    the question then offers what the evidence allows). A safe or reversible tool without
    a lookup would be retried, which is no check, and on an ended run no act at all."""
    tool = by_name.get(call.name)
    if tool is None:
        return None
    return tool if tool.reconcile is not None or tool.risk == "irreversible" else None


def _check(rid: str, call: OpenCall, by_name: dict[str, Tool]) -> None:
    key = call.idempotency_key
    if call.status == "decided":
        return  # a person decided: recovery applies the decision, no lookup needed
    if call.status in WAITS_FOR_A_PERSON:
        raise NotReconcilable(
            f"{key} waits for a person's decision ({call.status}): answer it with "
            "`runlog approve`/`runlog reject` or the console's question page",
            key=key,
            why="waits_for_person",
            run_id=rid,
        )
    if _settleable_by(call, by_name) is None:
        raise NotReconcilable(
            f"{call.name} declares no lookup (reconcile=) here and is not irreversible "
            f"(a person's question): nothing can check {key}",
            key=key,
            why="no_lookup",
            run_id=rid,
        )


def reconcile(
    deps: RunDeps,
    run_id: str,
    *,
    tenant: str,
    tools: Iterable[Tool],
    keys: Sequence[str] = (),
    by: str,
    wait_s: float | None = None,
) -> Reconciliation:
    """Run the declared lookup of ``keys`` (default: every open call that has one) of
    ``run_id`` and record the outcome as recovery does; see the module docstring.

    ``wait_s``: how long to wait for a live owner's lease (default: one lease TTL and a
    second); ``RunLocked`` after it. ``UnknownRun`` for a run this tenant does not have."""
    if not by.strip():
        raise ValueError("who reconciles is required (by): it is recorded with the claim")
    tools = list(tools)
    run = open_run_with(
        deps,
        run_id,
        tenant=tenant,
        tools=tools,
        wait_s=wait_s,
        recover=False,
        create=False,
        reason=f"reconcile by {by}",
        operator=by,
    )
    with run:
        chosen = reconcilable(run.state, tools, keys)
        finished = run.state.status == "finished"
        if finished:
            claim_settlement(run, by)
            # The read-back may have shown records this replay had not seen (a reconcile
            # just before this one): what is to be settled is asked again of that state.
            chosen = reconcilable(run.state, tools, keys)
        names = {k: run.state.open_calls[k].name for k in chosen}
        for key in chosen:
            call = run.state.open_calls.get(key)
            if call is None:
                continue  # an earlier key's steps closed it (a compensation's own call)
            try:
                drive(run, calls.recover_call(run, call))
            except RunFinished:
                # The rule asked for a retry (proven absent): an ended run invokes nothing
                # more. Its record says what the evidence was; a person decides the rest.
                log.warning("run %s ended: %s is not retried", run.run_id, key)
        return Reconciliation(
            run.run_id,
            run.epoch,
            [_settled(run, key, names[key]) for key in chosen],
            finished,
        )


def _settled(run: Engine, key: str, name: str) -> Settled:
    return settled(run.state, run.since_last_turn(), key, name)


def settled(state: RunState, events: Sequence[Event], key: str, name: str = "") -> Settled:
    """What ``key`` is in ``state``, with the evidence of its last RECONCILIATION_ATTEMPTED
    among ``events`` (the run's valid events, in log order)."""
    last = ""
    for ev in reversed(events):
        p = ev.payload
        if isinstance(p, ReconciliationAttempted) and p.idempotency_key == key:
            last = f"{p.outcome}: {p.evidence}" if p.evidence else p.outcome
            name = name or p.name
            break
    call = state.open_calls.get(key)
    if call is None:
        return Settled(key, name, "completed" if key in state.completed_calls else "closed", last)
    if call.status in WAITS_FOR_A_PERSON:
        return Settled(key, call.name, "escalated", last)
    if call.status == "decided":
        return Settled(key, call.name, "decided", last)
    if call.status == "started":
        return Settled(key, call.name, "retried", last)
    return Settled(key, call.name, "uncertain", last)


def check_open(state: RunState, keys: Sequence[str]) -> None:
    """What can be checked of a reconciliation without the tools (the asker of the fleet
    has none): each key is an open call that waits for no person, or, with no key, one
    such call exists. ``NotReconcilable`` otherwise; the worker checks the lookup."""
    if keys:
        for key in keys:
            call = state.open_calls.get(key)
            if call is None:
                done = "completed" if key in state.completed_calls else "not a call of the run"
                raise NotReconcilable(
                    f"{key} is not an uncertain call of run {state.run_id} ({done})",
                    key=key,
                    why="not_open",
                    run_id=state.run_id,
                )
            if call.status in WAITS_FOR_A_PERSON:
                _check(state.run_id, call, {})
        return
    if not any(c.status not in WAITS_FOR_A_PERSON for c in state.open_calls.values()):
        raise NotReconcilable(
            f"run {state.run_id} has no uncertain call a lookup can settle "
            f"({len(state.open_calls)} open, each waiting for a person)",
            key=None,
            why="none",
            run_id=state.run_id,
        )
