"""The handle users hold: ``runlog.Run``, the documented surface of an owned run.

A handle is small on purpose: identity, state, keys, ``append``/``emit``/``barrier``, the
tool call, approvals, cancellation, timers and the end. What it does is its engine's
(``runlog.producers._engine.Engine``: the lease guard, encoding, sending,
acknowledgements, log confirmation, cancellation). ``runlog.aio.AsyncRun`` is the same
handle for an event loop. The modules that drive a run reach its engine through
``engine_of``; users never need it.

Members the handle had before it was split from its engine, and that nothing documented,
are kept one release as deprecated aliases (``DEPRECATED``): reading one warns and
answers the engine's.
"""

from __future__ import annotations

import warnings
from typing import Any

from runlog.producers._engine import Engine
from runlog.producers._writer import Delivered
from runlog.projections._run_state import RunState
from runlog.schemas._models import Event, Payload
from runlog.schemas._signing import Signature
from runlog.schemas._vocabulary import EventType

DEPRECATED = frozenset(
    {
        "cancel_flag",
        "cancel_flag_key",
        "cancel_raised",
        "confirm_in_log",
        "confirmed_locally",
        "delivery_wait_s",
        "deps",
        "dispatched",
        "emit_confirmed",
        "ends_cancelled",
        "final_outcome",
        "first_offset",
        "hand_over",
        "idempotency_key",
        "key_scope",
        "last_offset",
        "lease",
        "partition",
        "position",
        "recover",
        "tools",
    }
)
"""Undocumented members of ``Run`` before 0.x split it from its engine: they warn
(``DeprecationWarning``) and go in the next release."""


class Handle:
    """What both handles share: the engine they drive, the run's identity and its keys."""

    _engine: Engine

    @property
    def run_id(self) -> str:
        return self._engine.run_id

    @property
    def tenant(self) -> str:
        return self._engine.tenant

    @property
    def epoch(self) -> int:
        """The fencing token."""
        return self._engine.epoch

    @property
    def state(self) -> RunState:
        """The run's state, folded from its valid log and kept current by each append."""
        return self._engine.state

    @property
    def key_scheme(self) -> int:
        """The idempotency-key scheme of this run: the one of the keys its log holds."""
        return self._engine.key_scheme

    def key_for(self, name: str, args: dict[str, Any], *, operation_id: str | None = None) -> str:
        """The key the next ``call_tool(name, args)`` will use (without consuming it)."""
        return self._engine.key_for(name, args, operation_id=operation_id)

    def __setattr__(self, name: str, value: Any) -> None:
        # A deprecated member set on the handle is set on the engine that reads it (set on
        # the handle, it would be a new attribute nothing reads: a silent no-op).
        if name in DEPRECATED:
            self._deprecated(name, None)
            setattr(self._engine, name, value)
            return
        super().__setattr__(name, value)

    def _deprecated(self, name: str, value: Any) -> Any:
        warnings.warn(
            f"{type(self).__name__}.{name} is not part of runlog's API and goes in the next "
            "release: see docs/reference/api.md for the handle's members",
            DeprecationWarning,
            stacklevel=3,
        )
        return value


def engine_of(run: Handle | Engine) -> Engine:
    """The engine a handle drives (an engine is its own): for the modules that drive a run,
    never for users."""
    return run if isinstance(run, Engine) else run._engine


