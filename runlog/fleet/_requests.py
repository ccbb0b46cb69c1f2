"""Durable requests to the fleet: start a run, dispatch one now.

``request_start`` records the request (acknowledged by the broker) and returns: no worker
needs to be up. A request for an id that has a log is answered from that log, never from
the lifecycle topic (a cache of it): the same run id requested twice is one run, and an id
of another tenant or another agent is refused (``docs/concepts/fleet.md``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from runlog._settings import Settings
from runlog.errors import (
    AgentMismatch,
    KafkaUnavailable,
    NoLiveWorker,
    NotReconcilable,
    RunFinished,
    SchemaError,
    StartRefused,
    TenantMismatch,
    UnknownRun,
    ValidationFailed,
)
from runlog.fleet._lifecycle import Record, read_latest, rebuilt, writer_for
from runlog.fleet._reconciling import ReconcileRequest, new_request_id
from runlog.fleet._worker import live_workers
from runlog.log._fold import read_run
from runlog.log._kafka import high_watermark, partitions_of, reader_config
from runlog.log._keys import sealer_for
from runlog.log._reader import LogReader
from runlog.producers._reconcile import check_open
from runlog.projections._run_state import RunState
from runlog.schemas import _codec as codec
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import check_run_id, check_tenant, new_run_id

log = logging.getLogger(__name__)

MAX_INPUT_BYTES = 256 * 1024
"""An agent's input travels in the start request and in RUN_STARTED: keep it small (a
reference to a document, not the document)."""


@dataclass(frozen=True)
class StartAnswer:
    """What a start request became."""

    run_id: str
    status: Literal["requested", "already started", "finished"]
    """``requested``: the request was recorded; ``already started``: the run's log holds
    its start by this agent, and its lifecycle record was rewritten from that log (a record
    lost or written over is restored); ``finished``: the run ended, nothing was written."""


def request_start(
    settings: Settings,
    client: redis.Redis,
    agent: str,
    input: Any,
    *,
    tenant: str,
    run_id: str | None,
    subject: str | None = None,
    requested_by: str | None = None,
) -> StartAnswer:
    """Record a start request for ``agent`` with ``input``, answered from the run's log.

    A minted id (``run_id`` None) is nobody else's: the request is written. A given id is
    read first: if it has a log, the log answers (another tenant's: ``StartRefused``, which
    never names the owner; another agent's: ``AgentMismatch``, naming both; the same
    agent's: "already started"), and nothing the log contradicts is written. With no log
    yet, a pending request of another tenant for the id refuses the same way; this
    tenant's own pending request is replaced.
    """
    check_tenant(tenant)
    rid = new_run_id() if run_id is None else check_run_id(run_id)
    if not agent:
        raise ValidationFailed("an agent name is required")
    try:
        input_json = canonical_json(input)
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"the input of {agent} is not JSON: {exc}") from exc
    if len(input_json.encode()) > MAX_INPUT_BYTES:
        raise ValidationFailed(
            f"the input of {agent} is {len(input_json.encode())} bytes, over {MAX_INPUT_BYTES}"
        )
    if run_id is not None:
        state = _state(settings, client, tenant, rid)
        if state.status != "new":
            return _already(settings, rid, state, tenant=tenant, agent=agent)
        # No log yet: another tenant's pending request still owns the id (writing over it
        # would lose that request); this tenant's own may be replaced (nothing ran).
        pending = read_latest(settings, run_ids=frozenset({rid})).get(rid)
        if pending is not None and pending.record is not None and pending.record.tenant != tenant:
            _refuse(rid, pending.record.tenant, None, tenant=tenant, agent=agent)
    # The input is content: sealed under the run's subject (its RUN_STARTED's key).
    sealer = sealer_for(settings, tenant, subject or rid)
    record = Record(
        "requested",
        tenant,
        agent,
        input_json=input_json,
        subject=subject or None,
        requested_by=requested_by,
        requested_at=codec.now_utc(),
    )
    writer_for(settings).write(rid, record, sealer=sealer)
    return StartAnswer(rid, "requested")


def _refuse(
    run_id: str, has_tenant: str, has_agent: str | None, *, tenant: str, agent: str
) -> None:
    """The one rule for a start of an id already taken: another tenant's id is refused
    without naming its owner, another agent's naming both agents."""
    if has_tenant != tenant:
        raise StartRefused(
            f"run id {run_id} is taken by another tenant's run; choose another run id",
            run_id=run_id,
            agent=agent,
        )
    if has_agent != agent:
        said = repr(has_agent) if has_agent is not None else "no agent (not runlog.start's)"
        raise AgentMismatch(
            f"run {run_id} runs {said}; a start of {agent!r} for it is refused",
            run_id=run_id,
            agent=agent,
            recorded_agent=has_agent,
        )


def _already(
    settings: Settings, run_id: str, state: RunState, *, tenant: str, agent: str
) -> StartAnswer:
    _refuse(run_id, state.tenant, state.agent_name, tenant=tenant, agent=agent)
    record = rebuilt(state, codec.now_utc())
    if record is None:
        return StartAnswer(run_id, "finished")
    writer_for(settings).write(run_id, record)
    return StartAnswer(run_id, "already started")


def request_dispatch(
    settings: Settings, client: redis.Redis, run_id: str, *, tenant: str, why: str = ""
) -> RunState:
    """Ask the fleet to dispatch ``run_id`` now (``runlog resume``); returns its state.

    Refused for a run with no events (``UnknownRun``; a requested run not yet started is
    dispatched by its request), of another tenant (``TenantMismatch``), finished
    (``RunFinished``), or not started through the agent registry (``UnknownRun``).
    """
    check_tenant(tenant)
    rid = check_run_id(run_id)
    state = _state(settings, client, tenant, rid)
    if state.status == "new":
        raise UnknownRun(f"run {rid} has no events", run_id=rid)
    if state.tenant != tenant:
        raise TenantMismatch(f"run {rid} is not a run of tenant {tenant}", run_id=rid)
    if state.status == "finished":
        raise RunFinished(f"run {rid} finished with {state.outcome!r}", run_id=rid)
    if state.agent_name is None:
        raise UnknownRun(
            f"run {rid} was not started through the agent registry (runlog.start): no "
            "worker can run it; resume it with open_run",
            run_id=rid,
        )
    wake(settings, rid, tenant=tenant, agent=state.agent_name)
    if why:
        log.info("dispatch of %s requested: %s", rid, why)
    return state


def request_reconcile(
    settings: Settings,
    client: redis.Redis,
    run_id: str,
    *,
    tenant: str,
    keys: tuple[str, ...] = (),
    by: str,
    queue: bool = False,
) -> tuple[ReconcileRequest, RunState]:
    """Ask the fleet to run the lookup of ``keys`` (default: every open call it can settle)
    of ``run_id`` on a worker that has its agent's tools (``fleet.reconciling``); returns
    the request and the run's state it was checked against.

    Checked against the run's log first, nothing written otherwise: ``UnknownRun`` (no
    run of this tenant), ``NotReconcilable`` (a key not open, or waiting for a person; a
    run not started through the agent registry, whose tools no worker has), and
    ``NoLiveWorker`` when no live worker announces the agent, unless ``queue`` (the request
    then waits for one)."""
    check_tenant(tenant)
    rid = check_run_id(run_id)
    if not by.strip():
        raise ValidationFailed("who reconciles is required (by): it is recorded with the claim")
    state = _state(settings, client, tenant, rid)
    if state.status == "new" or state.tenant != tenant:
        raise UnknownRun(f"no run {rid} for tenant {tenant}", run_id=rid)
    check_open(state, keys)
    agent = state.agent_name
    if agent is None:
        raise NotReconcilable(
            f"run {rid} was not started through the agent registry (runlog.start): no "
            "worker has its tools; call runlog.reconcile(..., tools=...) where they are",
            key=None,
            why="no_agent",
            run_id=rid,
        )
    if not queue and not serves(settings, client, agent):
        raise NoLiveWorker(
            f"no live worker serves agent {agent!r} (runlog workers): nothing would run "
            "the lookup now; start one, or ask again with --queue to leave the request "
            "for the next one",
            agent=agent,
        )
    req = ReconcileRequest(rid, tenant, agent, tuple(keys), by, new_request_id())
    writer_for(settings).write_value(rid, req.encode(), key=req.key)
    return req, state


def serves(settings: Settings, client: redis.Redis, agent: str) -> bool:
    """Whether a live worker announces ``agent`` (its presence entry's ``agents``)."""
    return any(agent in w.get("agents", "").split(",") for w in live_workers(client, settings))


def wake(settings: Settings, run_id: str, *, tenant: str, agent: str) -> None:
    """Write ``open`` for a run of the fleet: whoever owns its partition dispatches it."""
    writer_for(settings).write(run_id, Record("open", tenant, agent))


def forget(settings: Settings, run_id: str) -> None:
    """Tombstone the lifecycle record of a run of the fleet that has ended (``runlog
    terminate``): no worker's table keeps it, none dispatches it again."""
    writer_for(settings).write(run_id, None)


def pending_starts(
    settings: Settings, tenant: str, subject: str, *, wait_s: float = 30.0
) -> list[str]:
    """The run ids whose latest lifecycle record is a start request of ``subject`` in
    ``tenant`` (its named subject, or the run id when it named none) that no worker has
    started yet: a forget of the subject drops them (``forget`` below), since the request
    holds the run's input, and a worker would start the forgotten person's run on it."""
    topic = settings.lifecycle_topic
    consumer = Consumer(reader_config(settings))
    last: dict[str, bytes | None] = {}
    try:
        for part in sorted(partitions_of(consumer, topic)):
            end = high_watermark(consumer, topic, part)
            if end <= 0:
                continue
            consumer.assign([TopicPartition(topic, part, OFFSET_BEGINNING)])
            deadline = time.monotonic() + wait_s
            done = False
            while not done:
                if time.monotonic() > deadline:
                    raise KafkaUnavailable(f"reading {topic}[{part}] to {end} timed out")
                for msg in consumer.consume(500, timeout=0.5):
                    if msg.error() is not None:
                        continue
                    off = msg.offset()
                    key = msg.key()
                    if key is not None:
                        last[key.decode()] = msg.value()
                    if off is not None and off >= end - 1:
                        done = True
            consumer.unassign()
    finally:
        consumer.close()
    found: list[str] = []
    for rid, value in last.items():
        if value is None:
            continue
        try:
            rec = Record.decode(value)
        except SchemaError:
            continue
        if rec.state == "requested" and rec.tenant == tenant and (rec.subject or rid) == subject:
            found.append(rid)
    return sorted(found)


def _state(settings: Settings, client: redis.Redis, tenant: str, run_id: str) -> RunState:
    reader = LogReader(settings)
    try:
        return read_run(reader, client, settings, tenant, run_id).state
    finally:
        reader.close()


@dataclass(frozen=True)
class Requested:
    """A start request as the lifecycle topic holds it, and who can serve it now."""

    run_id: str
    tenant: str
    agent: str
    requested_by: str | None
    since: datetime | None
    """When it was requested (the record's own time, else the broker's)."""
    served_by: tuple[str, ...]
    """The live workers that announce ``agent`` (``runlog workers``)."""

    def text(self) -> str:
        if self.served_by:
            return f"requested, {len(self.served_by)} live worker(s) serve agent {self.agent}"
        since = self.since.isoformat() if self.since is not None else "?"
        return f"requested, no live worker serves agent {self.agent} since {since}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "tenant": self.tenant,
            "agent": self.agent,
            "status": "requested",
            "requested_by": self.requested_by,
            "since": None if self.since is None else self.since.isoformat(),
            "served_by": list(self.served_by),
            "served": bool(self.served_by),
            "text": self.text(),
        }


def serving(client: redis.Redis, settings: Settings, agent: str) -> list[str]:
    """The ids of the live workers that announce ``agent``."""
    return _serving(live_workers(client, settings), agent)


def _serving(workers: list[dict[str, str]], agent: str) -> list[str]:
    return [w.get("id", "") for w in workers if agent in w.get("agents", "").split(",")]


def requested(
    settings: Settings,
    client: redis.Redis,
    *,
    tenants: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
) -> list[Requested]:
    """The runs whose latest lifecycle record is a start request (of ``tenants``; of
    ``run_ids``), each with the live workers that serve its agent. A request stays so while
    its run is being executed: the caller tells the runs that have a log apart."""
    wanted = None if run_ids is None else frozenset(run_ids)
    only = None if tenants is None else set(tenants)
    found = read_latest(settings, run_ids=wanted)
    workers = live_workers(client, settings)
    out = []
    for rid, latest in sorted(found.items()):
        rec = latest.record
        if rec is None or rec.state != "requested":
            continue
        if only is not None and rec.tenant not in only:
            continue
        served = tuple(_serving(workers, rec.agent))
        since = rec.requested_at or latest.written_at
        out.append(Requested(rid, rec.tenant, rec.agent, rec.requested_by, since, served))
    return out
