"""The demo's agent and its receiver (`runlog worker --agents tools.demo.agents`).

The receiver is a ledger in Redis that is not idempotent: each ``refund`` adds one to the
count of its idempotency key and keeps its result for the lookup. It honours the fencing
token every request carries: it refuses a request whose token is below the highest it has
seen for the key, and the lookup (asked by a new owner, with its token) raises that floor
before it answers, so "absent" also means "the older request is refused from now on". Each
is one script. The demo's summary asserts that every count is 1: each effect once, through
every kill and every pause (a paused worker's refund in flight lands after the takeover,
and is refused).
"""

from __future__ import annotations

import time
from typing import Any

import redis

import runlog
from runlog._settings import Settings
from runlog.log._clients import redis_client

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


# KEYS: floors, effects, results, refused; ARGV: key, token, result.
_APPLY = """
if tonumber(ARGV[2]) < tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') then
  redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
"""

# KEYS: floors, results; ARGV: key, token.
_LOOKUP = """
if tonumber(ARGV[2]) > tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('HGET', KEYS[2], ARGV[1])
"""


def _refund(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
    time.sleep(STEP_S)  # in flight: kills and pauses land here
    s = Settings()
    result = f"refunded {args['amount']} on {args['order']}"
    keys = [ledger_key(s, w) for w in ("floors", "effects", "results", "refused")]
    if not client().eval(_APPLY, len(keys), *keys, idempotency_key, fencing_token, result):
        raise runlog.ToolError(f"the ledger refused {idempotency_key}: a newer owner holds it")
    return result


def _lookup(
    args: dict[str, Any], *, idempotency_key: str, fencing_token: int
) -> runlog.Match | runlog.Absent:
    keys = [ledger_key(Settings(), w) for w in ("floors", "results")]
    found = client().eval(_LOOKUP, len(keys), *keys, idempotency_key, fencing_token)
    if found is None:
        return runlog.Absent("the ledger has no entry under the key")
    return runlog.Match(found.decode() if isinstance(found, bytes) else str(found))


refund = runlog.tool("refund", risk="irreversible", reconcile=_lookup, receiver="fenced")(_refund)


@runlog.agent("demo.refunds", tools=[refund])
def refunds(run: runlog.Run, order: dict[str, Any]) -> str:
    """Refund each line of an order, then pause for a second (a durable timer), then the fee."""
    for i, amount in enumerate(order["lines"]):
        run.call_tool("refund", {"order": order["order"], "line": i, "amount": amount})
    run.sleep(1.0)
    run.call_tool("refund", {"order": order["order"], "line": "fee", "amount": order["fee"]})
    return f"refunded {len(order['lines'])} lines and the fee of {order['order']}"
