"""Reading the run index: which runs exist, in what condition, most recently active first.

The index is kept by the state projection (``consumers.stores._state``: its keys and how
they are written), in the same MULTI/EXEC as its position, so it is exactly as current as
the state view and a rebuild refolds it byte for byte. Nothing here reads the events
topic: ``runlog runs`` and the console list runs from these keys alone.

Reading merges the per-partition sorted sets of the wanted tenants with a keyset cursor
(``<score>:<run id>``), so a page costs the same at run 100,000 as at run 1.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from runlog._settings import Settings
from runlog.consumers.stores._state import IndexKeys, score_of
from runlog.errors import ConfigError, RedisUnavailable
from runlog.log._clients import REDIS_ERRORS
from runlog.log._holders import holders
from runlog.projections import _state_view as state_view

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

STATUSES = state_view.STATUSES
"""The one status vocabulary (``runlog.projections._state_view``): what a row says. The index
stores each run's phase (the log's part of it) and a reader adds who holds the lease."""

# ------------------------------------------------------------------------------ reading


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (UTC if it names no zone) or an age such as ``15m`` before now."""
    at = now or datetime.now(UTC)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return at - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ConfigError(f"--since wants an ISO time or an age like 15m, not {text!r}") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def age_text(seconds: float | None) -> str:
    """A short age for people: ``42s``, ``17m``, ``5h``, ``3d``."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


@dataclass(frozen=True)
class RunRow:
    """One line of the runs list."""

    tenant: str
    run_id: str
    status: str
    """The run's status (``state_view.STATUSES``), with the lease's holder as read."""
    outcome: str
    seq: int
    epoch: int
    resumptions: int
    started_at: str
    last_event_at: str
    last_type: str
    pending_approvals: int
    uncertain_calls: int
    fenced_writes: int
    quarantined: int
    phase: str = ""
    """The log's part of the status, as the index stores it (``state_view.PHASES``)."""
    since: str = ""
    owner: str | None = None
    lease_expires_at: str | None = None
    waiting_for: str | None = None
    until: str | None = None
    """Waiting for a time: when its durable timer is due."""
    owner_alive: bool = True
    """False: ``owner`` is a worker that is gone (the run is an orphan)."""
    handed_over_by: str | None = None
    """An orphan a draining worker let go (its handover)."""
    erased_by: str = ""
    """Its content was erased (CONTENT_ERASED): by whom, when and why; else empty."""
    erased_at: str = ""
    erasure_reason: str = ""

    def age_s(self, now: datetime) -> float | None:
        if not self.started_at:
            return None
        return round((now - datetime.fromisoformat(self.started_at)).total_seconds(), 3)

    def to_dict(self, now: datetime) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "run_id": self.run_id,
            "status": self.status,
            "outcome": self.outcome or None,
            "seq": self.seq,
            "epoch": self.epoch,
            "resumptions": self.resumptions,
            "started_at": self.started_at or None,
            "age_s": self.age_s(now),
            "last_event_at": self.last_event_at or None,
            "last_type": self.last_type or None,
            "pending_approvals": self.pending_approvals,
            "uncertain_calls": self.uncertain_calls,
            "fenced_writes": self.fenced_writes,
            "quarantined": self.quarantined,
            "since": self.since or None,
            "owner": self.owner,
            "lease_expires_at": self.lease_expires_at,
            "waiting_for": self.waiting_for,
            "until": self.until or None,
            "owner_alive": self.owner_alive,
            "handed_over_by": self.handed_over_by,
            **(
                {
                    "erased": {
                        "by": self.erased_by,
                        "at": self.erased_at,
                        "reason": self.erasure_reason,
                    }
                }
                if self.erased_by
                else {}
            ),
        }

    def live(self, holder: state_view.Holder | None) -> RunRow:
        """This row with its status told by the one rule, given the lease's holder now."""
        since = datetime.fromisoformat(self.since) if self.since else None
        until = datetime.fromisoformat(self.until) if self.until else None
        told = state_view.status_from(self.phase, holder, since, until)
        d = told.to_dict()
        return dataclasses.replace(
            self,
            status=told.status,
            owner=d["owner"],
            lease_expires_at=d["lease_expires_at"],
            waiting_for=d["waiting_for"],
            until=d["until"],
            owner_alive=told.owner_alive,
            handed_over_by=told.handed_over_by,
        )


