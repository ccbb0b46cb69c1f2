"""Run leases with fencing tokens in Redis.

One key per run holds ``owner|epoch`` with a TTL; a counter per run hands out epochs.
Acquisition is atomic (Lua): take the lease only if it is free or expired, and bump the
epoch above both the counter and a floor the caller read from the log, so epochs never go
backwards even after Redis restarts empty. Keys carry a hash tag per run so a Redis
Cluster keeps a run's keys on one slot.

Lease heartbeats are operational telemetry (logged and counted), never semantic events.

With a liveness TTL (``liveness_ttl_ms``, the default for every process's leases) a lease
is bound to its process's session instead of a TTL of its own: ``owner|epoch|session``,
with no expiry, and one key per process (``<prefix>:live:<session>``, a short TTL the
process renews) says the session is alive. A run lease is free iff it is absent
(released) or its session's key is gone. A session's key is only ever renewed while it
exists (``SET XX``), never made again: once seen gone, the session is dead for good, so a
taker may read the liveness key and then take the lease in a separate step (the script
takes it only if the lease is still the dead session's, which works on a Redis Cluster
too, where the two keys are on different slots). The per-run fencing token is unchanged:
acquisition bumps the epoch, and an owner's check is "the lease is still my token, and my
session is alive" (its local deadline, or a renewal that succeeded after the read). So the
renewal traffic is one command per process per period, whatever the number of runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from runlog.errors import RedisUnavailable
from runlog.log._clients import REDIS_ERRORS, ThreadGet, own_pool
from runlog.schemas._keys import handover_key, lease_key, live_key, run_tag, session_of

log = logging.getLogger(__name__)

# The next epoch: one above both the run's counter and the floor (ARGV[3]) its caller
# read from the log, so an epoch never goes backwards, even after Redis restarts empty.
_NEXT_EPOCH = """
local e = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if e <= floor then
  e = floor + 1
  redis.call('SET', KEYS[2], e)
end
"""

# ARGV[4] = '1' breaks a live lease (explicit takeover): safe because the epoch still
# goes up, so the previous holder fails its next ownership check (it is fenced).
# ARGV[5]: a lease value its caller saw belong to a dead session (else ''): taken only if
# it is still the lease's value. ARGV[6]: '|' .. the taker's session ('' for a lease with
# a TTL of its own; ARGV[2] = '0' then means no TTL: the session is its liveness).
_ACQUIRE = (
    """
local cur = redis.call('GET', KEYS[1])
if cur and ARGV[4] ~= '1' and cur ~= ARGV[5] then
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
"""
    + _NEXT_EPOCH
    + """
if ARGV[2] == '0' then
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. e .. ARGV[6])
else
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. e .. ARGV[6], 'PX', ARGV[2])
end
local handed = redis.call('GET', KEYS[3])
if handed then redis.call('DEL', KEYS[3]) end
return {1, tostring(e), 0, handed or ''}
"""
)

# Raise the holder's epoch above a floor learned from the log (after an empty restart).
_RAISE = (
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
"""
    + _NEXT_EPOCH
    + """
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], ARGV[2] .. '|' .. e .. ARGV[5])
else
  redis.call('SET', KEYS[1], ARGV[2] .. '|' .. e .. ARGV[5], 'PX', ARGV[4])
end
return e
"""
)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A release that says so: the lease is freed and the handover note (KEYS[2]) names the
# owner who let go, so the next acquisition (which takes the note) knows it took a run
# handed over, not one whose owner vanished.
_HAND_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# The leases of many runs of one dead session, taken in one round trip (a worker adopting
# a dead worker's runs). KEYS[1]: that session's liveness key; then, per run, its lease,
# epoch counter and handover note (as ``_ACQUIRE``'s). ARGV[1]: the dead session's id;
# ARGV[2]: '|' .. the taker's session; ARGV[2 + i]: run i's owner. Per run exactly what
# ``_ACQUIRE`` does with a floor of 0: a lease absent or bound to the dead session is taken
# at an epoch bumped past the run's counter; any other (a live holder's, one with a TTL
# of its own, the dead session's taken meanwhile by someone else) refuses that run only.
# While the session's key exists (alive after all), no run is taken. ARGV[1] = '': no
# session is dead (runs handed over, ``acquire_free``): only absent leases are taken, any
# present one refuses its run, and KEYS[1] is not read.
_ACQUIRE_DEAD = """
if ARGV[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local out = {}
for i = 1, (#KEYS - 1) / 3 do
  local lk, ek, hk = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
  local cur = redis.call('GET', lk)
  if cur and (ARGV[1] == '' or string.match(cur, '^[^|]*|[^|]*|([^|]*)$') ~= ARGV[1]) then
    out[i] = {0, cur}
  else
    local e = redis.call('INCR', ek)
    redis.call('SET', lk, ARGV[2 + i] .. '|' .. e .. ARGV[2])
    local handed = redis.call('GET', hk)
    if handed then redis.call('DEL', hk) end
    out[i] = {1, tostring(e), handed or ''}
  end
end
return out
"""

