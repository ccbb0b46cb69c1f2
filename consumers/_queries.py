"""Reading the projections: library functions behind ``runlog state|uncertain|audit|...``.

Ages and overdue actions are computed here, at query time, from the start times the
uncertain-call projection stored; the projection itself never reads a clock. What these
return is what printers show: fields named by ``RUNLOG_REDACT_FIELDS`` come back redacted
(``runlog.consumers._redaction``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis

from runlog._settings import Settings
from runlog.consumers._redaction import redact_entry, secret_fields
from runlog.consumers._store import RUN_STATE, ProjectionKeys, load_state_view
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import RedisUnavailable, TenantMismatch
from runlog.log._clients import REDIS_ERRORS
from runlog.schemas._keys import check_run_id, partition_for

DEFAULT_DEADLINES_S: Mapping[str, float] = {
    "irreversible": 15 * 60,
    "reversible": 60 * 60,
    "safe": 4 * 60 * 60,
}
"""How long an uncertain call of each risk class may stay open before it is overdue."""

T = TypeVar("T")


def _keys(settings: Settings, name: str) -> ProjectionKeys:
    return ProjectionKeys(settings.redis_key_prefix, name, settings.events_topic)


def incomplete(client: redis.Redis, settings: Settings, names: Sequence[str]) -> list[str]:
    """The projections among ``names`` a rebuild left incomplete: it died after it may
    have started deleting, before its refold reached the end (``runner.rebuild``)."""
    with client.pipeline(transaction=False) as pipe:
        # One EXISTS per marker: the markers of several projections share no slot.
        for name in names:
            pipe.exists(_keys(settings, name).incomplete_marker())
        found = pipe.execute()
    return [n for n, e in zip(names, found, strict=True) if int(e)]


def _partitions(settings: Settings) -> range:
    return range(settings.partitions)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _wrap(exc: Exception, what: str) -> RedisUnavailable:
    return RedisUnavailable(f"{what}: {exc}")


def refuse_other_tenant(owner: str, tenant: str | None, run_id: str) -> None:
    """``TenantMismatch`` if ``run_id`` is owned by a tenant other than ``tenant``.

    The message never names the owner: a tenant may learn that a run id is taken, not by
    whom. ``tenant=None`` (a library caller that checks nothing) and a run whose owner is
    not known yet (no valid RUN_STARTED) pass.
    """
    if tenant is not None and owner and owner != tenant:
        raise TenantMismatch(
            f"run {run_id} belongs to another tenant, not to {tenant!r}", run_id=run_id
        )


def _find_run(
    client: redis.Redis, keys: ProjectionKeys, settings: Settings, run_id: str
) -> int | None:
    """The partition holding ``run_id`` in this projection (its murmur2 one first)."""
    first = partition_for(run_id, settings.partitions)
    order = [first, *(p for p in _partitions(settings) if p != first)]
    for p in order:
        if client.exists(keys.run(p, run_id)):
            return p
    return None


def _read_run(
    client: redis.Redis,
    settings: Settings,
    name: str,
    run_id: str,
    read: Callable[[ProjectionKeys, int], T],
) -> T | None:
    """``read`` of projection ``name`` on the partition holding ``run_id`` (None if none)."""
    check_run_id(run_id)
    keys = _keys(settings, name)
    try:
        p = _find_run(client, keys, settings, run_id)
        return None if p is None else read(keys, p)
    except REDIS_ERRORS as exc:
        raise _wrap(exc, f"{name} projection of {run_id}") from exc


def get_state(
    client: redis.Redis, settings: Settings, run_id: str, *, tenant: str | None = None
) -> dict[str, Any] | None:
    """The state projection of ``run_id``: full view plus summary, or None if unknown.

    With ``tenant``, a run of another tenant is refused (``TenantMismatch``).
    """
    view = _read_run(
        client, settings, "state", run_id, lambda k, p: load_state_view(client, k, p, run_id)
    )
    if view is None:
        return None
    refuse_other_tenant(view["state"]["tenant"], tenant, run_id)
    return redact_entry(view, secret_fields(settings))


def get_summary(
    client: redis.Redis, settings: Settings, run_id: str, *, tenant: str | None = None
) -> dict[str, str] | None:
    raw = _read_run(
        client, settings, "state", run_id, lambda k, p: client.hgetall(k.summary(p, run_id))
    )
    if raw is None:
        return None
    summary = {_s(k): _s(v) for k, v in raw.items()}
    refuse_other_tenant(summary.get("tenant", ""), tenant, run_id)
    return summary


def get_audit(
    client: redis.Redis, settings: Settings, run_id: str, *, tenant: str | None = None
) -> list[dict[str, Any]]:
    """The audit entries of ``run_id``, in log order (empty if unknown).

    With ``tenant``, a run of another tenant is refused (``TenantMismatch``): the owner is
    the tenant of the run's valid RUN_STARTED, as the audit projection's validator folded it.
    """
    found = _read_run(
        client,
        settings,
        "audit",
        run_id,
        lambda k, p: (client.get(k.run(p, run_id)), client.lrange(k.log(p, run_id), 0, -1)),
    )
    if found is None:
        return []
    run_raw, raws = found
    owner = ""
    if run_raw is not None:
        stored = json.loads(run_raw)
        # ``validator``: the whole run state, as an earlier store kept it.
        owner = stored.get(RUN_STATE, stored.get("validator", {})).get("tenant", "")
    refuse_other_tenant(owner, tenant, run_id)
    secret = secret_fields(settings)
    return [redact_entry(json.loads(r), secret) for r in raws]


@dataclass
class UncertainReport:
    now: str
    counters: dict[str, int]
    open: list[dict[str, Any]]
    """Open uncertain calls, oldest first, each with ``age_s`` and ``overdue``."""
    oldest_age_s: dict[str, float]
    """Risk class -> age of its oldest open call."""
    by_status: dict[str, int]
    overdue: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "counters": self.counters,
            "still_open": len(self.open),
            "by_status": self.by_status,
            "oldest_age_s": self.oldest_age_s,
            "open": self.open,
            "overdue": self.overdue,
        }


def uncertain_report(
    client: redis.Redis,
    settings: Settings,
    *,
    now: datetime | None = None,
    deadlines_s: Mapping[str, float] | None = None,
    tenant: str | None = None,
) -> UncertainReport:
    """The uncertain-call queue with ages and overdue actions as of ``now``.

    With ``tenant``, only that tenant's calls; the counters (kept per partition, for all
    tenants) are then left out rather than shown for everyone."""
    at = now or datetime.now(UTC)
    limits = {**DEFAULT_DEADLINES_S, **(deadlines_s or {})}
    keys = _keys(settings, "uncertain")
    secret = secret_fields(settings)
    counters: dict[str, int] = {}
    calls: list[dict[str, Any]] = []
    try:
        for p in _partitions(settings):
            for k, v in client.hgetall(keys.counters(p)).items():
                counters[_s(k)] = counters.get(_s(k), 0) + int(v)
            # The run id is read from the call itself, never split out of the field name:
            # one bad id stored by an older runner must not break the queue for everyone.
            raws = client.hvals(keys.open(p))
            entries = (json.loads(raw) for raw in raws)
            calls.extend(
                redact_entry(e, secret) for e in entries if tenant is None or e["tenant"] == tenant
            )
    except REDIS_ERRORS as exc:
        raise _wrap(exc, "uncertain calls") from exc
    if tenant is not None:
        counters = {}
    oldest: dict[str, float] = {}
    by_status: dict[str, int] = {}
    overdue: list[dict[str, Any]] = []
    for call in calls:
        age = (at - datetime.fromisoformat(call["first_started_at"])).total_seconds()
        call["age_s"] = round(age, 3)
        limit = limits.get(call["risk"], limits["irreversible"])
        call["deadline_s"] = limit
        call["overdue"] = age > limit
        oldest[call["risk"]] = max(oldest.get(call["risk"], 0.0), call["age_s"])
        by_status[call["status"]] = by_status.get(call["status"], 0) + 1
        if call["overdue"]:
            overdue.append(
                {
                    "run_id": call["run_id"],
                    "tool": call["tool"],
                    "idempotency_key": call["idempotency_key"],
                    "risk": call["risk"],
                    "age_s": call["age_s"],
                    "deadline_s": limit,
                    "status": call["status"],
                }
            )
    calls.sort(key=lambda c: (-c["age_s"], c["run_id"], c["idempotency_key"]))
    overdue.sort(key=lambda c: -c["age_s"])
    return UncertainReport(
        now=at.isoformat(),
        counters=counters,
        open=calls,
        oldest_age_s=oldest,
        by_status=by_status,
        overdue=overdue,
    )


def quarantined(
    client: redis.Redis, settings: Settings, projections: tuple[str, ...] = PROJECTIONS
) -> list[dict[str, Any]]:
    """Quarantined records, one entry per (topic, partition, offset), with the projections
    that quarantined it."""
    found: dict[tuple[str, int, int], dict[str, Any]] = {}
    try:
        for name in projections:
            keys = _keys(settings, name)
            for p in _partitions(settings):
                for _, raw in client.hgetall(keys.quarantine(p)).items():
                    rec = json.loads(raw)
                    ident = (rec["topic"], rec["partition"], rec["offset"])
                    entry = found.setdefault(ident, {**rec, "projections": []})
                    entry["projections"].append(name)
    except REDIS_ERRORS as exc:
        raise _wrap(exc, "quarantine") from exc
    return [found[k] for k in sorted(found)]


def positions(
    client: redis.Redis, settings: Settings, name: str
) -> dict[int, dict[str, int | None]]:
    """Per partition: stored position and durable counters of projection ``name``."""
    keys = _keys(settings, name)
    out: dict[int, dict[str, int | None]] = {}
    try:
        for p in _partitions(settings):
            raw = client.get(keys.pos(p))
            stats = client.hgetall(keys.stats(p))
            out[p] = {
                "position": None if raw is None else int(raw),
                "applied": int(stats.get(b"applied", 0)),
                "quarantined": int(stats.get(b"quarantined", 0)),
                "sealed_no_key": int(stats.get(b"sealed_no_key", 0)),
                "sealed_runs": int(client.hlen(keys.sealed(p))),
            }
    except REDIS_ERRORS as exc:
        raise _wrap(exc, f"positions of {name}") from exc
    return out


def dump_projection(client: redis.Redis, settings: Settings, name: str) -> dict[str, Any]:
    """Every key of projection ``name`` with its exact stored value (for equality checks)."""
    keys = _keys(settings, name)
    out: dict[str, Any] = {}
    for key in sorted(client.scan_iter(match=keys.pattern(), count=1000)):
        kind = client.type(key)
        if kind == b"string":
            out[key.decode()] = client.get(key)
        elif kind == b"hash":
            out[key.decode()] = dict(sorted(client.hgetall(key).items()))
        elif kind == b"list":
            out[key.decode()] = client.lrange(key, 0, -1)
        elif kind == b"set":
            out[key.decode()] = sorted(client.smembers(key))
        elif kind == b"zset":
            out[key.decode()] = client.zrange(key, 0, -1, withscores=True)
        else:  # pragma: no cover - the store writes only these types
            out[key.decode()] = kind
    return out


@dataclass
class ApprovalsReport:
    """The approval requests no one has decided yet (``runlog approvals``)."""

    pending: list[dict[str, Any]]
    """Oldest request first: who asked, when, why, by when, and its notification."""
    tracked: bool
    """The notify projection has folded at least one partition (else nothing is known)."""

    @property
    def overdue(self) -> list[dict[str, Any]]:
        return [a for a in self.pending if a["overdue"]]

    def to_dict(self) -> dict[str, Any]:
        return {"pending": self.pending, "overdue": len(self.overdue), "tracked": self.tracked}


def _delivery(raw: bytes | str | None) -> dict[str, Any]:
    """A notification's delivery as ``runlog approvals`` shows it."""
    if raw is None:
        return {"status": "none", "attempts": 0, "last_error": None, "delivered_at": None}
    rec = json.loads(raw)
    return {
        "status": rec.get("status"),
        "attempts": int(rec.get("attempts") or 0),
        "last_error": rec.get("last_error") or None,
        "delivered_at": rec.get("delivered_at") or None,
    }