@dataclass(frozen=True)
class Page:
    rows: list[RunRow]
    next_cursor: str | None
    """Pass as ``cursor`` for the next page; None when this page is the last."""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _row(raw: Mapping[Any, Any]) -> RunRow | None:
    h = {_s(k): _s(v) for k, v in raw.items()}
    if "run_id" not in h:
        return None  # deleted between the range read and this read (a rebuild)

    def num(name: str) -> int:
        value = h.get(name, "")
        return int(value) if value else 0

    return RunRow(
        tenant=h.get("tenant", ""),
        run_id=h["run_id"],
        status=h.get("ix_status", ""),
        phase=h.get("ix_status", ""),
        since=h.get("ix_since", "") or h.get("last_event_at", ""),
        until=h.get("ix_until", "") or None,
        outcome=h.get("outcome", ""),
        seq=num("seq"),
        epoch=num("epoch"),
        resumptions=num("resumptions"),
        started_at=h.get("started_at", ""),
        last_event_at=h.get("last_event_at", ""),
        last_type=h.get("last_type", ""),
        pending_approvals=num("pending_approvals"),
        uncertain_calls=num("uncertain_calls"),
        fenced_writes=num("fenced_writes"),
        quarantined=num("quarantined"),
        erased_by=h.get("erased_by", ""),
        erased_at=h.get("erased_at", ""),
        erasure_reason=h.get("erasure_reason", ""),
    )


def encode_cursor(score: float, run_id: str) -> str:
    return f"{score!r}:{run_id}"


def decode_cursor(cursor: str) -> tuple[float, str]:
    score, sep, run_id = cursor.partition(":")
    try:
        value = float(score)
    except ValueError:
        value = float("nan")
    if not sep or not run_id or value != value:
        raise ValueError(f"not a runs cursor: {cursor!r}")
    return value, run_id


