"""The demo's agent and its receiver (`runlog worker --agents runlog.demo.agents`).

The receiver is a ledger in Redis that is not idempotent: each ``refund`` adds one to the
count of its idempotency key and keeps its result for the lookup, in one MULTI. The demo's
summary asserts that every count is 1: each effect once, through every kill.
"""

from __future__ import annotations

import time
from typing import Any

import redis

import runlog
from runlog.log.clients import redis_client
from runlog.settings import Settings

STEP_S = 0.3
"""How long a refund is in flight: long enough for kills to land mid-call."""
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis_client(Settings())
    return _client


def ledger_key(settings: Settings, what: str) -> str:
    return f"{settings.redis_key_prefix}:demo:{what}"


def _refund(args: dict[str, Any], *, idempotency_key: str) -> str:
    time.sleep(STEP_S)  # in flight: kills land here
    s = Settings()
    result = f"refunded {args['amount']} on {args['order']}"
    pipe = client().pipeline(transaction=True)
    pipe.hincrby(ledger_key(s, "effects"), idempotency_key, 1)
    pipe.hset(ledger_key(s, "results"), idempotency_key, result)
    pipe.execute()
    return result


def _lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Match | runlog.Absent:
    found = client().hget(ledger_key(Settings(), "results"), idempotency_key)
    if found is None:
        return runlog.Absent("the ledger has no entry under the key")
    return runlog.Match(found.decode() if isinstance(found, bytes) else str(found))


refund = runlog.tool("refund", risk="irreversible", reconcile=_lookup)(_refund)


@runlog.agent("demo.refunds", tools=[refund])
def refunds(run: runlog.Run, order: dict[str, Any]) -> str:
    """Refund each line of an order, then pause for a second (a durable timer), then the fee."""
    for i, amount in enumerate(order["lines"]):
        run.call_tool("refund", {"order": order["order"], "line": i, "amount": amount})
    run.sleep(1.0)
    run.call_tool("refund", {"order": order["order"], "line": "fee", "amount": order["fee"]})
    return f"refunded {len(order['lines'])} lines and the fee of {order['order']}"