def approvals_report(
    client: redis.Redis,
    settings: Settings,
    *,
    tenant: str | None = None,
    now: datetime | None = None,
) -> ApprovalsReport:
    """Pending approval requests from the notify projection, with the delivery of each
    one's notification; ``overdue`` (and ``overdue_s``) against ``now``, which only this
    query reads, never the projection. ``tenant``: that tenant's requests only."""
    now = now or datetime.now(UTC)
    keys = _keys(settings, "notify")
    found: list[dict[str, Any]] = []
    tracked = False
    try:
        for p in _partitions(settings):
            with client.pipeline(transaction=False) as pipe:
                pipe.exists(keys.pos(p))
                pipe.hgetall(keys.pending(p))
                has_pos, pending = pipe.execute()
            tracked = tracked or bool(has_pos)
            rows = [json.loads(v) for _, v in sorted(pending.items())]
            rows = [r for r in rows if tenant is None or r["tenant"] == tenant]
            if not rows:
                continue
            deliveries = client.hmget(keys.deliveries(p), [r["id"] for r in rows])
            for row, raw in zip(rows, deliveries, strict=True):
                asked = datetime.fromisoformat(row["requested_at"])
                due = None if row.get("due_at") is None else datetime.fromisoformat(row["due_at"])
                found.append(
                    {
                        **row,
                        "waiting_s": round((now - asked).total_seconds(), 3),
                        "overdue": due is not None and due <= now,
                        "overdue_s": (
                            None if due is None else round((now - due).total_seconds(), 3)
                        ),
                        "notification": _delivery(raw),
                    }
                )
    except REDIS_ERRORS as exc:
        raise _wrap(exc, "pending approvals") from exc
    found.sort(key=lambda a: (a["requested_at"], a["id"]))
    return ApprovalsReport(found, tracked)
