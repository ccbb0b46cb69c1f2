"""An OpenAI Agents SDK agent for the fleet, imported by
`runlog worker --agents workers.oai_fleet_agents`.

The scripted model (no network) charges order 0, 1, 2, one per turn, then says done; the
receiver counts each key in ``<prefix>:effects`` (not idempotent: a repeat counts twice),
its reconciler finds an applied key by lookup.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from agents import Agent, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

import runlog
from runlog.integrations.openai_agents import RunlogAgents, ToolPolicy
from workers.common import fenced_effect, raise_floor

PREFIX = os.environ.get("RUNLOG_REDIS_KEY_PREFIX", "runlog")
STEPS = 3
STEP_S = float(os.environ.get("FLEET_TEST_STEP_S", "0.3"))
set_tracing_disabled(True)
_redis = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])


class Scripted(Model):
    async def get_response(self, system_instructions: Any, input: Any, *a: Any, **kw: Any) -> Any:
        done = (
            0
            if isinstance(input, str)
            else sum(
                1 for i in input if isinstance(i, dict) and i.get("type") == "function_call_output"
            )
        )
        if done < STEPS:
            args = json.dumps({"order": done})
            out: list[Any] = [
                ResponseFunctionToolCall(
                    type="function_call", call_id=f"c{done}", name="charge", arguments=args
                )
            ]
        else:
            text = ResponseOutputText(type="output_text", text=f"charged {done}", annotations=[])
            out = [
                ResponseOutputMessage(
                    id="m", type="message", role="assistant", status="completed", content=[text]
                )
            ]
        return ModelResponse(output=out, usage=Usage(requests=1), response_id=None)

    async def stream_response(self, *a: Any, **kw: Any) -> Any:  # pragma: no cover
        raise NotImplementedError
        yield


@function_tool
def charge(order: int) -> str:
    """Charge one order."""
    call = runlog.current_call()  # a framework tool: the key and token come from here
    assert call is not None
    key, token = call.idempotency_key, call.fencing_token
    if not fenced_effect(_redis, f"{PREFIX}:floors", key, token, counter=f"{PREFIX}:effects"):
        raise runlog.ToolError(f"refused {key}: a newer owner holds the run")
    time.sleep(STEP_S)
    return f"charged order {order}"


def _found(
    args: dict[str, Any], *, idempotency_key: str, fencing_token: int
) -> runlog.Match | runlog.Absent:
    raise_floor(_redis, f"{PREFIX}:floors", idempotency_key, fencing_token)
    if _redis.hexists(f"{PREFIX}:effects", idempotency_key):
        return runlog.Match(f"charged order {args['order']}")
    return runlog.Absent("no effect under this key")


billing = RunlogAgents(
    Agent(name="oai-billing", instructions="Charge the orders.", model=Scripted(), tools=[charge]),
    tools={"charge": ToolPolicy("irreversible", reconcile=_found, receiver="fenced")},
)
billing.register("oai-billing")
