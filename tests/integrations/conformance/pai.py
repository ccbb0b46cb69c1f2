"""The conformance adapter of the Pydantic AI integration (the ``RunlogDurability``
capability on a plain ``Agent``).

The model is Pydantic AI's own ``FunctionModel``; the turn is the number of model responses
in the conversation. A missing call id is ``None``, as a provider that sends none gives it.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import runlog
from runlog.integrations.pydantic_ai_capability import RunlogDurability, ToolPolicy

from .driver import Receiver, Spec


class PaiAdapter:
    def execute(self, spec: Spec, receiver: Receiver) -> dict[str, Any]:
        script = spec.script

        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            time.sleep(script.pace_s)
            turn = sum(1 for m in messages if isinstance(m, ModelResponse))
            if turn >= script.steps:
                return ModelResponse(parts=[TextPart(f"done after {turn} charges")])
            call = ToolCallPart("charge", script.args(turn), tool_call_id=script.call_id(turn))
            return ModelResponse(parts=[call])

        def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
            result = f"charged {args['cents']} for order {args['order']}"
            return receiver.lookup(spec.run_id, idempotency_key, fencing_token, result)

        policy = ToolPolicy(
            "irreversible", reconcile=lookup if script.lookup else None, receiver="fenced"
        )
        durability = RunlogDurability(
            tools={} if script.definition == "v3" else {"charge": policy},
            settings=spec.settings,
            takeover=spec.takeover,
            wait_s=spec.wait_s,
            approval_wait_s=spec.approval_wait_s,
        )
        v1 = script.definition == "v1"
        agent = Agent(
            FunctionModel(model),
            instructions="Charge, then say done." if v1 else "Charge politely, then say done.",
            capabilities=[durability],
        )

        def charge(order: int, cents: int) -> str:
            call = runlog.current_call()
            assert call is not None
            receiver.charge(spec.run_id, script, call.idempotency_key, call.fencing_token)
            return f"charged {cents} for order {order}"

        if script.definition != "v3":
            agent.tool_plain(requires_approval=script.approval)(charge)
        if not v1:

            @agent.tool_plain
            def note(text: str) -> str:
                return text

        got = agent.run_sync("charge the orders", run_id=spec.run_id)
        return {"outcome": "finished", "output": str(got.output)}


ADAPTER = PaiAdapter()
