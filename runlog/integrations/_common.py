"""What every agent-framework integration shares: one rule each, no framework imported.

* ``ToolPolicy``/``policies``: how runlog treats one of the agent's tools.
* ``operation_id``: a framework tool call's scope for its idempotency key.
* ``recorded_events``: a run's valid events, read from the log where the run lives.
* ``missing_extra``: the error an integration raises when its framework is not installed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from runlog import aio
from runlog._settings import Settings
from runlog.errors import MissingExtra
from runlog.producers._handle import engine_of
from runlog.producers._tools import (
    DEFAULT_COMMIT_WINDOW_S,
    Receiver,
    Reconciler,
    Risk,
    Tool,
    ToolFn,
)


def missing_extra(
    exc: ModuleNotFoundError, integration: str, extra: str, packages: tuple[str, ...]
) -> MissingExtra | ModuleNotFoundError:
    """What importing ``integration`` raises when ``exc`` was raised by its framework's import:
    ``MissingExtra`` (a ``ConfigError`` naming the extra to install) when the missing module
    is one of the framework's ``packages``; ``exc`` itself otherwise (a module missing inside
    an installed framework is a broken install, not a missing extra)."""
    top = (exc.name or "").split(".")[0]
    if top in packages:
        return MissingExtra(integration=integration, extra=extra, package=top)
    return exc


SUMMARY_CHARS = 2000
"""How much of an agent's output a RUN_FINISHED keeps as its summary."""


@dataclass(frozen=True)
class ToolPolicy:
    """How runlog treats one of the agent's tools (a tool without one is ``safe``).

    ``reconcile(args, *, idempotency_key[, fencing_token])`` is an authoritative lookup
    returning ``runlog.Match``/``Absent``/``Conflict``/``Inconclusive`` (it may be
    ``async``); without it an uncertain call is settled by ``risk``: ``safe`` and
    ``reversible`` are retried with the same key, ``irreversible`` is asked of a person.
    ``receiver`` and ``commit_window_s`` are ``runlog.tool``'s: what the receiver does
    with the fencing token and deadline (the tool reads both from
    ``runlog.current_call()``); only a declared guarantee lets ``Absent`` be retried.
    """

    risk: Risk = "safe"
    reconcile: Reconciler | None = None
    receiver: Receiver | tuple[Receiver, ...] | None = None
    commit_window_s: float = DEFAULT_COMMIT_WINDOW_S

    def tool(self, name: str, fn: ToolFn) -> Tool:
        """The runlog tool named ``name`` that runs ``fn`` under this policy."""
        return Tool(
            name=name,
            fn=fn,
            risk=self.risk,
            reconcile=self.reconcile,
            receiver=self.receiver,
            commit_window_s=self.commit_window_s,
        )


def policies(**by_name: ToolPolicy | Risk) -> dict[str, ToolPolicy]:
    """``policies(refund=ToolPolicy("irreversible", reconcile=...), lookup="safe")``."""
    return {k: v if isinstance(v, ToolPolicy) else ToolPolicy(v) for k, v in by_name.items()}


def operation_id(scope: str, turn: int, call_id: str) -> str:
    """The scope of a tool call's idempotency key: the model turn that proposed it and the
    model's call id (both replayed identically), so the key depends neither on the order in
    which a framework runs a turn's calls nor on a fresh id of its own.

    ``scope`` is the run's id; a fork that goes on with its parent's conversation passes
    its lineage's key scope (``run.sync.key_scope``) and counts ``turn`` after the parent's
    turns, so a call the parent made at that turn is the same logical action."""
    return f"{scope}:turn{turn}:{call_id}"


def proposal(
    run: aio.AsyncRun,
    operation: str,
    call_id: str,
    name: str,
    args: Any,
    args_json: str,
) -> dict[str, Any]:
    """A tool call a model turn proposes, as its MODEL_TURN records it: with the key it
    will run under in ``operation`` (its ``operation_id``; none when its arguments are not
    an object: it cannot run as given)."""
    key = run.key_for(name, args, operation_id=operation) if isinstance(args, dict) else None
    return {"call_id": call_id, "name": name, "args_json": args_json, "idempotency_key": key}


def valid_events(settings: Settings | None, tenant: str, run_id: str) -> list[Any]:
    """The run's events that the fold accepts (fenced writes left out), in log order."""
    from runlog._bootstrap import Services
    from runlog.log._fold import read_run
    from runlog.log._reader import LogReader

    services = Services.shared(settings or Settings())
    with LogReader(services.settings) as reader:
        got = read_run(reader, services.redis, services.settings, tenant, run_id, keep=True)
    fenced = {rec.offset for rec in got.folded.fenced}
    return [rec.event for rec in got.folded.kept if rec.offset not in fenced]


async def recorded_events(run: aio.AsyncRun) -> list[Any]:
    """``valid_events`` of an open run, read where the run lives (whoever opened it: a
    fleet worker's settings, not the agent's), off the event loop."""
    settings = engine_of(run).deps.settings
    return await asyncio.to_thread(valid_events, settings, run.tenant, run.run_id)
