"""Per-tenant retention policies: how long a tenant's ended runs keep their content.

A policy is configuration an operator sets (``runlog retention set``), not a fact about a
run, so it is kept in Redis (one hash, ``<prefix>:retention``: tenant -> policy JSON with
who set it and when), beside the other operator decisions (set-aside records), and not in
the log. What losing it costs: nothing is lost or wrongly erased. Retention stops erasing
until the policy is set again, and ``runlog retention show`` shows it missing. That is a
missed deadline, not harm. A deployment that must not miss one keeps its policies as
configuration (the CronJob passes ``--finished-older-than`` to ``retention apply``, which
needs no stored policy) or runs Redis with AOF ``appendfsync always`` (docs/howto/erasure.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import redis

from runlog._settings import Settings
from runlog.errors import ConfigError, RedisUnavailable
from runlog.log._clients import REDIS_ERRORS
from runlog.schemas._keys import check_tenant

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> int:
    """Seconds in an age such as ``30d``, ``12h``, ``90m`` or ``45s`` (at least a second)."""
    match = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"an age is a whole number and a unit (s, m, h, d), not {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Policy:
    """Forget every run of ``tenant`` that ended more than ``finished_older_than`` ago."""

    tenant: str
    finished_older_than: str
    seconds: int
    set_by: str
    set_at: str


def policy_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:retention"


def set_policy(
    client: redis.Redis, settings: Settings, tenant: str, finished_older_than: str, *, by: str
) -> Policy:
    """Store (or replace) ``tenant``'s policy."""
    check_tenant(tenant)
    if not by.strip():
        raise ValueError("who sets the policy is required (by)")
    policy = Policy(
        tenant,
        finished_older_than.strip(),
        parse_age(finished_older_than),
        by,
        datetime.now(UTC).isoformat(),
    )
    try:
        client.hset(policy_key(settings), tenant, json.dumps(asdict(policy), sort_keys=True))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"retention policy of {tenant}: {exc}") from exc
    return policy


def clear_policy(client: redis.Redis, settings: Settings, tenant: str) -> bool:
    """Remove ``tenant``'s policy; False if it had none."""
    try:
        return bool(client.hdel(policy_key(settings), tenant))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"retention policy of {tenant}: {exc}") from exc


def policies(client: redis.Redis, settings: Settings) -> list[Policy]:
    """Every tenant's policy, by tenant."""
    try:
        raw = client.hgetall(policy_key(settings))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"retention policies: {exc}") from exc
    return sorted((Policy(**json.loads(v)) for v in raw.values()), key=lambda p: p.tenant)
