"""A Pydantic AI agent run by runlog, in a process the tests kill, race and resume.

    python tests/workers/pai_worker.py --dir D --name N --run-id R --scenario steps

The model is a scripted ``FunctionModel`` (no network, no key). Every request it answers is
logged in Redis with a fresh nonce in the response text, so a test can tell afterwards
whether a turn the log holds was ever requested again. The ``charge`` tool applies its
effect to the ledger in Redis (outside this process), keyed by idempotency key; its
reconciler is an authoritative lookup of that ledger. Flags, result file and exit codes
follow ``agent_worker.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from pydantic_ai import Agent, DeferredToolRequests  # noqa: E402
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy  # noqa: E402
from runlog.integrations.pydantic_ai_capability import RunlogDurability  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from workers.common import (  # noqa: E402
    EXIT_ESCALATED,
    EXIT_FENCED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_UNCERTAIN,
    Flags,
    Ledger,
)


def requests_key(prefix: str, run_id: str, turn: int) -> str:
    """Redis list of the nonces of every answer the model gave for ``turn`` of the run."""
    return f"{prefix}:pai:{run_id}:requests:{turn}"


def build(opts: argparse.Namespace, settings: Settings) -> RunlogAgent[None, Any]:
    client = redis_client(settings)
    ledger = Ledger(client, settings.redis_key_prefix)
    flags = Flags(opts.dir, opts.name)

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        nonce = uuid.uuid4().hex
        flags.set("live", f"model {turn}")
        client.rpush(requests_key(settings.redis_key_prefix, opts.run_id, turn), nonce)
        time.sleep(opts.think_s)
        if opts.scenario == "steps" and turn < opts.steps:
            return ModelResponse(
                parts=[
                    TextPart(f"turn {turn} nonce {nonce}"),
                    ToolCallPart("lookup", {"order": turn}, tool_call_id=f"look-{turn}"),
                    ToolCallPart(
                        "charge", {"order": turn, "cents": 100 + turn}, tool_call_id=f"pay-{turn}"
                    ),
                ]
            )
        if opts.scenario == "safe" and turn == 0:
            return ModelResponse(
                parts=[
                    TextPart(f"looking up nonce {nonce}"),
                    ToolCallPart("lookup", {"order": 7}, tool_call_id="look-0"),
                ]
            )
        if opts.scenario in ("approval", "uncertain") and turn == 0:
            return ModelResponse(
                parts=[
                    TextPart(f"refunding nonce {nonce}"),
                    ToolCallPart("refund", {"order": 42, "cents": 700}, tool_call_id="refund-0"),
                ]
            )
        return ModelResponse(parts=[TextPart(f"done nonce {nonce}")])

    agent: Agent[None, Any] = Agent(
        FunctionModel(script), output_type=[str, DeferredToolRequests], name="pai-worker"
    )

    @agent.tool_plain
    def lookup(order: int) -> str:
        flags.set("live", f"lookup {order}")
        call = runlog.current_call()
        assert call is not None
        client.rpush(f"{settings.redis_key_prefix}:pai:lookups", call.idempotency_key)
        if opts.scenario == "safe" and opts.hold_lookup:
            flags.set("in_tool", call.idempotency_key)
            flags.hold()  # killed here: a safe call started, its completion never recorded
        return f"order {order}: 2 items"

    def found(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
        if ledger.found(idempotency_key) is not None:
            return runlog.Match(f"charged {args['cents']} for order {args['order']}")
        return runlog.Absent("the ledger has no effect with this key")

    @agent.tool_plain
    def charge(order: int, cents: int) -> str:
        call = runlog.current_call()
        assert call is not None, "charge runs only through runlog's call path"
        flags.set("live", f"charge {order}")
        ledger.apply(call.idempotency_key, json.dumps({"order": order, "cents": cents}))
        flags.set(f"charged-{order}", str(call.epoch))
        time.sleep(opts.tool_s)  # the receiver committed; the completion is not recorded yet
        return f"charged {cents} for order {order}"

    @agent.tool_plain(requires_approval=opts.scenario == "approval")
    def refund(order: int, cents: int) -> str:
        call = runlog.current_call()
        assert call is not None
        ledger.apply(call.idempotency_key, json.dumps({"order": order, "cents": cents}))
        if opts.scenario == "uncertain":
            flags.set("in_tool", call.idempotency_key)
            flags.hold()  # killed here: the refund happened, its completion never recorded
        return f"refunded {cents} for order {order}"

    return RunlogAgent(
        agent,
        tools={
            "charge": ToolPolicy("irreversible", reconcile=found, receiver="fenced"),
            "refund": ToolPolicy("irreversible"),
        },
        settings=settings,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument(
        "--scenario", default="steps", choices=["steps", "approval", "uncertain", "safe"]
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--think-s", type=float, default=0.02)
    ap.add_argument("--tool-s", type=float, default=0.0)
    ap.add_argument("--hold-lookup", action="store_true")
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument("--capability", action="store_true", help="RunlogDurability, not RunlogAgent")
    ap.add_argument("--wait-s", type=float, default=None)
    ap.add_argument("--approval-wait-s", type=float, default=0.0)
    ap.add_argument("--hold", action="store_true", help="wait for the go flag before running")
    opts = ap.parse_args()
    settings = Settings()
    flags = Flags(opts.dir, opts.name)
    durable = build(opts, settings)
    flags.set("started")
    if opts.hold:
        flags.hold()

    async def go() -> Any:
        return await durable.run(
            "Charge every order, then say done.",
            run_id=opts.run_id,
            takeover=opts.takeover,
            wait_s=opts.wait_s,
            approval_wait_s=opts.approval_wait_s,
        )

    async def go_capability() -> Any:
        # The agent itself, with runlog as a capability of this run.
        cap = RunlogDurability(
            tools=durable.policies,
            settings=settings,
            takeover=opts.takeover,
            wait_s=opts.wait_s,
            approval_wait_s=opts.approval_wait_s,
        )
        got = await durable.wrapped.run(
            "Charge every order, then say done.", run_id=opts.run_id, capabilities=[cap]
        )
        return got.output, cap.replayed_turns, cap.requested_turns

    code, result = EXIT_OK, {}
    try:
        if opts.capability:
            output, replayed, requested = asyncio.run(go_capability())
        else:
            got = asyncio.run(go())
            output, replayed, requested = got.output, got.replayed_turns, got.requested_turns
        result = {
            "outcome": "finished",
            "output": output,
            "replayed": replayed,
            "requested": requested,
        }
    except runlog.Escalated as exc:
        code, result = EXIT_ESCALATED, {"outcome": "escalated", "approval_id": exc.approval_id}
    except runlog.CallUncertain as exc:
        code, result = EXIT_UNCERTAIN, {"outcome": "uncertain", "error": str(exc)}
    except runlog.Fenced as exc:
        code, result = EXIT_FENCED, {"outcome": "fenced", "error": str(exc)}
    except runlog.RunLocked as exc:
        code, result = EXIT_LOCKED, {"outcome": "locked", "error": str(exc)}
    flags.set("result", json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
