"""An agent loop driven by a scripted model, so tests and the demo need no LLM.

The loop holds no state of its own: every decision point is derived from the run's folded
state, so a worker killed anywhere and restarted with the same run id continues exactly
where the log says it stopped. The script position is ``turns + compactions + action
approvals requested``; a model turn's tool calls are executed with the keys recorded in
its MODEL_TURN, never recomputed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runlog.errors import Escalated, ToolFailed
from runlog.producers import _calls as calls
from runlog.producers._bounds import TEXT_BYTES, bound_text
from runlog.producers._engine import Engine
from runlog.producers._handle import Handle, engine_of
from runlog.producers._ops import drive
from runlog.projections._lineage import FORK_QUESTION, logical_of
from runlog.projections._run_state import Approval, RunState, messages_in_last_turns
from runlog.schemas._canonical import canonical_json
from runlog.schemas._models import GuardrailTriggered
from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)


def _scripted(approval: Approval) -> bool:
    """An action approval the script asked for (a fork's question about another
    timeline's effect is the fork's, not a step of the script)."""
    return approval.kind == "action" and approval.reason != FORK_QUESTION


@dataclass(frozen=True)
class Call:
    """A tool call the scripted model proposes."""

    name: str
    args: dict[str, Any]
    operation_id: str | None = None


@dataclass(frozen=True)
class ModelStep:
    """One model turn: text and tool calls, with usage and cost."""

    text: str = ""
    calls: tuple[Call, ...] = ()
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    think_s: float = 0.0
    """Simulated model latency (the "mid model call" window)."""


@dataclass(frozen=True)
class CompactStep:
    """Compact the context to ``summary`` plus the last ``kept_turns`` model turns
    (each with the tool results that followed it), as context_compacted v2 counts."""

    summary: str
    kept_turns: int


@dataclass(frozen=True)
class ApprovalStep:
    """Ask a person before the next model step's tool calls may run."""

    reason: str


@dataclass(frozen=True)
class FinishStep:
    outcome: str
    summary: str = ""


Step = ModelStep | CompactStep | ApprovalStep | FinishStep
Policy = Callable[[str, dict[str, Any]], str | None]
"""Returns a denial reason, or None to allow."""
Guardrail = Callable[[str], tuple[str, str, str] | None]
"""Returns (guardrail, severity, detail) when the model text trips it."""


@dataclass
class ScriptedModel:
    """A deterministic model: the next step is a function of the run's state only."""

    script: Sequence[Step]

    def position(self, state: RunState) -> int:
        actions = sum(1 for a in state.approvals.values() if _scripted(a))
        return state.turns + state.compactions + actions

    def next_step(self, state: RunState) -> Step | None:
        pos = self.position(state)
        return self.script[pos] if pos < len(self.script) else None


