"""Run leases with fencing tokens in Redis.

One key per run holds ``owner|epoch`` with a TTL; a counter per run hands out epochs.
Acquisition is atomic (Lua): take the lease only if it is free or expired, and bump the
epoch above both the counter and a floor the caller read from the log, so epochs never go
backwards even after Redis restarts empty. Keys carry a hash tag per run so a Redis
Cluster keeps a run's keys on one slot.

Lease heartbeats are operational telemetry (logged and counted), never semantic events.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import redis

from runlog.errors import RedisUnavailable
from runlog.log.clients import ThreadGet
from runlog.schemas.keys import lease_key, run_tag

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
_ACQUIRE = (
    """
local cur = redis.call('GET', KEYS[1])
if cur and ARGV[4] ~= '1' then
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
"""
    + _NEXT_EPOCH
    + """
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. e, 'PX', ARGV[2])
return {1, tostring(e), 0}
"""
)

# Raise the holder's epoch above a floor learned from the log (after an empty restart).
_RAISE = (
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
"""
    + _NEXT_EPOCH
    + """
redis.call('SET', KEYS[1], ARGV[2] .. '|' .. e, 'PX', ARGV[4])
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

METRICS: Counter[str] = Counter()
"""Process-wide ownership telemetry (never semantic events): acquired, takeovers,
claims_lost, renewed, renew_lost, released, fenced. ``runlog.lease_metrics()`` reads it."""


@dataclass(frozen=True)
class Held:
    """Who holds a run's lease, when acquisition fails."""

    holder: str
    ttl_ms: int

    def describe(self) -> str:
        """The holder in an operator's words: its writer id, and the host and pid that id
        names when it is a default one (``host:pid``, a worker's ``host:pid:suffix``)."""
        writer = self.holder.split("/", 1)[0]
        parts = writer.split(":")
        if len(parts) >= 2 and parts[1].isdigit():
            return f"writer {writer} (host {parts[0]}, pid {parts[1]})"
        return f"writer {writer}"


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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def token(self) -> str:
        return f"{self.owner}|{self.epoch}"

    def locally_valid(self) -> bool:
        return not self.lost and not self.released and time.monotonic() < self.valid_until

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
        current, other = self.manager.current_with(self.tenant, self.run_id, key)
        return self.confirm(current), other

    def confirm(self, current: str | None) -> bool:
        """The verdict on Redis's answer ``current`` (the run's lease value, or None)."""
        if self.released:
            return False
        ok = current == self.token
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

    def __init__(self, client: redis.Redis, *, key_prefix: str = "runlog") -> None:
        self.redis = client
        self._get = ThreadGet(client)
        self.prefix = key_prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._raise = client.register_script(_RAISE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
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

    def _keys(self, tenant: str, run_id: str) -> list[str]:
        """KEYS of the acquire and raise scripts: the lease, then the epoch counter."""
        return [self.lease_key(tenant, run_id), self.epoch_key(tenant, run_id)]

    # Operations ---------------------------------------------------------------------------
    def peek(self, key: str) -> bytes | None:
        """``GET key`` over this thread's own connection: a step's check on the hot path."""
        try:
            raw: bytes | None = self._get(key)
        except redis.RedisError as exc:
            raise RedisUnavailable(f"GET {key}: {exc}") from exc
        return raw

    def current(self, tenant: str, run_id: str) -> str | None:
        try:
            raw = self._get(self.lease_key(tenant, run_id))
        except redis.RedisError as exc:
            raise RedisUnavailable(f"lease check for {run_id}: {exc}") from exc
        return raw.decode() if isinstance(raw, bytes) else raw

    def current_with(self, tenant: str, run_id: str, key: str) -> tuple[str | None, bytes | None]:
        """``current`` and the raw value of ``key`` (a key of the same run: one hash slot),
        in one ``MGET``."""
        try:
            raw, other = self._get.many((self.lease_key(tenant, run_id), key))
        except redis.RedisError as exc:
            raise RedisUnavailable(f"lease check for {run_id}: {exc}") from exc
        return (raw.decode() if isinstance(raw, bytes) else raw), other

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
        """Take the run's lease if free or expired, or always with ``force`` (takeover)."""
        started = time.monotonic()
        keys = self._keys(tenant, run_id)
        if force:
            previous = self.current(tenant, run_id)
            if previous is not None:
                METRICS["forced_takeovers"] += 1
                log.warning("lease of run=%s taken over from %s by %s", run_id, previous, owner)
        try:
            ok, value, pttl = self._acquire(
                keys=keys, args=[owner, ttl_ms, floor, "1" if force else "0"]
            )
        except redis.RedisError as exc:
            raise RedisUnavailable(f"lease acquire for {run_id}: {exc}") from exc
        if not ok:
            return Held(value.decode() if isinstance(value, bytes) else str(value), int(pttl))
        lease = Lease(
            manager=self,
            tenant=tenant,
            run_id=run_id,
            owner=owner,
            epoch=int(value),
            ttl_ms=ttl_ms,
            valid_until=started + ttl_ms / 1000 * 0.8,
        )
        METRICS["acquired"] += 1
        log.info("lease acquired run=%s epoch=%s owner=%s", run_id, lease.epoch, owner)
        with self._leases_lock:
            self._leases.add(lease)
        self._ensure_renewer()
        return lease

    def raise_epoch(self, lease: Lease, floor: int) -> int | None:
        keys = self._keys(lease.tenant, lease.run_id)
        old = lease.epoch
        with lease.lock:
            try:
                new = self._raise(keys=keys, args=[lease.token, lease.owner, floor, lease.ttl_ms])
            except redis.RedisError as exc:
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
        started = time.monotonic()
        with lease.lock:
            if lease.lost or lease.released:
                return False
            try:
                ok = self._renew(
                    keys=[self.lease_key(lease.tenant, lease.run_id)],
                    args=[lease.token, lease.ttl_ms],
                )
            except redis.RedisError as exc:
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
                self._release(keys=[self.lease_key(lease.tenant, lease.run_id)], args=[lease.token])
            except redis.RedisError as exc:
                # The lease will expire by itself; nothing else to do.
                log.warning("lease release failed run=%s: %s", lease.run_id, exc)
        with self._leases_lock:
            self._leases.discard(lease)
        METRICS["released"] += 1

    # Renewal ---------------------------------------------------------------------------
    def _ensure_renewer(self) -> None:
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
            self._stop.wait(wait)

    def renew_many(self, leases: list[Lease]) -> None:
        """Renew ``leases`` in one round trip: a process holding hundreds of runs renews
        them all well inside a TTL, where one round trip each might not."""
        started = time.monotonic()
        live = [lease for lease in leases if not lease.lost and not lease.released]
        if not live:
            return
        pipe = self.redis.pipeline(transaction=False)
        for lease in live:
            self._renew(
                keys=[self.lease_key(lease.tenant, lease.run_id)],
                args=[lease.token, lease.ttl_ms],
                client=pipe,
            )
        try:
            answers = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._get.close()
