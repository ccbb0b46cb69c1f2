"""Agents for the reconcile tests, imported by `runlog worker --agents workers.reconcile_agents`.

``refund`` is irreversible and declares a lookup. Its receiver holds the request in flight
until the test releases it (``<prefix>:release``), so a test can terminate the run while the
call is in flight and then let the fenced worker finish the effect: the receiver records the
effect (a count per key, ``<prefix>:effects``, and its result for the lookup) whoever sent
it. The lookup answers Match for a recorded effect, Inconclusive while ``<prefix>:lookup_down``
is set, else Absent. ``charge`` is irreversible with no lookup and ``mail`` reversible with
none, both held in flight the same way.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

import runlog

PREFIX = os.environ.get("RUNLOG_REDIS_KEY_PREFIX", "runlog")
HOLD_S = 120.0
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    return _client


def key(name: str) -> str:
    return f"{PREFIX}:{name}"


def _held(name: str, args: dict[str, Any], idempotency_key: str) -> str:
    client().hset(key("inflight"), idempotency_key, name)
    deadline = time.monotonic() + HOLD_S
    while not client().exists(key("release")) and time.monotonic() < deadline:
        time.sleep(0.02)
    result = f"{name} {args['amount']} to {args['to']}"
    pipe = client().pipeline(transaction=True)
    pipe.hincrby(key("effects"), idempotency_key, 1)
    pipe.hset(key("results"), idempotency_key, result)
    pipe.execute()
    return result


def _refund(args: dict[str, Any], *, idempotency_key: str) -> str:
    return _held("refunded", args, idempotency_key)


def _lookup(
    args: dict[str, Any], *, idempotency_key: str
) -> runlog.Match | runlog.Absent | runlog.Inconclusive:
    if client().exists(key("lookup_down")):
        return runlog.Inconclusive("the payment provider's lookup is down")
    client().hincrby(key("lookups"), idempotency_key, 1)
    found = client().hget(key("results"), idempotency_key)
    if found is None:
        return runlog.Absent("no refund recorded under the key")
    return runlog.Match(found.decode())


def _charge(args: dict[str, Any], *, idempotency_key: str) -> str:
    return _held("charged", args, idempotency_key)


refund = runlog.tool("refund", risk="irreversible", reconcile=_lookup)(_refund)
charge = runlog.tool("charge", risk="irreversible")(_charge)


@runlog.agent("refunder", tools=[refund])
def refunder(run: runlog.Run, order: dict[str, Any]) -> str:
    run.call_tool("refund", {"to": order["to"], "amount": order.get("amount", 30)})
    return "refunded"


@runlog.agent("charger", tools=[charge])
def charger(run: runlog.Run, order: dict[str, Any]) -> str:
    run.call_tool("charge", {"to": order["to"], "amount": 5})
    return "charged"


def _mail(args: dict[str, Any], *, idempotency_key: str) -> str:
    return _held("mailed", args, idempotency_key)


mail = runlog.tool("mail", risk="reversible")(_mail)


@runlog.agent("mailer", tools=[mail])
def mailer(run: runlog.Run, order: dict[str, Any]) -> str:
    run.call_tool("mail", {"to": order["to"], "amount": 0})
    return "mailed"