@dataclass
class AgentLoop:
    model: ScriptedModel
    policy: Policy | None = None
    guardrails: Sequence[Guardrail] = ()
    approval_wait_s: float = 0.0
    """How long to wait for a person's decision before stopping with ``Escalated``."""
    on_event: Callable[[str], None] = field(default=lambda _msg: None)

    def run(self, run: Handle | Engine, *, user_message: str | None = None) -> RunState:
        """Drive ``run`` to its end (or to a point that needs a person)."""
        run = engine_of(run)
        st = run.state
        if st.status in ("running", "escalated"):
            run.poll_decisions()  # queued decisions (needed when opened with recover=False)
        if user_message is not None and not any(m.role == "user" for m in st.messages):
            run.append(EventType.USER_MESSAGE, content=user_message)
        while run.state.status == "running":
            run.check_cancelled()  # before the next model turn: a person's cancellation
            self._finish_pending_calls(run)
            step = self.model.next_step(run.state)
            if step is None:
                run.finish("succeeded", "script exhausted")
                break
            if isinstance(step, ModelStep):
                self._model_step(run, step)
            elif isinstance(step, CompactStep):
                self._compact(run, step)
            elif isinstance(step, ApprovalStep):
                self._approval(run, step)
            else:
                run.finish(step.outcome, step.summary)
        if run.state.status == "escalated":
            raise Escalated(f"run {run.run_id} is stopped by a conflict", run_id=run.run_id)
        return run.state

    # Steps ------------------------------------------------------------------------------
    def _model_step(self, run: Engine, step: ModelStep) -> None:
        if step.think_s:
            time.sleep(step.think_s)
        # A worker that died between a trip's record and this step's MODEL_TURN re-runs the
        # step: the trips the log already holds for it are not recorded again.
        recorded = Counter(
            (p.guardrail, p.severity, p.detail)
            for ev in run.since_last_turn()
            if isinstance(p := ev.payload, GuardrailTriggered)
        )
        for guard in self.guardrails:
            tripped = guard(step.text)
            if tripped is not None:
                name, severity, detail = tripped
                as_recorded = (name, severity, bound_text(detail, TEXT_BYTES))
                if recorded[as_recorded] > 0:
                    recorded[as_recorded] -= 1
                    continue
                run.append(
                    EventType.GUARDRAIL_TRIGGERED,
                    guardrail=name,
                    severity=severity,
                    action="logged",
                    detail=detail,
                )
        proposals = []
        taken: set[str] = set()
        for call in step.calls:
            args_json = canonical_json(call.args)
            key = self._fresh_key(run, call, args_json, taken)
            taken.add(key)
            proposals.append(
                {
                    "call_id": f"call-{uuid.uuid4().hex[:12]}",
                    "name": call.name,
                    "args_json": args_json,
                    "idempotency_key": key,
                }
            )
        # Pipelined: losing a model turn can only ask the model again; whatever acts on
        # it (an irreversible call, an approval, finish) is a barrier that covers it.
        run.emit(
            EventType.MODEL_TURN,
            text=step.text,
            tool_calls=proposals,
            usage={"input_tokens": step.input_tokens, "output_tokens": step.output_tokens},
            cost_usd=step.cost_usd,
        )
        self.on_event(f"model turn {run.state.turns}: {step.text[:60]}")
        self._finish_pending_calls(run)

    @staticmethod
    def _fresh_key(run: Engine, call: Call, args_json: str, taken: set[str]) -> str:
        """The key of the next occurrence of this (scope, tool, args) in the run.

        Occurrence n gets ordinal n: the first ordinal whose key the log has not used yet,
        so an intentional repeat is a new action and a retried proposal of a proven
        failure (which records no key) reuses its key.
        """
        scope = call.operation_id or run.key_scope  # a fork: the lineage's logical keys
        done = [*run.state.completed_calls, *run.state.open_calls]
        used = {logical_of(k) for k in done} | taken
        ordinal = 0
        while True:
            key = run.idempotency_key(scope, call.name, args_json, ordinal)
            if key not in used:
                return key
            ordinal += 1

    def _compact(self, run: Engine, step: CompactStep) -> None:
        before = len(run.state.messages)
        run.append(
            EventType.CONTEXT_COMPACTED,
            summary=step.summary,
            kept_turns=step.kept_turns,
            dropped=max(
                0, before - 1 - messages_in_last_turns(run.state.messages, step.kept_turns)
            ),
        )
        kept = len(run.state.messages) - 2  # minus the task and the summary
        self.on_event(f"context compacted: kept {step.kept_turns} turn(s), {kept} message(s)")

    def _approval(self, run: Engine, step: ApprovalStep) -> None:
        run.request_approval(step.reason, kind="action")
        self.on_event(f"approval requested: {step.reason}")

    def _pending_action_approval(self, run: Engine) -> str | None:
        """The approval gating the last model turn's calls, if the script put one before it."""
        pos = self.model.position(run.state)
        script = self.model.script
        if pos < 2 or pos > len(script):
            return None
        if not (
            isinstance(script[pos - 1], ModelStep) and isinstance(script[pos - 2], ApprovalStep)
        ):
            return None
        actions = [a for a in run.state.approvals.values() if _scripted(a)]
        return actions[-1].approval_id if actions else None

    def _finish_pending_calls(self, run: Engine) -> None:
        """Execute the last model turn's calls that have no outcome in the log yet."""
        st = run.state
        last = None
        for i in range(len(st.messages) - 1, -1, -1):
            if st.messages[i].role == "assistant":
                last = i
                break
        if last is None:
            return
        done = {m.tool_result.call_id for m in st.messages[last + 1 :] if m.tool_result is not None}
        for proposal in st.messages[last].tool_calls:
            if proposal["call_id"] in done:
                continue
            self._execute_proposal(run, proposal)

    def _execute_proposal(self, run: Engine, proposal: dict[str, Any]) -> None:
        name, args_json, call_id = proposal["name"], proposal["args_json"], proposal["call_id"]
        denial = self._denial(run, name, json.loads(args_json))
        if denial is not None:
            policy, reason = denial
            run.append(
                EventType.TOOL_CALL_DENIED,
                call_id=call_id,
                name=name,
                args_json=args_json,
                reason=reason,
                policy=policy,
            )
            self.on_event(f"denied {name}: {reason}")
            return
        tool = run.tools[name]
        try:
            result = drive(
                run,
                calls.execute_logical(
                    run, tool, args_json, proposal["idempotency_key"], call_id=call_id
                ),
            )
            self.on_event(f"{name} -> {result[:60]}")
        except ToolFailed as exc:
            self.on_event(f"{name} failed: {exc}")

    def _denial(self, run: Engine, name: str, args: dict[str, Any]) -> tuple[str, str] | None:
        approval_id = self._pending_action_approval(run)
        if approval_id is not None:
            decided = self._await_decision(run, approval_id)
            if not decided:
                return ("approval", f"a person rejected {approval_id}")
        if name not in run.tools:
            return ("tools", f"no tool named {name!r}")
        if self.policy is not None:
            reason = self.policy(name, args)
            if reason is not None:
                return ("policy", reason)
        return None

    def _await_decision(self, run: Engine, approval_id: str) -> bool:
        deadline = time.monotonic() + self.approval_wait_s
        while True:
            approval = run.state.approvals[approval_id]
            if approval.approved is not None:
                return approval.approved
            run.poll_decisions()
            run.check_cancelled()  # a cancellation ends the wait too
            if run.state.approvals[approval_id].approved is not None:
                continue
            if time.monotonic() >= deadline:
                raise Escalated(
                    f"run {run.run_id} waits for a person to decide {approval_id}",
                    approval_id=approval_id,
                    run_id=run.run_id,
                )
            time.sleep(0.1)