# A dead process's session declared dead before its key expires (``LeaseManager.bury``):
# the key (KEYS[1]) is deleted only while it has less than ARGV[1] ms left, says its
# process watches (ends with ARGV[2]; an older version's session does not, and only
# expires) and nobody is subscribed to its channel (ARGV[3]) any more.
_BURY = """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, -string.len(ARGV[2])) ~= ARGV[2] then return 0 end
local t = redis.call('PTTL', KEYS[1])
if t < 0 or t >= tonumber(ARGV[1]) then return 0 end
if redis.call('PUBSUB', 'NUMSUB', ARGV[3])[2] > 0 then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

ACQUIRE_DEAD_BATCH = 256
"""Runs whose leases one script takes (``acquire_dead``): Redis runs a script alone, so a
batch is kept to a few milliseconds of it."""


def new_owner(writer_id: str) -> str:
    """A lease's owner: the writer and a suffix of this acquisition's own."""
    return f"{writer_id}/{uuid.uuid4().hex[:8]}"


HANDOVER_NOTE_TTL_MS = 24 * 3600 * 1000
"""How long a handover note waits for the next owner (a run nobody resumes keeps no key)."""

METRICS: Counter[str] = Counter()
"""Process-wide ownership telemetry (never semantic events): acquired, takeovers,
claims_lost, renewed, renew_lost, released, fenced. ``runlog.lease_metrics()`` reads it."""


@dataclass(frozen=True)
class Held:
    """Who holds a run's lease, when acquisition fails."""

    holder: str
    ttl_ms: int
    """How long the lease lives unless renewed: its own TTL, or its session's."""

    def describe(self) -> str:
        """The holder in an operator's words: its writer id, and the host and pid that id
        names when it is a default one (``host:pid``, a worker's ``host:pid:suffix``)."""
        writer = self.holder.split("/", 1)[0]
        parts = writer.split(":")
        if len(parts) >= 2 and parts[1].isdigit():
            return f"writer {writer} (host {parts[0]}, pid {parts[1]})"
        return f"writer {writer}"


ACQUIRE_ROUNDS = 3
"""Times an acquisition looks again when the lease changed hands under it."""
LIVE_RENEWALS = 8
"""Renewals of a session's liveness key per TTL: a renewal may be late seven times over
before the session dies (one command per process per TTL/8, whatever its runs)."""
SESSION_TRUST = 0.25
"""Share of the liveness TTL a renewal vouches for in its own process
(``Session.valid_until``): two renewal periods, so one late renewal costs no Redis check.
Far inside the key's own TTL, which is what lets a dead process be found early
(``BURY_BELOW``)."""
BURY_BELOW = 0.6
"""A session whose liveness key has less than this share of its TTL left, and whose
process is no longer subscribed to the session's channel (``Session.watch``), is dead: its
process was killed or exited (the kernel closed its sockets, Redis dropped the
subscription) and has missed its renewals for 0.4 of the TTL. It is deleted then
(``LeaseManager.bury``) instead of at expiry: 0.8 s after the last renewal with the
default 2 s TTL, not 2 s. Safe whatever the subscription says: the process's own deadline
(``SESSION_TRUST``) ended 0.15 TTL before that, so from then on every lease of the session
is checked in Redis, where the key is gone."""
WATCHED = "\twatched"
"""The end of a liveness key's value whose process subscribes to the session's channel
(a session without it, an older version's, is never buried: it expires)."""


