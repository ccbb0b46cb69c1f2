"""The conformance adapter of the OpenAI Agents SDK integration (``RunlogAgents``).

The model is the SDK's own ``agents.testing.ScriptedModel``, asked for the script's step
at the turn the conversation has reached (so a resumed run's first live request gets the
right step). A missing call id is the empty string (the SDK's type has no ``None``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agents import Agent, function_tool, set_tracing_disabled
from agents.models.interface import Model
from agents.testing import ScriptedModel, assistant_message, function_call

import runlog
from runlog.integrations.openai_agents import RunlogAgents, ToolPolicy

from .driver import Receiver, Script, Spec


class _Scripted(Model):
    def __init__(self, script: Script) -> None:
        self.script = script

    def _step(self, items: Any) -> list[Any]:
        turn = (
            0
            if isinstance(items, str)
            else sum(
                1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
            )
        )
        if turn >= self.script.steps:
            return [assistant_message(f"done after {turn} charges")]
        call_id = self.script.call_id(turn) or ""
        return [function_call("charge", self.script.args(turn), call_id=call_id)]

    async def get_response(self, *a: Any, **kw: Any) -> Any:
        await asyncio.sleep(self.script.pace_s)
        items = kw["input"] if "input" in kw else a[1]
        return await ScriptedModel([self._step(items)]).get_response(*a, **kw)

    def stream_response(self, *a: Any, **kw: Any) -> Any:  # pragma: no cover
        raise NotImplementedError


class OaiAdapter:
    def execute(self, spec: Spec, receiver: Receiver) -> dict[str, Any]:
        set_tracing_disabled(True)
        script = spec.script

        @function_tool(needs_approval=script.approval)
        def charge(order: int, cents: int) -> str:
            """Charge an order."""
            call = runlog.current_call()
            assert call is not None
            receiver.charge(spec.run_id, script, call.idempotency_key, call.fencing_token)
            return f"charged {cents} for order {order}"

        @function_tool
        def note(text: str) -> str:
            """Take a note (v2 only; never called)."""
            return text

        def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
            result = f"charged {args['cents']} for order {args['order']}"
            return receiver.lookup(spec.run_id, idempotency_key, fencing_token, result)

        v1 = script.definition == "v1"
        tools = {"v1": [charge], "v2": [charge, note], "v3": [note]}[script.definition]
        agent = Agent(
            name="conformance",
            instructions="Charge, then say done." if v1 else "Charge politely, then say done.",
            model=_Scripted(script),
            tools=tools,
        )
        policy = ToolPolicy(
            "irreversible", reconcile=lookup if script.lookup else None, receiver="fenced"
        )
        policies = {} if script.definition == "v3" else {"charge": policy}
        durable = RunlogAgents(
            agent, tools=policies, settings=spec.settings, session=script.session
        )
        got = asyncio.run(
            durable.run(
                "charge the orders",
                run_id=spec.run_id,
                takeover=spec.takeover,
                wait_s=spec.wait_s,
                approval_wait_s=spec.approval_wait_s,
            )
        )
        return {"outcome": "finished", "output": json.dumps(got.output)}


ADAPTER = OaiAdapter()
