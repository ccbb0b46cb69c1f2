"""An OpenAI Agents SDK agent run by runlog, in a process the tests kill and resume.

    python tests/workers/oai_worker.py --dir D --name N --run-id R --scenario steps

The model is a scripted ``agents`` ``Model`` (no network, no key). Every answer it gives is
logged in Redis with a fresh nonce in the response text, so a test can tell afterwards
whether a turn the log holds was ever requested again. The ``charge`` tool applies its
effect to the ledger in Redis (outside this process, not idempotent: every apply counts),
keyed by idempotency key; its reconciler is an authoritative lookup of that ledger. Flags,
result file and exit codes follow ``agent_worker.py``.
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

from agents import Agent, function_tool, set_tracing_disabled  # noqa: E402
from agents.items import ModelResponse  # noqa: E402
from agents.models.interface import Model  # noqa: E402
from agents.usage import Usage  # noqa: E402
from openai.types.responses import (  # noqa: E402
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.integrations.openai_agents import RunlogAgents, ToolPolicy  # noqa: E402
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

PROMPT = "Charge every order, then say done."


def requests_key(prefix: str, run_id: str, turn: int) -> str:
    """Redis list of the nonces of every answer the model gave for ``turn`` of the run."""
    return f"{prefix}:oai:{run_id}:requests:{turn}"


def message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg-{uuid.uuid4().hex[:8]}",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


def call(name: str, call_id: str, **args: Any) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call", call_id=call_id, name=name, arguments=json.dumps(args)
    )


class ScriptedModel(Model):
    """Turn t (the number of model answers in the input so far) of a scripted agent."""

    def __init__(self, opts: argparse.Namespace, settings: Settings, flags: Flags) -> None:
        self.opts, self.settings, self.flags = opts, settings, flags
        self.redis = redis_client(settings)

    def _answer(self, items: Any) -> list[Any]:
        turn = (
            0
            if isinstance(items, str)
            else sum(
                1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
            )
        )
        opts = self.opts
        nonce = uuid.uuid4().hex
        self.flags.set("live", f"model {turn}")
        self.redis.rpush(requests_key(self.settings.redis_key_prefix, opts.run_id, turn), nonce)
        time.sleep(opts.think_s)
        if opts.scenario == "steps" and turn < opts.steps:
            return [
                message(f"turn {turn} nonce {nonce}"),
                call("charge", f"pay-{turn}", order=turn, cents=100 + turn),
            ]
        if opts.scenario == "approval" and turn == 0:
            return [message(f"refunding nonce {nonce}"), call("refund", "refund-0", order=42)]
        if opts.scenario == "held" and turn == 0:
            return [message(f"moving nonce {nonce}"), call("transfer", "move-0", order=9)]
        return [message(f"done nonce {nonce}")]

    async def get_response(self, system_instructions: Any, input: Any, *a: Any, **kw: Any) -> Any:
        output = self._answer(input)
        return ModelResponse(
            output=output,
            usage=Usage(requests=1, input_tokens=5, output_tokens=7),
            response_id=None,
        )

    async def stream_response(self, *a: Any, **kw: Any) -> Any:  # pragma: no cover
        raise NotImplementedError
        yield


def build(opts: argparse.Namespace, settings: Settings) -> RunlogAgents:
    client = redis_client(settings)
    ledger = Ledger(client, settings.redis_key_prefix)
    flags = Flags(opts.dir, opts.name)

    @function_tool
    def charge(order: int, cents: int) -> str:
        """Charge an order."""
        ctx = runlog.current_call()
        assert ctx is not None, "charge runs only through runlog's call path"
        flags.set("live", f"charge {order}")
        flags.set(f"in-{order}", str(ctx.epoch))
        time.sleep(opts.pre_s)  # the call is STARTED; the receiver has not seen it yet
        ledger.apply(ctx.idempotency_key, json.dumps({"order": order, "cents": cents}))
        flags.set(f"charged-{order}", str(ctx.epoch))
        time.sleep(opts.tool_s)  # the receiver committed; the completion is not recorded yet
        return f"charged {cents} for order {order}"

    @function_tool(needs_approval=True)
    def refund(order: int) -> str:
        """Refund an order."""
        ctx = runlog.current_call()
        assert ctx is not None
        ledger.apply(ctx.idempotency_key, json.dumps({"order": order}))
        return f"refunded order {order}"

    @function_tool
    def transfer(order: int) -> str:
        """Transfer money for an order."""
        ctx = runlog.current_call()
        assert ctx is not None
        ledger.apply(ctx.idempotency_key, json.dumps({"order": order}))
        flags.set("in_tool", ctx.idempotency_key)
        flags.hold()  # held here: the effect happened, its completion is not recorded
        return f"transferred for order {order}"

    def found(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
        if ledger.found(idempotency_key) is not None:
            return runlog.Match(f"charged {args['cents']} for order {args['order']}")
        return runlog.Absent("the ledger has no effect with this key")

    agent = Agent(
        name="oai-worker",
        instructions="Charge every order, then say done.",
        model=ScriptedModel(opts, settings, flags),
        tools=[charge, refund, transfer],
    )
    return RunlogAgents(
        agent,
        tools={
            "charge": ToolPolicy("irreversible", reconcile=found, receiver="fenced"),
            "refund": ToolPolicy("irreversible"),
            "transfer": ToolPolicy("irreversible"),
        },
        settings=settings,
        session=opts.session,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--run-id", required=True, help="'new': RunlogAgents.start mints one")
    ap.add_argument("--scenario", default="steps", choices=["steps", "approval", "held"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--think-s", type=float, default=0.02)
    ap.add_argument("--pre-s", type=float, default=0.0)
    ap.add_argument("--tool-s", type=float, default=0.0)
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument("--session", action="store_true", help="history in a RunlogSession")
    ap.add_argument("--wait-s", type=float, default=None)
    ap.add_argument("--approval-wait-s", type=float, default=0.0)
    opts = ap.parse_args()
    set_tracing_disabled(True)  # offline: no trace export
    settings = Settings()
    flags = Flags(opts.dir, opts.name)
    durable = build(opts, settings)
    flags.set("started")

    async def drive() -> Any:
        options = {"takeover": opts.takeover, "wait_s": opts.wait_s}
        options["approval_wait_s"] = opts.approval_wait_s
        if opts.run_id != "new":
            return await durable.run(PROMPT, run_id=opts.run_id, **options)
        handle = durable.start(PROMPT, **options)
        opts.run_id = handle.run_id  # the scripted model logs its answers under it
        flags.set("run_id", handle.run_id)  # kept before the model is asked
        return await handle

    code, result = EXIT_OK, {}
    try:
        got = asyncio.run(drive())
        result = {
            "outcome": "finished",
            "output": got.output,
            "replayed": got.replayed_turns,
            "requested": got.requested_turns,
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
