"""Durable requests to the fleet: start a run, dispatch one now.

``request_start`` records the request (acknowledged by the broker) and returns: no worker
needs to be up. The same run id requested twice is one run: the worker that opens it
appends RUN_STARTED only to a run with no events (``docs/concepts/fleet.md``).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from runlog.errors import RunFinished, TenantMismatch, UnknownRun, ValidationFailed
from runlog.fleet.lifecycle import Record, writer_for
from runlog.log.fold import read_run
from runlog.log.keys import sealer_for
from runlog.log.reader import LogReader
from runlog.projections.run_state import RunState
from runlog.schemas.canonical import canonical_json
from runlog.schemas.keys import check_run_id, check_tenant, new_run_id
from runlog.settings import Settings

log = logging.getLogger(__name__)

MAX_INPUT_BYTES = 256 * 1024
"""An agent's input travels in the start request and in RUN_STARTED: keep it small (a
reference to a document, not the document)."""


def request_start(
    settings: Settings,
    agent: str,
    input: Any,
    *,
    tenant: str,
    run_id: str | None,
    subject: str | None = None,
) -> str:
    """Record a start request for ``agent`` with ``input``; returns the run id."""
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
    # The input is content: sealed under the run's subject (its RUN_STARTED's key).
    sealer = sealer_for(settings, tenant, subject or rid)
    writer_for(settings).write(
        rid,
        Record("requested", tenant, agent, input_json=input_json, subject=subject or None),
        sealer=sealer,
    )
    return rid


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


def wake(settings: Settings, run_id: str, *, tenant: str, agent: str) -> None:
    """Write ``open`` for a run of the fleet: whoever owns its partition dispatches it."""
    writer_for(settings).write(run_id, Record("open", tenant, agent))


def forget(settings: Settings, run_id: str) -> None:
    """Tombstone the lifecycle record of a run of the fleet that has ended (``runlog
    terminate``): no worker's table keeps it, none dispatches it again."""
    writer_for(settings).write(run_id, None)


def _state(settings: Settings, client: redis.Redis, tenant: str, run_id: str) -> RunState:
    reader = LogReader(settings)
    try:
        return read_run(reader, client, settings, tenant, run_id).state
    finally:
        reader.close()