class Run(Handle):
    """An owned run. Use as a context manager: closing releases the lease."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __repr__(self) -> str:
        return f"Run(run_id={self.run_id!r}, tenant={self.tenant!r}, epoch={self.epoch})"

    def __getattr__(self, name: str) -> Any:
        if name in DEPRECATED:
            return self._deprecated(name, getattr(self._engine, name))
        raise AttributeError(f"'Run' object has no attribute {name!r}")

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pipelined appends (best effort) and release the lease.

        A run whose agent was told it is cancelled (``Cancelled``) ends cancelled here."""
        self._engine.close()

    def emit(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Pipeline an event without waiting; ``barrier()`` makes everything emitted durable.

        Nothing may act on an emitted event before the barrier returns.
        """
        return self._engine.emit(event_type, payload, **kw)

    def barrier(self) -> list[Delivered]:
        """Wait until every emitted event is acknowledged, then re-check ownership."""
        return self._engine.barrier()

    def append(
        self,
        event_type: EventType | str,
        payload: Payload | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Event:
        """Append one event and return it once acknowledged and ownership re-checked.

        A step of the agent's: a person's cancellation is raised here first (``Cancelled``,
        once), as at ``call_tool`` and as ``AsyncRun.append`` does; RUN_FINISHED is exempt
        (a cancelled run's end is recorded by it)."""
        return self._engine.append(event_type, payload, **kw)

    def since_last_turn(self) -> list[Event]:
        """The run's valid events after its last MODEL_TURN (all of them if it has none).

        What a worker re-executed after a crash needs in order not to record a fact twice
        that the log already holds, though the fold does not keep it (a guardrail trip, the
        RUN_FINISHED event itself).
        """
        return self._engine.since_last_turn()

    def call_tool(
        self,
        name: str,
        args: dict[str, Any],
        *,
        operation_id: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Invoke a tool at most once per logical action; see docs/concepts/effects.md."""
        return self._engine.call_tool(name, args, operation_id=operation_id, call_id=call_id)

    def request_approval(
        self,
        reason: str,
        *,
        kind: str = "action",
        deadline_s: float | None = None,
        **fields: Any,
    ) -> str:
        """Ask a person; returns the approval id that ``runlog approve``/``reject`` names.

        ``deadline_s``: the decision is due that many seconds from now (recorded as the
        request's ``due_at``; ``runlog approvals --overdue`` names it once it passed)."""
        return self._engine.request_approval(reason, kind=kind, deadline_s=deadline_s, **fields)

    def decide(
        self,
        approval_id: str,
        *,
        approved: bool,
        decided_by: str,
        note: str = "",
        signature: Signature | None = None,
        answer: str | None = None,
    ) -> None:
        """Record a person's decision; settles the call it concerns when the tool is here.

        Signed with this process' decider key (``RUNLOG_DECIDER_KEY_FILE``) unless
        ``signature`` (a decider's, made elsewhere) is given. When the readers trust
        decider keys, an unsigned or untrusted decision raises ``NotADecider``.
        """
        self._engine.decide(
            approval_id,
            approved=approved,
            decided_by=decided_by,
            note=note,
            signature=signature,
            answer=answer,
        )

    def poll_decisions(self) -> int:
        """Record the decisions people queued while this worker held the run."""
        return self._engine.poll_decisions()

    def check_cancelled(self) -> None:
        """Raise ``Cancelled`` (once) if a person cancelled the run: call before a step of
        your own (``call_tool`` and the agent loop's model turns already check)."""
        self._engine.check_cancelled()

    def sleep(self, seconds: float) -> None:
        """A durable timer: the run continues ``seconds`` from the first time this call
        was reached, however often the agent is re-executed meanwhile.

        The k-th ``sleep`` of a run records TIMER_STARTED once (its ``due_at``); a re-executed
        agent reaching it again waits only for what is left. In a worker of the fleet the
        wait holds nothing: the run's lease and slot are released and the run is dispatched
        again when it is due (``docs/concepts/fleet.md``). Elsewhere it waits in this thread.

        A step: a person's cancellation is raised here first (``Cancelled``, once), also when
        the timer was recorded before, so a sleeping run that is cancelled and dispatched
        again stops here instead of going back to sleep.
        """
        self._engine.sleep(seconds)

    def finish(self, outcome: str, summary: str = "") -> Event:
        """Append RUN_FINISHED and release the lease.

        On a run that already finished with ``outcome``, returns the recorded RUN_FINISHED:
        a worker killed just after its finish was acknowledged and re-executed from the
        top reaches the same call again. A different outcome raises ``RunFinished``.

        A run a person cancelled ends ``cancelled`` whatever ``outcome`` says (the
        summary names the request); ``summary`` is kept after it.
        """
        return self._engine.finish(outcome, summary)
