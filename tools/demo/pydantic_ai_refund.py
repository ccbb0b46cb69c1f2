"""A Pydantic AI agent that refunds an order, killed and resumed from the command line.

    python -m tools.demo.pydantic_ai_refund [RUN_ID] [--pause-in-refund S] [--bank FILE]

Needs the ``pydantic-ai`` extra and a stack (``eval "$(runlog stack env)"``). The model is
a scripted ``FunctionModel`` (no network, no API key): it looks the order up, refunds it
through an ``irreversible`` tool whose reconciler asks the payment service (a JSON file
standing in for it) for a refund under the call's idempotency key, and says it is done.

Start it without a run id, kill it (``kill -9``) whenever you like, and run it again with
the run id it printed: the recorded model turns are replayed, never requested again, and
the refund is sent once. ``--pause-in-refund 30`` holds the refund tool for 30 s after
the payment service accepted it, so a kill lands in the window no idempotency key can
close: the next run finds the refund by its key (``Match``) instead of sending it again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import runlog
from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy

TENANT = "acme"


def build(bank: Path, pause_s: float) -> RunlogAgent[None, Any]:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def refunds() -> dict[str, int]:
        return dict(json.loads(bank.read_text())) if bank.exists() else {}

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        print(f"  model asked for turn {turn}")
        if turn == 0:
            return ModelResponse(
                parts=[
                    TextPart("Looking the order up."),
                    ToolCallPart("lookup", {"order": 42}, tool_call_id="lookup-42"),
                ]
            )
        if turn == 1:
            return ModelResponse(
                parts=[
                    TextPart("Refunding 7.00 EUR."),
                    ToolCallPart("refund", {"order": 42, "cents": 700}, tool_call_id="refund-42"),
                ]
            )
        return ModelResponse(parts=[TextPart("Order 42 refunded: 7.00 EUR.")])

    agent: Agent[None, str] = Agent(FunctionModel(script), name="refunds")

    @agent.tool_plain  # type: ignore[untyped-decorator,misc,unused-ignore]  # Any without the extra
    def lookup(order: int) -> str:
        """Look an order up."""
        return f"order {order}: 2 items, paid 7.00 EUR, arrived broken"

    @agent.tool_plain  # type: ignore[untyped-decorator,misc,unused-ignore]
    def refund(order: int, cents: int) -> str:
        """Refund an order (the payment service keeps the idempotency key with it)."""
        call = runlog.current_call()
        assert call is not None
        if cents <= 0:
            raise runlog.ToolError("amount must be positive")  # proven: nothing happened
        bank.write_text(json.dumps(refunds() | {call.idempotency_key: cents}))
        print(f"  refund sent with key {call.idempotency_key} (fencing token {call.epoch})")
        if pause_s:
            print(f"  pausing {pause_s:.0f}s before the completion is recorded: kill -9 me now")
            time.sleep(pause_s)
        return f"refunded {cents} cents for order {order}"

    def find_refund(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
        """Authoritative lookup by the key the refund was sent with."""
        if idempotency_key in refunds():
            return runlog.Match(f"refunded {args['cents']} cents for order {args['order']}")
        return runlog.Absent("the payment service has no refund with this key")

    return RunlogAgent(
        agent,
        # The payment service keeps one refund per key: a repeat under it changes nothing.
        tools={
            "refund": ToolPolicy("irreversible", reconcile=find_refund, receiver="dedupes_by_key")
        },
        tenant=TENANT,
    )


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo.pydantic_ai_refund")
    ap.add_argument("run_id", nargs="?", help="resume this run (omit to start one)")
    ap.add_argument("--bank", type=Path, default=Path("refunds.json"))
    ap.add_argument("--pause-in-refund", type=float, default=0.0, metavar="S")
    ap.add_argument("--takeover", action="store_true", help="the previous worker is dead")
    opts = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # kill -9 loses no line
    durable = build(opts.bank, opts.pause_in_refund)
    try:
        result = await durable.run(
            "Order 42 arrived broken; refund it.",
            run_id=opts.run_id,
            takeover=opts.takeover,
            on_open=lambda run_id: print(f"run {run_id}", flush=True),
        )
    except runlog.Escalated as exc:
        print(
            f"waiting for a person: runlog approve|reject {exc.run_id} {exc.approval_id} "
            f"--tenant {TENANT}"
        )
        return 2
    refunds = json.loads(opts.bank.read_text()) if opts.bank.exists() else {}
    print(
        f"{result.output} | turns replayed {result.replayed_turns}, "
        f"requested {result.requested_turns} | refunds in the payment service: {refunds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
