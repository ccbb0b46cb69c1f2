"""An OpenAI Agents SDK ``Session`` whose conversation history is a runlog run's log.

``RunlogSession`` implements the SDK's ``Session`` protocol (``get_items``, ``add_items``,
``pop_item``, ``clear_session``) on an open ``AsyncRun``: every change is a MEMORY_WRITTEN
event (key ``openai-agents-session:<session_id>``, value the operation as JSON), so the
history is what the log says and nothing else. ``pop_item`` and ``clear_session`` are
recorded as operations of their own, never by rewriting the items they remove: the items a
session once held stay in the log (and in the audit trail).

Two ways to get one:

* ``await RunlogSession.open(run)`` on a run you opened: the history is every operation the
  log holds for the session, and new operations are appended. A resumed run sees the same
  items the crashed one had recorded.
* ``RunlogAgents(agent, session=True)``: the agent's ``Runner.run`` gets a session bound to
  the run it executes. A resumed execution re-runs the SDK's loop from the top, so the
  session answers it as the model is answered: the n-th operation of this execution is the
  n-th recorded one (checked equal, not appended again), and ``get_items`` returns the
  history as it was at that point. Only operations the log does not hold yet are appended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runlog import aio
from runlog.errors import RunError
from runlog.integrations._common import recorded_events
from runlog.schemas._canonical import canonical_json
from runlog.schemas._vocabulary import EventType

__all__ = ["SESSION_KEY_PREFIX", "RunlogSession", "SessionDiverged"]

SESSION_KEY_PREFIX = "openai-agents-session:"


class SessionDiverged(RunError):
    """A resumed execution asked the session for an operation other than the one its log
    records at that point: the agent is not deterministic over its own recorded turns."""


def _jsonable(item: Any) -> Any:
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_none=True)
    return json.loads(json.dumps(item, default=str))


@dataclass
class _Ops:
    """The session's recorded operations and how many of them this execution has used."""

    recorded: list[dict[str, Any]] = field(default_factory=list)
    cursor: int = 0

    def items(self) -> list[Any]:
        out: list[Any] = []
        for op in self.recorded[: self.cursor]:
            kind = op.get("op")
            if kind == "add":
                out.extend(op.get("items", []))
            elif kind == "pop":
                if out:
                    out.pop()
            elif kind == "clear":
                out.clear()
            else:
                raise RunError(f"unknown session operation {kind!r} in the log")
        return out


def recorded_ops(events: list[Any], session_id: str) -> list[dict[str, Any]]:
    """The session's operations in log order, from a run's valid events."""
    key = SESSION_KEY_PREFIX + session_id
    return [
        json.loads(ev.payload.value)
        for ev in events
        if ev.type is EventType.MEMORY_WRITTEN and ev.payload.key == key
    ]


class RunlogSession:
    """The SDK's ``Session`` protocol on a runlog run (see the module's docstring)."""

    session_settings: Any = None

    def __init__(
        self,
        run: aio.AsyncRun,
        session_id: str | None = None,
        *,
        recorded: list[dict[str, Any]] | None = None,
        replay: bool = False,
    ) -> None:
        self.run = run
        self.session_id = session_id or run.run_id
        ops = list(recorded or [])
        self._ops = _Ops(ops, 0 if replay else len(ops))

    @classmethod
    async def open(
        cls,
        run: aio.AsyncRun,
        session_id: str | None = None,
    ) -> RunlogSession:
        """The session ``session_id`` (default: the run's id) of ``run``, as its log holds it."""
        sid = session_id or run.run_id
        return cls(run, sid, recorded=recorded_ops(await recorded_events(run), sid))

    @property
    def replaying(self) -> bool:
        """Whether the log holds operations this execution has not reached yet."""
        return self._ops.cursor < len(self._ops.recorded)

    async def _apply(self, op: dict[str, Any]) -> None:
        ops = self._ops
        if ops.cursor < len(ops.recorded):
            had = ops.recorded[ops.cursor]
            if canonical_json(had) != canonical_json(op):
                raise SessionDiverged(
                    f"run {self.run.run_id}: session {self.session_id} operation "
                    f"{ops.cursor} is {had.get('op')!r} in the log, this execution asked "
                    f"for {op.get('op')!r} with other content",
                    run_id=self.run.run_id,
                )
            ops.cursor += 1
            return
        self.run.emit(
            EventType.MEMORY_WRITTEN,
            key=SESSION_KEY_PREFIX + self.session_id,
            value=json.dumps(op, sort_keys=True),
        )
        ops.recorded.append(op)
        ops.cursor += 1

    # The SDK's Session protocol --------------------------------------------------------------
    async def get_items(self, limit: int | None = None) -> list[Any]:
        items = self._ops.items()
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return items

    async def add_items(self, items: list[Any]) -> None:
        if not items:
            return
        # Pipelined: the next model request or tool call is a barrier for it.
        await self._apply({"op": "add", "items": [_jsonable(i) for i in items]})

    async def pop_item(self) -> Any | None:
        items = self._ops.items()
        if not items:
            return None
        await self._apply({"op": "pop"})
        await self.run.barrier()  # the caller acts on what it was given: recorded first
        return items[-1]

    async def clear_session(self) -> None:
        await self._apply({"op": "clear"})
        await self.run.barrier()