@dataclass(eq=False)
class Session:
    """This process's liveness: the key its session-bound leases refer to."""

    id: str
    key: str
    ttl_ms: int
    info: str
    """``worker|host|pid`` of the process: what a wait on one of its leases names."""
    watch: Any = None
    """A subscription to the session's channel (named as its key), held while the process
    lives: Redis drops it when the process dies, which ``LeaseManager.bury`` looks for."""
    valid_until: float = 0.0
    """A local, conservative deadline: the key surely lives until then."""
    dead: bool = False
    """The key was found gone (or could not be made): never renewed again."""

    def locally_alive(self) -> bool:
        return not self.dead and time.monotonic() < self.valid_until

    @property
    def value(self) -> str:
        """The liveness key's value: the process, and that it watches its channel."""
        return f"{self.info}{WATCHED}"

    def vouch(self, started: float) -> None:
        """A renewal begun at ``started`` succeeded: the key lives a TTL from then."""
        self.valid_until = max(self.valid_until, started + self.ttl_ms / 1000 * SESSION_TRUST)


def sessions_key(prefix: str) -> str:
    """The hash of sessions that said they are alive (session -> ``worker|host|pid``)."""
    return f"{prefix}:sessions"


@dataclass(eq=False)
class Lease:
    """A lease this process holds. ``valid_until`` is a local, conservative deadline."""

    manager: LeaseManager
    tenant: str
    run_id: str
    owner: str
    epoch: int
    ttl_ms: int
    valid_until: float
    lost: bool = False
    released: bool = False
    handed_over_by: str | None = None
    """The previous owner's token (``owner|epoch``) when it handed the run over (a drain)
    instead of vanishing: read from its handover note at acquisition."""
    session: Session | None = None
    """The process session this lease is bound to (no TTL of its own), or None."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    key: str = field(init=False, repr=False)
    """The lease's Redis key, spelled once: every ownership check reads it."""

    def __post_init__(self) -> None:
        self.key = self.manager.lease_key(self.tenant, self.run_id)

    @property
    def token(self) -> str:
        tail = "" if self.session is None else f"|{self.session.id}"
        return f"{self.owner}|{self.epoch}{tail}"

    def locally_valid(self) -> bool:
        if self.lost or self.released:
            return False
        if self.session is not None:
            return self.session.locally_alive()
        return time.monotonic() < self.valid_until

    def check(self) -> bool:
        """Authoritative: is this lease still the run's current lease in Redis?"""
        if self.released:
            return False  # released by us: even if Redis kept the key, we no longer own it
        return self.confirm(self.manager.current(self.tenant, self.run_id))

    def check_with(self, key: str) -> tuple[bool, bytes | None]:
        """``check`` that reads ``key`` (another key of this run's) in the same round trip:
        the barrier's ownership check also brings the run's cancel flag."""
        if self.released:
            return False, None
        return self.verdict(*self.manager.current_with(self.key, self.run_id, key))

    def verdict(self, current: str | None, other: bytes | None) -> tuple[bool, bytes | None]:
        """``check_with``'s answer from what Redis said: the lease value and the other key."""
        if self.released:
            return False, None
        return self.confirm(current), other

    def confirm(self, current: str | None) -> bool:
        """The verdict on Redis's answer ``current`` (the run's lease value, or None)."""
        if self.released:
            return False
        ok = current == self.token
        if ok and self.session is not None:
            # The lease names us; it is ours only while our session lives. Asked after the
            # lease was read: a session alive now was alive then (it never comes back).
            ok = self.manager.session_alive(self.session)
        if not ok:
            self.lost = True
            METRICS["fenced"] += 1
            log.warning("lease lost run=%s epoch=%s owner=%s", self.run_id, self.epoch, self.owner)
        return ok

    def raise_floor(self, floor: int) -> int:
        """Move to an epoch above ``floor``; returns the new epoch or raises if lost."""
        new = self.manager.raise_epoch(self, floor)
        if new is None:
            self.lost = True
            return self.epoch
        self.epoch = new
        return new

    def release(self) -> None:
        self.manager.release(self)


