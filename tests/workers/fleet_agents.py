"""Agents for the fleet tests, imported by `runlog worker --agents workers.fleet_agents`.

The receiver is not idempotent: each call of ``pay`` adds one to the count of its key in
Redis (``<prefix>:effects``) and records its result for the lookup (``<prefix>:results``),
in one script. A test asserts every count is 1 (every effect once). It is fenced: it
refuses a request whose token is below the highest it has seen for the key, and
``pay``'s reconciler raises that floor to the asking owner's token before it looks the
key up: an effect that landed is a Match, one that did not is Absent, and then no older
request can land later (a paused worker's, say).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

import runlog
from workers.common import fenced_effect, raise_floor

PREFIX = os.environ.get("RUNLOG_REDIS_KEY_PREFIX", "runlog")
STEP_S = float(os.environ.get("FLEET_TEST_STEP_S", "0.05"))
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    return _client


def effects_key() -> str:
    return f"{PREFIX}:effects"


def results_key() -> str:
    return f"{PREFIX}:results"


def floors_key() -> str:
    return f"{PREFIX}:floors"


def _pay(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
    time.sleep(STEP_S)  # the call is in flight: a kill lands here too
    result = f"paid {args['amount']} to {args['to']}"
    landed = fenced_effect(
        client(),
        floors_key(),
        idempotency_key,
        fencing_token,
        counter=effects_key(),
        results=results_key(),
        result=result,
    )
    if not landed:
        raise runlog.ToolError(f"refused {idempotency_key}: a newer owner holds the run")
    return result


def _lookup(
    args: dict[str, Any], *, idempotency_key: str, fencing_token: int
) -> runlog.Match | runlog.Absent:
    raise_floor(client(), floors_key(), idempotency_key, fencing_token)
    found = client().hget(results_key(), idempotency_key)
    if found is None:
        return runlog.Absent("no effect recorded under the key")
    return runlog.Match(found.decode())


pay = runlog.tool("pay", risk="irreversible", reconcile=_lookup, receiver="fenced")(_pay)


@runlog.agent("payer", tools=[pay])
def payer(run: runlog.Run, order: dict[str, Any]) -> str:
    for i in range(int(order["steps"])):
        run.call_tool("pay", {"to": order["to"], "amount": i})
    return f"paid {order['steps']} times"


@runlog.agent("sleeper", tools=[pay])
def sleeper(run: runlog.Run, order: dict[str, Any]) -> str:
    run.call_tool("pay", {"to": order["to"], "amount": 1})
    run.sleep(float(order["sleep_s"]))
    run.call_tool("pay", {"to": order["to"], "amount": 2})
    return "woke and paid"


@runlog.agent("asker", tools=[pay])
def asker(run: runlog.Run, order: dict[str, Any]) -> str:
    """Asks a person before paying; the decision (approve) lets it pay."""
    approvals = [a for a in run.state.approvals.values() if a.kind == "action"]
    if not approvals:
        aid = run.request_approval("pay the supplier?")
        raise runlog.Escalated("waiting for a person", approval_id=aid, run_id=run.run_id)
    if approvals[0].approved is None:
        raise runlog.Escalated("waiting for a person", run_id=run.run_id)
    if approvals[0].approved:
        run.call_tool("pay", {"to": order["to"], "amount": 9})
        return "approved and paid"
    return "rejected"


@runlog.agent("failing", retries=1, retry_delay_s=0.2)
def failing(run: runlog.Run, order: dict[str, Any]) -> str:
    raise ValueError(f"cannot handle {order}")


@runlog.agent("stumbler", retries=3, retry_delay_s=0.2)
def stumbler(run: runlog.Run, order: dict[str, Any]) -> str:
    """Notes that it began, waits ``order["wait_s"]`` (not a step: a cancel made meanwhile is
    not seen there), then fails."""
    run.append(runlog.EventType.MEMORY_WRITTEN, key="began", value="yes")
    time.sleep(float(order["wait_s"]))
    raise ValueError("stumbled")


@runlog.agent("apayer", tools=[pay])
async def apayer(run: runlog.aio.AsyncRun, order: dict[str, Any]) -> str:
    for i in range(int(order["steps"])):
        await run.call_tool("pay", {"to": order["to"], "amount": i})
    await run.sleep(float(order.get("sleep_s", 0)))
    return "async paid"


@runlog.agent("needs_fix", tools=[pay])
def needs_fix(run: runlog.Run, order: dict[str, Any]) -> str:
    """Waits for a person until a fix is deployed (a flag in Redis), then pays."""
    if client().get(f"{PREFIX}:fixed") is None:
        raise runlog.Escalated("needs a fix deployed", run_id=run.run_id)
    run.call_tool("pay", {"to": order["to"], "amount": 5})
    return "fixed and paid"


@runlog.agent("napper")
def napper(run: runlog.Run, order: dict[str, Any]) -> str:
    run.sleep(float(order["sleep_s"]))
    return "rested"


def saw_cancel_key() -> str:
    return f"{PREFIX}:saw_cancel"


@runlog.agent("stoppable", tools=[pay])
def stoppable(run: runlog.Run, order: dict[str, Any]) -> str:
    """Pays once, then waits (``order["wait"]``: ``"sleep"`` on a durable timer of an hour,
    ``"person"`` for an approval); a cancellation reaches it at its next step and is let out
    (the agent does not catch it), after noting in Redis that the agent saw it."""
    try:
        run.call_tool("pay", {"to": order["to"], "amount": 1})
        if order["wait"] == "sleep":
            run.sleep(3600)
        else:
            if not run.state.approvals:
                aid = run.request_approval("pay again?")
                raise runlog.Escalated("waiting for a person", approval_id=aid, run_id=run.run_id)
            raise runlog.Escalated("still waiting for a person", run_id=run.run_id)
        run.call_tool("pay", {"to": order["to"], "amount": 2})
        return "paid twice"
    except runlog.Cancelled:
        client().hincrby(saw_cancel_key(), run.run_id, 1)
        raise


@runlog.agent("cancel_in_flight", tools=[pay])
def cancel_in_flight(run: runlog.Run, order: dict[str, Any]) -> str:
    """Steps until a person cancels (``Cancelled`` is let out of the agent)."""
    for i in range(10_000):
        run.call_tool("pay", {"to": order["to"], "amount": i})
        time.sleep(0.05)
    return "never cancelled"


def seen_key() -> str:
    return f"{PREFIX}:seen"


@runlog.agent("chatter")
def chatter(run: runlog.Run, task: dict[str, Any]) -> str:
    """A conversation without a model: it keeps what it was handed (its input and the
    conversation its run holds) per run, then says its piece. A new run answers twice
    with a compaction between; a fork (a run with a conversation already) answers once."""
    import json

    held = [[m.role, m.content] for m in run.state.messages]
    client().hset(seen_key(), run.run_id, json.dumps({"input": task, "messages": held}))
    turn = {"tool_calls": [], "usage": {"input_tokens": 1, "output_tokens": 1}, "cost_usd": 0.0}
    run.append(runlog.EventType.USER_MESSAGE, content=task["ask"])
    run.append(runlog.EventType.MODEL_TURN, text=f"answer to {task['ask']}", **turn)
    if not held:
        run.append(
            runlog.EventType.CONTEXT_COMPACTED, summary="answered once", kept_turns=1, dropped=0
        )
        run.append(runlog.EventType.MODEL_TURN, text="and again", **turn)
    return "said"


@runlog.agent("noter")
def noter(run: runlog.Run, order: dict[str, Any]) -> str:
    """Appends a note every 50 ms (no model turn, no tool call) for ``order["notes"]`` notes;
    a cancellation reaches it at its next append and is let out, after noting in Redis that
    the agent saw it."""
    try:
        for i in range(int(order["notes"])):
            run.append(runlog.EventType.MEMORY_WRITTEN, key="note", value=str(i))
            time.sleep(0.05)
        return "noted everything"
    except runlog.Cancelled:
        client().hincrby(saw_cancel_key(), run.run_id, 1)
        raise