class RunIndex:
    """Reads the run index of one deployment (its topic and Redis key prefix)."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        root = f"{settings.redis_key_prefix}:proj:state"
        self.parts = [
            IndexKeys(f"{root}:{{{settings.events_topic}:{p}}}") for p in range(settings.partitions)
        ]

    def runs_of_subject(self, tenant: str, subject: str) -> list[str]:
        """The runs of ``tenant`` whose data subject is ``subject``, as indexed (a run is
        indexed once the state projection folded its first event)."""
        try:
            found: set[str] = set()
            for keys in self.parts:
                found |= {_s(r) for r in self.redis.smembers(keys.subject(tenant, subject))}
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"runs of subject {subject}: {exc}") from exc
        return sorted(found)

    def ended_before(self, tenant: str, before: datetime) -> list[str]:
        """The runs of ``tenant`` that ended (finished, failed, cancelled or terminated)
        with their last valid event before ``before``, whose content is not erased yet."""
        ended = ("finished", "failed", "cancelled", "terminated")
        top: float | str = score_of(before.astimezone(UTC)) or "-inf"
        try:
            found: list[tuple[str, IndexKeys]] = []
            for keys in self.parts:
                for phase in ended:
                    members = self.redis.zrangebyscore(keys.status(phase, tenant), "-inf", top)
                    found += [(_s(m), keys) for m in members]  # type: ignore[arg-type]
            pipe = self.redis.pipeline(transaction=False)
            for rid, keys in found:
                pipe.hget(keys.summary(rid), "erased_by")
            erased = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index of {tenant}: {exc}") from exc
        return sorted(rid for (rid, _), gone in zip(found, erased, strict=True) if not gone)

    def tenants(self) -> list[str]:
        """Every tenant with at least one indexed run."""
        try:
            found: set[str] = set()
            for keys in self.parts:
                found |= {_s(t) for t in self.redis.smembers(keys.tenants)}
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index tenants: {exc}") from exc
        return sorted(found)

    def _sources(self, tenants: Iterable[str], status: str | None) -> list[str]:
        out = []
        for keys in self.parts:
            for t in tenants:
                out.append(keys.tenant(t) if status is None else keys.status(status, t))
        return out

    def page(
        self,
        *,
        tenants: Iterable[str] | None = None,
        status: str | None = None,
        since: datetime | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Up to ``limit`` runs, most recent last event first, after ``cursor``.

        ``tenants`` None means every tenant; ``since`` keeps runs whose last event is at or
        after it. Each source is asked for at most ``limit + 1`` entries below the cursor
        (plus any sharing the cursor's exact score), so a page's cost does not depend on
        how many runs came before it.
        """
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        if limit < 1:
            raise ValueError("limit must be at least 1")
        wanted = self.tenants() if tenants is None else sorted(set(tenants))
        phases = (None,) if status is None else state_view.phases_for(status)
        sources = [key for ph in phases for key in self._sources(wanted, ph)]
        block = len(self.parts) * len(wanted)
        low: float | str = "-inf" if since is None else score_of(since.astimezone(UTC)) or 0
        top: float | str = "+inf"
        after: tuple[float, str] | None = None
        if cursor is not None:
            after = decode_cursor(cursor)
            top = after[0]
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in sources:
                if after is not None:
                    # Same score as the cursor: only the run ids that sort after it.
                    pipe.zrangebyscore(key, after[0], after[0], withscores=True)
                    pipe.zrevrangebyscore(
                        key, f"({after[0]!r}", low, start=0, num=limit + 1, withscores=True
                    )
                else:
                    pipe.zrevrangebyscore(key, top, low, start=0, num=limit + 1, withscores=True)
            replies = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index: {exc}") from exc
        candidates: list[tuple[float, str, int]] = []
        per = 2 if after is not None else 1
        for i in range(len(sources)):
            part = (i % block) // len(wanted) if wanted else 0
            for reply in replies[i * per : (i + 1) * per]:
                for member, score in reply:
                    rid = _s(member)
                    if after is not None and score == after[0] and rid >= after[1]:
                        continue
                    candidates.append((score, rid, part))
        # Most recent first; equal scores by run id, descending, so the cursor is total.
        best = heapq.nlargest(limit + 1, candidates, key=lambda c: (c[0], c[1]))
        chosen = best[:limit]
        try:
            pipe = self.redis.pipeline(transaction=False)
            for _, rid, part in chosen:
                pipe.hgetall(self.parts[part].summary(rid))
            raws = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index summaries: {exc}") from exc
        rows = self._live([r for r in (_row(raw) for raw in raws) if r is not None])
        if status is not None:
            # running and orphaned share a phase: the lease tells them apart (a page of
            # either may hold fewer rows than ``limit``; its cursor still goes on).
            rows = [r for r in rows if r.status == status]
        nxt = None
        if len(best) > limit and chosen:
            nxt = encode_cursor(chosen[-1][0], chosen[-1][1])
        return Page(rows, nxt)

    def _live(self, rows: list[RunRow]) -> list[RunRow]:
        """Each row's status by the one rule, with its lease's holder read now (one
        pipelined read for the runs that have not ended)."""
        open_ = [(r.tenant, r.run_id) for r in rows if r.phase in _OPEN_PHASES]
        held = holders(self.redis, self.settings, open_)
        return [r.live(held.get((r.tenant, r.run_id))) for r in rows]

    def find(self, run_id: str) -> RunRow | None:
        """The index row of ``run_id`` (whatever its tenant), or None if it is not indexed."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for keys in self.parts:
                pipe.hgetall(keys.summary(run_id))
            raws = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index: {exc}") from exc
        for raw in raws:
            if raw:
                row = _row(raw)
                if row is not None and row.status:
                    return self._live([row])[0]
        return None

    def children(self, tenant: str, parent: str) -> list[RunRow]:
        """The indexed forks of ``parent`` (runs of ``tenant`` only), oldest first."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for keys in self.parts:
                pipe.smembers(keys.children(tenant, parent))
            found = sorted({_s(m) for got in pipe.execute() for m in got})
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index: {exc}") from exc
        rows = [row for rid in found if (row := self.find(rid)) is not None]
        return sorted((r for r in rows if r.tenant == tenant), key=lambda r: r.started_at)

    def counts(self, tenants: Iterable[str] | None = None) -> dict[str, int]:
        """Runs per status over ``tenants`` (None: every tenant)."""
        wanted = self.tenants() if tenants is None else sorted(set(tenants))
        try:
            pipe = self.redis.pipeline(transaction=False)
            for phase in state_view.PHASES:
                for key in self._sources(wanted, phase):
                    if phase == "active":
                        pipe.zrange(key, 0, -1)
                    else:
                        pipe.zcard(key)
            replies = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"run index: {exc}") from exc
        n = len(self.parts) * len(wanted)
        out: dict[str, int] = {s: 0 for s in STATUSES}
        for i, phase in enumerate(state_view.PHASES):
            chunk = replies[i * n : (i + 1) * n]
            if phase != "active":
                # a sleeping run's status is waiting (for a time)
                told = "waiting" if phase == "sleeping" else phase
                out[told] += sum(int(x) for x in chunk)
                continue
            # running or orphaned: whoever holds each active run's lease now
            runs = [
                (t, _s(m))
                for j, members in enumerate(chunk)
                for m in members
                for t in [wanted[j % len(wanted)]]
            ]
            held = holders(self.redis, self.settings, runs)
            out["running"] = sum(1 for r in runs if _running(held.get(r)))
            out["orphaned"] = len(runs) - out["running"]
        return out


def _running(held: state_view.Holder | None) -> bool:
    """A holder that runs the run (alive, not a handover's note)."""
    return held is not None and held.alive and held.handed_over_by is None


_OPEN_PHASES = frozenset({"active", "waiting", "sleeping", "cancelling"})
"""Phases of runs that have not ended: their rows name the lease's holder."""