class LeaseManager:
    """Acquires, renews (one background thread for all leases) and releases run leases."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        key_prefix: str = "runlog",
        liveness_ttl_ms: int = 0,
        info: str = "",
    ) -> None:
        """``liveness_ttl_ms`` > 0: leases are bound to this process's session (see the
        module's docstring); its TTL is the smaller of it and a lease's own ``ttl_ms``.
        ``info``: ``worker|host|pid``, what another process waiting on a lease is told."""
        self.redis = client
        self.liveness_ttl_ms = liveness_ttl_ms
        self.info = info or f"{socket.gethostname()}|{socket.gethostname()}|{os.getpid()}"
        self._session: Session | None = None
        self._session_lock = threading.Lock()
        self._renewer_lock = threading.Lock()
        self._get = ThreadGet(client)
        self._renewing = own_pool(client)
        """The renewer thread's client: renewals never wait for a connection of ``client``'s
        pool, which a burst of other work on this process may hold all of."""
        self.prefix = key_prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._raise = client.register_script(_RAISE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._hand_over = client.register_script(_HAND_OVER)
        self._acquire_dead = client.register_script(_ACQUIRE_DEAD)
        self._bury = client.register_script(_BURY)

        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._leases_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Keys -------------------------------------------------------------------------------
    def run_tag(self, tenant: str, run_id: str) -> str:
        return run_tag(self.prefix, tenant, run_id)

    def lease_key(self, tenant: str, run_id: str) -> str:
        return lease_key(self.prefix, tenant, run_id)

    def epoch_key(self, tenant: str, run_id: str) -> str:
        return f"{self.run_tag(tenant, run_id)}:epoch"

    def handover_key(self, tenant: str, run_id: str) -> str:
        return handover_key(self.prefix, tenant, run_id)

    def _keys(self, tenant: str, run_id: str) -> list[str]:
        """KEYS of the acquire and raise scripts: the lease, then the epoch counter, then
        the handover note (the acquire script takes it)."""
        return [
            self.lease_key(tenant, run_id),
            self.epoch_key(tenant, run_id),
            self.handover_key(tenant, run_id),
        ]

    # Operations ---------------------------------------------------------------------------
    def peek(self, key: str) -> bytes | None:
        """``GET key`` over this thread's own connection: a step's check on the hot path."""
        try:
            raw: bytes | None = self._get(key)
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"GET {key}: {exc}") from exc
        return raw

    def current(self, tenant: str, run_id: str) -> str | None:
        try:
            raw = self._get(self.lease_key(tenant, run_id))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"lease check for {run_id}: {exc}") from exc
        return raw.decode() if isinstance(raw, bytes) else raw

    def current_with(
        self, lease_key: str, run_id: str, key: str
    ) -> tuple[str | None, bytes | None]:
        """``current`` of the lease at ``lease_key`` (``Lease.key``) and the raw value of
        ``key`` (a key of the same run: one hash slot), in one ``MGET``."""
        try:
            raw, other = self._get.many((lease_key, key))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"lease check for {run_id}: {exc}") from exc
        return (raw.decode() if isinstance(raw, bytes) else raw), other

    def check_many(self, leases: list[tuple[Lease, str]]) -> list[tuple[bool, bytes | None]]:
        """``Lease.check_with`` of many leases (each with another key of its run's), in one
        round trip: one ``MGET`` per run (its keys share a hash slot), pipelined."""
        pipe = self.redis.pipeline(transaction=False)
        for lease, key in leases:
            pipe.mget([lease.key, key])
        try:
            answers = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"lease check for {len(leases)} runs: {exc}") from exc
        out = []
        for (lease, _), (raw, other) in zip(leases, answers, strict=True):
            current = raw.decode() if isinstance(raw, bytes) else raw
            out.append(lease.verdict(current, other))
        return out

    def try_acquire(
        self,
        tenant: str,
        run_id: str,
        owner: str,
        ttl_ms: int,
        floor: int = 0,
        *,
        force: bool = False,
    ) -> Lease | Held:
        """Take the run's lease if free, expired or its session's dead, or always with
        ``force`` (takeover). Bound to this process's session when it has a liveness TTL."""
        started = time.monotonic()
        keys = self._keys(tenant, run_id)
        if force:
            previous = self.current(tenant, run_id)
            if previous is not None:
                METRICS["forced_takeovers"] += 1
                log.warning("lease of run=%s taken over from %s by %s", run_id, previous, owner)
        session = self._current_session() if self.liveness_ttl_ms > 0 else None
        tail = "" if session is None else f"|{session.id}"
        held = Held("", 0)
        for _ in range(ACQUIRE_ROUNDS):
            dead = "" if force else self._dead_holder(tenant, run_id)
            if isinstance(dead, Held):
                return dead
            try:
                ok, value, pttl, *rest = self._acquire(
                    keys=keys,
                    args=[
                        owner,
                        0 if session is not None else ttl_ms,
                        floor,
                        "1" if force else "0",
                        dead,
                        tail,
                    ],
                )
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"lease acquire for {run_id}: {exc}") from exc
            if ok:
                break
            text = value.decode() if isinstance(value, bytes) else str(value)
            held = Held(text, int(pttl))
            if session_of(text) is None:
                return held
            # Taken by a session meanwhile: look at that session's liveness again.
        else:
            return Held(held.holder, self.liveness_ttl_ms or ttl_ms)
        handed = rest[0].decode() if rest and isinstance(rest[0], bytes) and rest[0] else None
        lease = Lease(
            manager=self,
            tenant=tenant,
            run_id=run_id,
            owner=owner,
            epoch=int(value),
            ttl_ms=ttl_ms,
            valid_until=started + ttl_ms / 1000 * 0.8,
            handed_over_by=handed,
            session=session,
        )
        METRICS["acquired"] += 1
        if handed:
            METRICS["taken_handed_over"] += 1
        log.info("lease acquired run=%s epoch=%s owner=%s", run_id, lease.epoch, owner)
        if session is None:
            with self._leases_lock:
                self._leases.add(lease)
        self._ensure_renewer()
        return lease

    def acquire_dead(
        self, session: str, runs: list[tuple[str, str]], writer_id: str, ttl_ms: int
    ) -> dict[str, Lease]:
        """Take the leases of ``runs`` (tenant, run id), held by the dead ``session`` or
        free, ``ACQUIRE_DEAD_BATCH`` runs a round trip (``_ACQUIRE_DEAD``): each run's
        epoch bumped as ``try_acquire`` bumps it, a run whose lease is anyone else's left
        out. Returns the leases taken, by run id; the runs left out are opened the usual
        way (``try_acquire``), which says who holds them. Only for leases bound to this
        process's session (a liveness TTL), on a Redis that is not a cluster (a script's
        keys there must share a slot): otherwise nothing is taken here."""
        if not session:
            raise ValueError("acquire_dead needs the dead session's id")
        return self._acquire_many(session, runs, writer_id, ttl_ms)

    def acquire_free(
        self, runs: list[tuple[str, str]], writer_id: str, ttl_ms: int
    ) -> dict[str, Lease]:
        """``acquire_dead`` for runs no session is known dead for (runs handed over by a
        draining worker: ``LeaseManager.hand_over`` freed each lease and left its note):
        only the leases nobody holds are taken, each with its handover note; a run whose
        lease is present (its drainer has not let go yet, a live or dead session took it)
        is left out, for its open to find so."""
        return self._acquire_many("", runs, writer_id, ttl_ms)

    def _acquire_many(
        self, session: str, runs: list[tuple[str, str]], writer_id: str, ttl_ms: int
    ) -> dict[str, Lease]:
        if self.liveness_ttl_ms <= 0 or not isinstance(self.redis, redis.Redis) or not runs:
            return {}
        mine = self._current_session()
        live = live_key(self.prefix, session)
        taken: dict[str, Lease] = {}
        for at in range(0, len(runs), ACQUIRE_DEAD_BATCH):
            batch = runs[at : at + ACQUIRE_DEAD_BATCH]
            owners = [new_owner(writer_id) for _ in batch]
            keys = [live]
            for tenant, run_id in batch:
                keys.extend(self._keys(tenant, run_id))
            started = time.monotonic()
            try:
                answers = self._acquire_dead(keys=keys, args=[session, f"|{mine.id}", *owners])
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"lease acquire for {len(batch)} runs: {exc}") from exc
            if not answers:
                return taken  # the session lives: its runs are not ours to take
            for (tenant, run_id), owner, answer in zip(batch, owners, answers, strict=True):
                if not int(answer[0]):
                    continue
                handed = answer[2].decode() if isinstance(answer[2], bytes) else str(answer[2])
                taken[run_id] = Lease(
                    manager=self,
                    tenant=tenant,
                    run_id=run_id,
                    owner=owner,
                    epoch=int(answer[1]),
                    ttl_ms=ttl_ms,
                    valid_until=started + ttl_ms / 1000 * 0.8,
                    handed_over_by=handed or None,
                    session=mine,
                )
                METRICS["acquired"] += 1
                if handed:
                    METRICS["taken_handed_over"] += 1
        log.info(
            "leases of %d of %d runs of %s acquired",
            len(taken),
            len(runs),
            f"dead session {session}" if session else "handed-over runs",
        )
        return taken

    def raise_epoch(self, lease: Lease, floor: int) -> int | None:
        keys = self._keys(lease.tenant, lease.run_id)
        old = lease.epoch
        with lease.lock:
            try:
                tail = "" if lease.session is None else f"|{lease.session.id}"
                ttl = 0 if lease.session is not None else lease.ttl_ms
                new = self._raise(keys=keys, args=[lease.token, lease.owner, floor, ttl, tail])
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"epoch raise for {lease.run_id}: {exc}") from exc
            if new:
                # Under the lock: a renewal must never send the old token once Redis holds
                # the new one, or it would refuse and mark this lease lost.
                lease.epoch = int(new)
        if not new:
            return None
        log.info(
            "epoch raised run=%s from=%s to=%s (log floor %s)",
            lease.run_id,
            old,
            new,
            floor,
        )
        return int(new)

    def renew(self, lease: Lease) -> bool:
        if lease.session is not None:
            # Nothing per run to renew: the lease lives while its session does.
            return not (lease.lost or lease.released) and self.session_alive(lease.session)
        started = time.monotonic()
        with lease.lock:
            if lease.lost or lease.released:
                return False
            try:
                ok = self._renew(
                    keys=[lease.key],
                    args=[lease.token, lease.ttl_ms],
                )
            except REDIS_ERRORS as exc:
                # Not lost yet: the local deadline keeps counting down without renewal.
                log.warning("lease renew failed run=%s: %s", lease.run_id, exc)
                return False
            if ok:
                lease.valid_until = started + lease.ttl_ms / 1000 * 0.8
                METRICS["renewed"] += 1
                return True
            lease.lost = True
        METRICS["renew_lost"] += 1
        log.warning("lease renewal refused run=%s epoch=%s: taken over", lease.run_id, lease.epoch)
        return False

    def release(self, lease: Lease) -> None:
        with lease.lock:
            if lease.released:
                return
            lease.released = True
            try:
                self._release(keys=[lease.key], args=[lease.token])
            except REDIS_ERRORS as exc:
                # The lease will expire by itself; nothing else to do.
                log.warning("lease release failed run=%s: %s", lease.run_id, exc)
        with self._leases_lock:
            self._leases.discard(lease)
        METRICS["released"] += 1

    def hand_over(self, lease: Lease) -> None:
        """Release ``lease`` as a handover (a draining worker lets its run go at a step's
        boundary): the next owner may take it at once, and learns whose it was."""
        with lease.lock:
            if lease.released:
                return
            lease.released = True
            keys = [lease.key]
            keys.append(self.handover_key(lease.tenant, lease.run_id))
            try:
                self._hand_over(keys=keys, args=[lease.token, HANDOVER_NOTE_TTL_MS])
            except REDIS_ERRORS as exc:
                # The lease will expire by itself: a slower handover, never a double owner.
                log.warning("lease handover failed run=%s: %s", lease.run_id, exc)
        with self._leases_lock:
            self._leases.discard(lease)
        METRICS["handed_over"] += 1
        log.info(
            "lease handed over run=%s epoch=%s owner=%s", lease.run_id, lease.epoch, lease.owner
        )

    # Sessions (liveness) ----------------------------------------------------------------
    def _current_session(self) -> Session:
        """This process's live session, made (its key set, its entry in the sessions hash)
        when there is none or the last one died."""
        with self._session_lock:
            current = self._session
            if current is not None and not current.dead:
                return current
            sid = uuid.uuid4().hex[:16]
            made = Session(sid, live_key(self.prefix, sid), self.liveness_ttl_ms, self.info)
            started = time.monotonic()
            try:
                if isinstance(self.redis, redis.Redis):
                    # Subscribed before the key says so: a key that says it is watched is.
                    made.watch = self._renewing.pubsub()
                    made.watch.subscribe(made.key)
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(made.key, made.value, px=made.ttl_ms, nx=True)
                pipe.hset(sessions_key(self.prefix), sid, made.info)
                pipe.execute()
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"liveness key {made.key}: {exc}") from exc
            made.vouch(started)
            if current is not None and current.watch is not None:
                with contextlib.suppress(*REDIS_ERRORS):
                    current.watch.close()
            self._session = made
            METRICS["sessions"] += 1
            log.info("session %s started (liveness TTL %s ms)", sid, made.ttl_ms)
        self._ensure_renewer()
        return made

    def session_id(self) -> str:
        """This process's session (made if there is none): the one its leases name."""
        return self._current_session().id

    def session_alive(self, session: Session) -> bool:
        """Is ``session`` alive now: by its local deadline, else by a renewal that succeeds
        (Redis's word, asked now). A session found dead stays dead."""
        if session.locally_alive():
            return True
        if session.dead:
            return False
        return self._renew_session(session)

    def _renew_session(self, session: Session) -> bool:
        started = time.monotonic()
        try:
            # XX: only while the key exists. A key that expired is never made again, so a
            # taker that saw it gone may rely on that for good.
            ok = self._renewing.set(session.key, session.value, px=session.ttl_ms, xx=True)
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"liveness renewal of {session.key}: {exc}") from exc
        if ok:
            session.vouch(started)
            METRICS["liveness_renewed"] += 1
            return True
        session.dead = True
        METRICS["session_lost"] += 1
        log.warning("session %s lost: its liveness key expired; its leases are lost", session.id)
        return False

    def _dead_holder(self, tenant: str, run_id: str) -> str | Held:
        """The run's lease value when it is bound to a dead session (a taker may take it),
        ``""`` when the lease is absent or has a TTL of its own (the script decides), or
        ``Held`` when its session lives."""
        seen = self.current(tenant, run_id)
        if seen is None:
            return ""
        sid = session_of(seen)
        if sid is None:
            return ""
        try:
            pttl = int(self.redis.pttl(live_key(self.prefix, sid)))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"liveness of {sid}: {exc}") from exc
        if pttl == -2:
            return seen
        return Held(seen, pttl if pttl >= 0 else self.liveness_ttl_ms)

    @property
    def bury_below_ms(self) -> int:
        """A session's key with fewer ms left than this may be buried (``BURY_BELOW``)."""
        return int(self.liveness_ttl_ms * BURY_BELOW)

    def bury(self, sessions: list[str]) -> list[str]:
        """Of ``sessions`` (whose keys the caller saw with less than ``bury_below_ms``
        left), those whose process no longer watches its channel, their keys deleted now
        (``_BURY``, one round trip for all): they are dead. A session still watched (a
        paused or slow process, or one cut off by a network that did not close its
        sockets) is left to expire; so is every session on a Redis Cluster, where a
        channel's subscribers are counted per node."""
        if not sessions or not isinstance(self.redis, redis.Redis):
            return []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for sid in sessions:
                key = live_key(self.prefix, sid)
                self._bury(keys=[key], args=[self.bury_below_ms, WATCHED, key], client=pipe)
            done = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"bury {len(sessions)} sessions: {exc}") from exc
        buried = [sid for sid, d in zip(sessions, done, strict=True) if int(d)]
        for sid in buried:
            METRICS["sessions_buried"] += 1
            log.info("session %s: its process is gone, its key deleted before expiry", sid)
        return buried

    # Renewal ---------------------------------------------------------------------------
    def _ensure_renewer(self) -> None:
        # Under a lock: a burst of opens calls this from many threads at once, and each that
        # saw no renewer started one (64 renewer threads, only the last of which close()
        # stopped).
        with self._renewer_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._renew_loop, name="runlog-lease", daemon=True
                )
                self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.is_set():
            with self._leases_lock:
                leases = list(self._leases)
            now = time.monotonic()
            wait = 1.0
            due_now: list[Lease] = []
            for lease in leases:
                period = lease.ttl_ms / 1000 / 3
                due = lease.valid_until - lease.ttl_ms / 1000 * 0.8 + period
                if now >= due:
                    due_now.append(lease)
                    due = now + period
                wait = min(wait, max(0.01, due - now))
            if due_now:
                self.renew_many(due_now)
            session = self._session
            if session is not None and not session.dead:
                period = session.ttl_ms / 1000 / LIVE_RENEWALS
                due = session.valid_until - session.ttl_ms / 1000 * SESSION_TRUST + period
                if time.monotonic() >= due:
                    try:
                        self._renew_session(session)
                    except RedisUnavailable as exc:
                        # Not dead yet: the local deadline keeps counting down.
                        log.warning("liveness renewal failed: %s", exc)
                    self._keep_watching(session)
                    due = time.monotonic() + period
                wait = min(wait, max(0.01, due - time.monotonic()))
            self._stop.wait(wait)

    @staticmethod
    def _keep_watching(session: Session) -> None:
        """Read the session's subscription: a dropped connection (Redis restarted) is made
        again and subscribed again here, at the next renewal."""
        if session.watch is None or session.dead:
            return
        try:
            session.watch.get_message(timeout=0)
        except REDIS_ERRORS as exc:
            log.warning("liveness watch of session %s: %s", session.id, exc)

    def renew_many(self, leases: list[Lease]) -> None:
        """Renew ``leases`` in one round trip: a process holding hundreds of runs renews
        them all well inside a TTL, where one round trip each might not."""
        started = time.monotonic()
        live = [lease for lease in leases if not lease.lost and not lease.released]
        if not live:
            return
        pipe = self._renewing.pipeline(transaction=False)
        for lease in live:
            self._renew(
                keys=[lease.key],
                args=[lease.token, lease.ttl_ms],
                client=pipe,
            )
        try:
            answers = pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            # Not lost yet: the local deadlines keep counting down without renewal.
            log.warning("lease renewal of %d runs failed: %s", len(live), exc)
            return
        for lease, ok in zip(live, answers, strict=True):
            with lease.lock:
                if lease.lost or lease.released:
                    continue
                if isinstance(ok, Exception):
                    log.warning("lease renew failed run=%s: %s", lease.run_id, ok)
                    continue
                if ok:
                    lease.valid_until = started + lease.ttl_ms / 1000 * 0.8
                    METRICS["renewed"] += 1
                    continue
                lease.lost = True
            METRICS["renew_lost"] += 1
            log.warning(
                "lease renewal refused run=%s epoch=%s: taken over", lease.run_id, lease.epoch
            )

    def close(self) -> None:
        with self._renewer_lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=2)
        session = self._session
        if session is not None and not session.dead:
            # A clean exit ends the session: any lease still bound to it is free at once.
            session.dead = True
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.delete(session.key)
                pipe.hdel(sessions_key(self.prefix), session.id)
                pipe.execute()
            except REDIS_ERRORS as exc:
                log.warning("session %s not ended (its key expires): %s", session.id, exc)
        if session is not None and session.watch is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                session.watch.close()
        self._get.close()
        if self._renewing is not self.redis:
            self._renewing.connection_pool.disconnect()
