"""Reconcile requests: a person asks the fleet to run an uncertain call's lookup.

The process that asks (``runlog reconcile``, the console) has no agent code and so no tools:
the lookup runs on a worker that has them. The request is durable, like a start: a record
of the lifecycle topic in the run's partition (so the worker that owns the run's partition
takes it), under a key of its own, ``<run id>/reconcile/<request id>`` (``/`` is not in the
run id alphabet): it never replaces the run's dispatch record, and two requests never
replace each other. Its value is canonical JSON::

    {"v": 1, "kind": "reconcile", "run_id": ..., "tenant": ..., "agent": ...,
     "keys": [...], "by": ..., "request_id": ...}

The worker runs ``producers._reconcile.reconcile`` with the agent's tools, then writes a
short reply to Redis (done or refused, and why: never content, only the refusal's kind and
the key it names; ``REPLY_TTL_S``) and tombstones the request. What the reconciliation
*recorded* is read from the run's log by whoever asked, never from the reply.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from runlog._settings import Settings
from runlog.errors import (
    AppendOutcomeUnknown,
    Fenced,
    KafkaUnavailable,
    NotReconcilable,
    RedisUnavailable,
    RunLocked,
    SchemaError,
    UnknownRun,
)
from runlog.fleet._lifecycle import LifecycleWriter
from runlog.fleet._registry import Agent
from runlog.log._clients import REDIS_ERRORS
from runlog.producers._engine import RunDeps
from runlog.producers._reconcile import reconcile

log = logging.getLogger(__name__)

SEPARATOR = "/reconcile/"
FORMAT = 1
REPLY_TTL_S = 24 * 3600
"""How long a worker's reply to a request is kept for the asker to read."""
RETRY_S = 1.0


@dataclass(frozen=True)
class ReconcileRequest:
    """A person's request that the fleet reconcile ``keys`` of ``run_id`` (all: empty)."""

    run_id: str
    tenant: str
    agent: str
    keys: tuple[str, ...]
    by: str
    request_id: str

    @property
    def key(self) -> str:
        return request_key(self.run_id, self.request_id)

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "v": FORMAT,
            "kind": "reconcile",
            "run_id": self.run_id,
            "tenant": self.tenant,
            "agent": self.agent,
            "keys": list(self.keys),
            "by": self.by,
            "request_id": self.request_id,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> ReconcileRequest:
        try:
            body = json.loads(value)
            if body.get("v") != FORMAT or body.get("kind") != "reconcile":
                raise ValueError(f"unknown request {body.get('v')}/{body.get('kind')}")
            return cls(
                run_id=str(body["run_id"]),
                tenant=str(body["tenant"]),
                agent=str(body["agent"]),
                keys=tuple(str(k) for k in body["keys"]),
                by=str(body["by"]),
                request_id=str(body["request_id"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SchemaError(f"undecodable reconcile request: {exc}") from exc


def request_key(run_id: str, request_id: str) -> str:
    return f"{run_id}{SEPARATOR}{request_id}"


def is_request_key(key: str) -> bool:
    return SEPARATOR in key


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def reply_key(settings: Settings, request_id: str) -> str:
    return f"{settings.redis_key_prefix}:reconcile:{request_id}"


def write_reply(
    client: redis.Redis, settings: Settings, request_id: str, reply: dict[str, str]
) -> None:
    try:
        client.set(
            reply_key(settings, request_id), json.dumps(reply, sort_keys=True), ex=REPLY_TTL_S
        )
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"reply to reconcile request {request_id}: {exc}") from exc


def read_reply(client: redis.Redis, settings: Settings, request_id: str) -> dict[str, str] | None:
    try:
        raw = client.get(reply_key(settings, request_id))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"reply to reconcile request {request_id}: {exc}") from exc
    if raw is None:
        return None
    found: dict[str, str] = json.loads(raw)
    return found


@dataclass(frozen=True)
class Served:
    """What a worker did with a request: ``done`` (replied, tombstoned) or ``retry`` later."""

    kind: str
    retry_s: float = 0.0
    why: str = ""


def serve(
    deps: RunDeps, lw: LifecycleWriter, req: ReconcileRequest, agent: Agent, worker: str
) -> Served:
    """Run one request on this worker (``Worker``'s pool): reconcile under the run's lease,
    never waiting for a live owner (tried again when its lease may have ended), reply,
    tombstone the request."""
    reply: dict[str, str] = {"worker": worker, "run_id": req.run_id}
    try:
        if read_reply(deps.redis, deps.settings, req.request_id) is not None:
            # Served already (a crash before the tombstone): the reply stands; a second
            # reconcile would answer "not open" for the keys the first one settled.
            lw.write_value(req.run_id, None, key=req.key)
            return Served("done", why="replied before")
    except (RedisUnavailable, KafkaUnavailable) as exc:
        return Served("retry", RETRY_S, str(exc))
    try:
        done = reconcile(
            deps,
            req.run_id,
            tenant=req.tenant,
            tools=agent.tools,
            keys=req.keys,
            by=req.by,
            wait_s=0,
        )
    except RunLocked as exc:
        ttl = exc.holder_ttl_ms if exc.holder_ttl_ms is not None else deps.settings.lease_ttl_ms
        return Served("retry", max(0.05, ttl / 1000 + 0.05), str(exc))
    except (Fenced, AppendOutcomeUnknown, KafkaUnavailable, RedisUnavailable) as exc:
        return Served("retry", RETRY_S, str(exc))
    except NotReconcilable as exc:
        reply.update(status="refused", why=exc.why, key=exc.key or "", message=str(exc))
    except UnknownRun as exc:
        reply.update(status="refused", why="unknown_run", key="", message=str(exc))
    else:
        keys = ",".join(x.key for x in done.settled)
        reply.update(status="done", epoch=str(done.epoch), keys=keys)
    try:
        write_reply(deps.redis, deps.settings, req.request_id, reply)
        lw.write_value(req.run_id, None, key=req.key)
    except (RedisUnavailable, KafkaUnavailable) as exc:
        return Served("retry", RETRY_S, str(exc))
    log.info("reconcile request %s of %s: %s", req.request_id, req.run_id, reply.get("status"))
    return Served("done", why=reply.get("status", ""))
