"""Snapshots: a cache of a partial fold in Redis, never a second source of truth.

Body (JSON, one Redis string per snapshot)::

    {"format": 1, "fold_version": 2, "schema_versions": {...}, "run_id": ..., "tenant": ...,
     "seq": 500, "epoch": 3, "partition": 4, "offset": 91234, "written_at": ...,
     "state": {RunState.to_dict()}, "digest": "<sha256 of the canonical JSON of the rest>"}

``offset`` is just past the last record the state includes: the tail starts there.

Crash windows (the body is durable before the pointer that advertises it):

1. ``SET`` the body under a new key (``<run tag>:snap:<seq>:<random>``); nothing points
   to it yet, so a crash here leaves only garbage;
2. where Redis supports it (7.2+, AOF on), ``WAITAOF 1 0`` waits until that write is
   fsynced; on older Redis the AOF is still one ordered log, so after any restart the
   pointer update (step 3) can only exist if the body written before it does;
3. one Lua script moves the pointer hash (``<run tag>:snap``): ``current`` becomes the new
   body, the old ``current`` becomes ``previous`` (the fallback), and only the body older
   than that is deleted. An older snapshot never replaces a newer one.

Durability is Redis's: with ``appendonly yes`` + ``appendfsync everysec`` (runlog's stack)
a machine crash can lose about the last second of snapshots, i.e. recovery replays a
longer tail; ``appendfsync always`` makes each snapshot write cost an fsync. Losing every
snapshot costs time, never correctness: the log is authoritative.

On load, a missing or unparsable body, a wrong digest, an unknown snapshot format or fold
version, or a body for another run/partition is a cache miss (counted, with its reason);
``previous`` is tried next, then the caller replays the whole log. The caller also checks
that the log continues the snapshot (``runlog.log._fold.read_run``, which the writer and
replay both use) and reports a discontinuity here, which quarantines it.

A snapshot is written from the LOG, not from the writer's memory: ``write(run)`` folds
the run's records from the previous snapshot up to the run's last acknowledged offset and
compares that with the live state (a difference is counted as a live divergence, e.g. a
late fenced write the live owner never read) before storing the log's answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson
import redis

from runlog._settings import Settings
from runlog.errors import RedisUnavailable, RunlogError
from runlog.log import _copies as copies
from runlog.log import _metrics as metrics
from runlog.log._authority import authority_for, tenant_keys_for
from runlog.log._clients import REDIS_ERRORS
from runlog.log._fold import read_run
from runlog.log._reader import LogReader
from runlog.projections._run_state import FOLD_VERSION, RunState
from runlog.schemas._codec import registry
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority


class LiveRun(Protocol):
    """What a snapshot needs of a writer's run (``runlog.producers._engine.Run`` is one)."""

    @property
    def run_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...

    partition: int
    last_offset: int | None
    state: RunState


log = logging.getLogger(__name__)

FORMAT = 1
"""Snapshot body format; bump when the body's shape changes (older bodies become misses)."""

_SWAP = """
local cur = redis.call('HGET', KEYS[1], 'current')
local curseq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '-1')
if cur and tonumber(ARGV[2]) < curseq then
  redis.call('DEL', ARGV[1])
  return 0
end
local prev = redis.call('HGET', KEYS[1], 'previous')
if prev and prev ~= cur then redis.call('DEL', prev) end
if cur then
  redis.call('HSET', KEYS[1], 'previous', cur, 'previous_seq', tostring(curseq))
end
redis.call('HSET', KEYS[1], 'current', ARGV[1], 'seq', ARGV[2])
return 1
"""

_QUARANTINE = """
local function move(field, seqfield)
  local body = redis.call('HGET', KEYS[1], field)
  local old = redis.call('HGET', KEYS[1], 'quarantined')
  if old and old ~= body then redis.call('DEL', old) end
  redis.call('HSET', KEYS[1], 'quarantined', body, 'quarantined_seq', ARGV[1])
  redis.call('HDEL', KEYS[1], field, seqfield)
end
local cur = redis.call('HGET', KEYS[1], 'current')
if cur and redis.call('HGET', KEYS[1], 'seq') == ARGV[1] then
  move('current', 'seq')
  local prev = redis.call('HGET', KEYS[1], 'previous')
  if prev then
    redis.call('HSET', KEYS[1], 'current', prev, 'seq', redis.call('HGET', KEYS[1], 'previous_seq'))
    redis.call('HDEL', KEYS[1], 'previous', 'previous_seq')
  end
  return 1
end
if redis.call('HGET', KEYS[1], 'previous_seq') == ARGV[1] then
  move('previous', 'previous_seq')
  return 1
end
return 0
"""


class SnapshotInvalid(RunlogError):
    """A stored snapshot body that must not be used; ``reason`` says why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Snapshot:
    """A validated snapshot body."""

    key: str
    run_id: str
    tenant: str
    seq: int
    epoch: int
    partition: int
    offset: int
    fold_version: int
    written_at: str
    state: RunState


def _digest(body: dict[str, Any]) -> str:
    text = json.dumps(
        {k: v for k, v in body.items() if k != "digest"}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()


_DIGEST_AT = b'{"deciders":"'
"""How a body written by ``encode_body`` begins: its keys are sorted, so ``digest`` comes
second, right after ``deciders`` (a string, which cannot hold an unescaped quote)."""


def _digest_matches(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether ``body`` (parsed from ``raw``) matches its digest.

    A body ``encode_body`` wrote is the canonical JSON of its fields, so the canonical JSON
    of the rest is ``raw`` without its ``"digest":"...",`` pair: hashing that slice spares
    a second serialisation of the whole state, which cost as much as parsing it. Any other
    spelling of a body (keys reordered, spaces) is checked the long way, and is as valid.
    """
    digest = body.get("digest")
    if not isinstance(digest, str):
        return False
    pair = b'"digest":"' + digest.encode() + b'",'
    if raw.startswith(_DIGEST_AT):
        at = raw.find(b',"digest":"', len(_DIGEST_AT))
        if at > 0 and raw.startswith(pair, at + 1):
            rest = raw[: at + 1] + raw[at + 1 + len(pair) :]
            if hashlib.sha256(rest).hexdigest() == digest:
                return True
    return digest == _digest(body)


def encode_body(
    state: RunState,
    *,
    tenant: str,
    run_id: str,
    partition: int,
    offset: int,
    tenant_macs: str = "none",
) -> bytes:
    """``tenant_macs``: ``TenantKeys.fingerprint`` of the keys the fold checked the run's
    records with (which records it counts depends on them, like ``deciders``)."""
    return _encode(
        state,
        state.to_dict(),
        tenant=tenant,
        run_id=run_id,
        partition=partition,
        offset=offset,
        tenant_macs=tenant_macs,
    )[0]


def _encode(
    state: RunState,
    state_dict: dict[str, Any],
    *,
    tenant: str,
    run_id: str,
    partition: int,
    offset: int,
    tenant_macs: str,
) -> tuple[bytes, str]:
    """``encode_body`` of a state already turned into ``state_dict``; (body, written_at)."""
    written_at = datetime.now(UTC).isoformat()
    body: dict[str, Any] = {
        "format": FORMAT,
        "fold_version": FOLD_VERSION,
        "schema_versions": {et.value: v for et, v in sorted(registry().current.items())},
        "run_id": run_id,
        "tenant": tenant,
        "seq": state.seq,
        "epoch": state.epoch,
        "partition": partition,
        "offset": offset,
        "written_at": written_at,
        "state": state_dict,
        # The decider keys the state was folded under: which decisions it counts depends on
        # them, so a reader that trusts other keys must not continue it (a cache miss).
        "deciders": state.authority.fingerprint(),
        "tenant_macs": tenant_macs,
    }
    # The canonical JSON of the rest is serialised once: hashed, then the digest spliced in
    # where sorting puts it (second, after "deciders"), which is what serialising the body
    # with its digest would give, without a second pass over the whole state.
    rest = _canonical(body)
    digest = hashlib.sha256(rest.encode()).hexdigest()
    head = '{"deciders":' + json.dumps(body["deciders"]) + ","
    if not rest.startswith(head):  # pragma: no cover - a key sorted before "deciders"
        body["digest"] = digest
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), written_at
    return (head + f'"digest":"{digest}",' + rest[len(head) :]).encode(), written_at


def _canonical(body: dict[str, Any]) -> str:
    """``json.dumps(body, sort_keys=True, separators=(",", ":"))``, by orjson where its text
    is ASCII (``json`` escapes the rest): 6x faster on a state of MBs, which a snapshot
    write of a long run pays at its durable point. The two differ only in how they spell a
    few floats (``1e-05``, ``0.00001``); a body's digest is checked on its own bytes."""
    try:
        fast = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits, a key that is not a string
        fast = b""
    if fast and fast.isascii():
        return fast.decode("ascii")
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _parse(raw: bytes) -> Any:
    """A body's JSON: orjson (3x faster than ``json`` on a long run's state, what a resume
    from a snapshot pays first), ``json`` for what orjson refuses (integers beyond 64 bits)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def decode_body(
    raw: bytes | None,
    *,
    key: str,
    tenant: str,
    run_id: str,
    partition: int | None,
    authority: DecisionAuthority = NO_AUTHORITY,
    tenant_macs: str = "none",
) -> Snapshot:
    """A validated snapshot, or ``SnapshotInvalid`` naming the reason."""
    if raw is None:
        raise SnapshotInvalid("missing", f"body {key} is gone")
    try:
        body = _parse(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotInvalid("unparsable", str(exc)) from exc
    if not isinstance(body, dict):
        raise SnapshotInvalid("unparsable", "body is not an object")
    if not _digest_matches(raw, body):
        raise SnapshotInvalid("digest", f"body {key} does not match its digest")
    if body.get("format") != FORMAT:
        raise SnapshotInvalid("format", f"snapshot format {body.get('format')} (know {FORMAT})")
    if body.get("fold_version") != FOLD_VERSION:
        raise SnapshotInvalid(
            "fold_version", f"fold v{body.get('fold_version')} (this code folds v{FOLD_VERSION})"
        )
    if body.get("run_id") != run_id or body.get("tenant") != tenant:
        raise SnapshotInvalid(
            "identity", f"body belongs to {body.get('tenant')}/{body.get('run_id')}"
        )
    if partition is not None and body.get("partition") != partition:
        raise SnapshotInvalid(
            "partition", f"written for partition {body.get('partition')}, run is in {partition}"
        )
    if body.get("deciders", "none") != authority.fingerprint():
        raise SnapshotInvalid(
            "deciders",
            f"folded trusting decider keys {body.get('deciders', 'none')}, this reader trusts "
            f"{authority.fingerprint()}",
        )
    if body.get("tenant_macs", "none") != tenant_macs:
        raise SnapshotInvalid(
            "tenant_macs", "folded checking other tenant MAC keys than this reader's"
        )
    try:
        state = RunState.from_dict(body["state"], authority)
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotInvalid("state", f"{type(exc).__name__}: {exc}") from exc
    if state.seq != body.get("seq") or state.run_id != run_id:
        raise SnapshotInvalid("state", "state disagrees with the body's seq or run")
    return Snapshot(
        key=key,
        run_id=run_id,
        tenant=tenant,
        seq=int(body["seq"]),
        epoch=int(body["epoch"]),
        partition=int(body["partition"]),
        offset=int(body["offset"]),
        fold_version=int(body["fold_version"]),
        written_at=str(body["written_at"]),
        state=state,
    )


class SnapshotStore:
    """Snapshots of runs in Redis. Thread-safe; one per process (see ``runlog._bootstrap``)."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        interval: int | None = None,
        from_log: bool = True,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.interval = settings.snapshot_interval if interval is None else interval
        """Default events between snapshots of a run; 0 disables ``maybe_write``."""
        self.from_log = from_log
        """Derive each snapshot by folding the log (True) or trust the live state (False)."""
        self._swap = client.register_script(_SWAP)
        self._quarantine = client.register_script(_QUARANTINE)
        self._lock = threading.Lock()
        self._intervals: dict[tuple[str, str], int] = {}
        self._last_seq: dict[tuple[str, str], int] = {}
        self._waitaof: bool | None = None
        self.last_miss: str | None = None

    # Keys --------------------------------------------------------------------------------
    def pointer_key(self, tenant: str, run_id: str) -> str:
        return copies.snapshot_key(self.settings.redis_key_prefix, tenant, run_id)

    def _body_key(self, tenant: str, run_id: str, seq: int) -> str:
        return f"{self.pointer_key(tenant, run_id)}:{seq}:{uuid.uuid4().hex[:8]}"

    # Interval ------------------------------------------------------------------------------
    def set_interval(self, tenant: str, run_id: str, interval: int) -> None:
        """Override the interval for one run (0: never snapshot it); stored with its pointer."""
        if interval < 0:
            raise ValueError("interval must be >= 0")
        try:
            self.redis.hset(self.pointer_key(tenant, run_id), "interval", str(interval))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"snapshot interval of {run_id}: {exc}") from exc
        with self._lock:
            self._intervals[(tenant, run_id)] = interval

    def interval_for(self, tenant: str, run_id: str) -> int:
        with self._lock:
            known = self._intervals.get((tenant, run_id))
        if known is not None:
            return known
        try:
            raw = self.redis.hmget(self.pointer_key(tenant, run_id), ["interval", "seq"])
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"snapshot interval of {run_id}: {exc}") from exc
        value = self.interval if raw[0] is None else int(raw[0])
        with self._lock:
            self._intervals[(tenant, run_id)] = value
            if raw[1] is not None:
                self._last_seq.setdefault((tenant, run_id), int(raw[1]))
        return value

    # Writing -------------------------------------------------------------------------------
    def due(self, run: LiveRun) -> bool:
        """Whether ``maybe_write`` may write now, from what this store already knows."""
        key = (run.tenant, run.run_id)
        with self._lock:
            interval = self._intervals.get(key)
            last = self._last_seq.get(key, 0)
        if interval is None:
            return True  # not read from Redis yet: let maybe_write find out
        return interval > 0 and run.state.seq - last >= interval

    def maybe_write(self, run: LiveRun) -> bool:
        """Write a snapshot if the run has advanced an interval since its last one.

        Called after every durable append. A failure is logged, never raised: a snapshot
        is a cache and must not stop the run.
        """
        try:
            interval = self.interval_for(run.tenant, run.run_id)
            if interval <= 0 or run.last_offset is None:
                return False
            with self._lock:
                last = self._last_seq.get((run.tenant, run.run_id), 0)
            if run.state.seq - last < interval:
                return False
            self.write(run)
            return True
        except REDIS_ERRORS as exc:
            log.warning("snapshot of %s at seq %s skipped: %s", run.run_id, run.state.seq, exc)
            return False
        except RunlogError as exc:
            log.warning("snapshot of %s at seq %s skipped: %s", run.run_id, run.state.seq, exc)
            return False

    def write(self, run: LiveRun) -> Snapshot:
        """Snapshot ``run`` as of its last acknowledged record (see the module docstring)."""
        if run.last_offset is None:
            raise ValueError(f"run {run.run_id} has no acknowledged record to snapshot")
        offset = run.last_offset + 1
        t0 = time.perf_counter()
        state, state_dict = run.state, None
        if self.from_log:
            state = self.fold_log(run.tenant, run.run_id, run.partition, offset)
            # Equal durable fields, equal digests: the dicts are compared, and the log's is
            # the one stored, each state turned into a dict once.
            state_dict = state.to_dict()
            if state_dict != run.state.to_dict():
                metrics.incr("snapshot_live_divergences")
                log.warning(
                    "run %s: live state at seq %s differs from the log's fold at seq %s "
                    "(e.g. a fenced write the owner never read); snapshotting the log's",
                    run.run_id,
                    run.state.seq,
                    state.seq,
                )
        snap = self._put(
            run.tenant,
            run.run_id,
            state,
            partition=run.partition,
            offset=offset,
            state_dict=state_dict,
        )
        metrics.timing("snapshot_write_ms", (time.perf_counter() - t0) * 1000)
        return snap

    def fold_log(self, tenant: str, run_id: str, partition: int, end: int) -> RunState:
        """The run's state from its log up to ``end`` (from the latest usable snapshot)."""
        reader = LogReader(self.settings)
        try:
            got = read_run(
                reader,
                self.redis,
                self.settings,
                tenant,
                run_id,
                snapshots=_Uncounted(self),
                end=end,
            )
            if got.partition != partition:
                raise ValueError(f"run {run_id} is in partition {got.partition}, not {partition}")
            return got.state
        finally:
            reader.close()

    def put(
        self, tenant: str, run_id: str, state: RunState, *, partition: int, offset: int
    ) -> Snapshot:
        """Store ``state`` as the run's current snapshot, tail starting at ``offset``."""
        return self._put(tenant, run_id, state, partition=partition, offset=offset)

    def _put(
        self,
        tenant: str,
        run_id: str,
        state: RunState,
        *,
        partition: int,
        offset: int,
        state_dict: dict[str, Any] | None = None,
    ) -> Snapshot:
        if state.run_id != run_id or state.tenant != tenant:
            raise ValueError(f"state of {state.tenant}/{state.run_id} is not {tenant}/{run_id}")
        if state_dict is None:
            state_dict = state.to_dict()
        macs = tenant_keys_for(self.settings).fingerprint(tenant)
        body, written_at = _encode(
            state,
            state_dict,
            tenant=tenant,
            run_id=run_id,
            partition=partition,
            offset=offset,
            tenant_macs=macs,
        )
        key = self._body_key(tenant, run_id, state.seq)
        t0 = time.perf_counter()
        try:
            self.redis.set(key, body)
            self._wait_durable()
            self._swap(keys=[self.pointer_key(tenant, run_id)], args=[key, state.seq])
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"snapshot of {run_id} at seq {state.seq}: {exc}") from exc
        metrics.incr("snapshot_writes")
        metrics.timing("snapshot_put_ms", (time.perf_counter() - t0) * 1000)
        with self._lock:
            self._last_seq[(tenant, run_id)] = state.seq
        # What a load of this body would give, without parsing back what was just written:
        # a state of its own (from the dict stored), never the caller's live one.
        return Snapshot(
            key=key,
            run_id=run_id,
            tenant=tenant,
            seq=state.seq,
            epoch=state.epoch,
            partition=partition,
            offset=offset,
            fold_version=FOLD_VERSION,
            written_at=written_at,
            state=RunState.from_dict(state_dict, authority_for(self.settings)),
        )

    def _wait_durable(self) -> None:
        """fsync the body to the AOF before the pointer moves, where Redis can (7.2+)."""
        if self._waitaof is False:
            return
        try:
            self.redis.execute_command("WAITAOF", 1, 0, 5000)  # type: ignore[no-untyped-call]
            self._waitaof = True
        except redis.ResponseError as exc:
            # Unknown command (Redis < 7.2) or AOF off: ordering of the AOF is the guarantee.
            log.info("WAITAOF unavailable (%s); relying on AOF ordering", exc)
            self._waitaof = False

    # Reading -------------------------------------------------------------------------------
    def _pointer(self, tenant: str, run_id: str) -> dict[str, str]:
        try:
            raw = self.redis.hgetall(self.pointer_key(tenant, run_id))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"snapshot pointer of {run_id}: {exc}") from exc
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): (
                v.decode() if isinstance(v, bytes) else str(v)
            )
            for k, v in raw.items()
        }

    def candidates(
        self, tenant: str, run_id: str, *, partition: int | None = None
    ) -> list[Snapshot | SnapshotInvalid]:
        """Every stored snapshot (current, then previous), validated or with its error."""
        return list(self._candidates(tenant, run_id, partition=partition))

    def _candidates(
        self, tenant: str, run_id: str, *, partition: int | None = None
    ) -> Iterator[Snapshot | SnapshotInvalid]:
        """The stored snapshots, current first, each read and validated only when asked for:
        a load that can use the current one never parses the previous (a body holds the
        whole state, so that would double the load)."""
        ptr = self._pointer(tenant, run_id)
        for field in ("current", "previous"):
            key = ptr.get(field)
            if key is None:
                continue
            try:
                raw = self.redis.get(key)
            except REDIS_ERRORS as exc:
                raise RedisUnavailable(f"snapshot body of {run_id}: {exc}") from exc
            try:
                yield decode_body(
                    raw if isinstance(raw, bytes) else None,
                    key=key,
                    tenant=tenant,
                    run_id=run_id,
                    partition=partition,
                    authority=authority_for(self.settings),
                    tenant_macs=tenant_keys_for(self.settings).fingerprint(tenant),
                )
            except SnapshotInvalid as exc:
                yield exc

    def load(
        self,
        tenant: str,
        run_id: str,
        *,
        partition: int,
        max_seq: int | None = None,
        count: bool = True,
    ) -> tuple[RunState, int] | None:
        """``(state, offset the tail starts at)`` of the newest usable snapshot, else None."""
        t0 = time.perf_counter()
        self.last_miss = None
        found: tuple[RunState, int] | None = None
        reasons: list[str] = []
        for cand in self._candidates(tenant, run_id, partition=partition):
            if isinstance(cand, SnapshotInvalid):
                reasons.append(cand.reason)
                log.warning("snapshot of %s unusable (%s); trying the next", run_id, cand)
                continue
            if max_seq is not None and cand.seq > max_seq:
                reasons.append("after_target")
                continue
            found = (cand.state, cand.offset)
            break
        if count:
            metrics.timing("snapshot_load_ms", (time.perf_counter() - t0) * 1000)
            if found is not None:
                metrics.incr("snapshot_loads")
            elif reasons:
                metrics.incr("snapshot_misses")
        self.last_miss = ",".join(reasons) or None
        if found is not None:
            with self._lock:
                self._last_seq.setdefault((tenant, run_id), found[0].seq)
        return found

    def discontinuous(self, tenant: str, run_id: str, seq: int) -> None:
        """The log does not continue the snapshot at ``seq``: quarantine it (kept for diagnosis)."""
        metrics.incr("snapshot_discontinuities")
        try:
            self._quarantine(keys=[self.pointer_key(tenant, run_id)], args=[str(seq)])
        except REDIS_ERRORS as exc:
            log.warning("could not quarantine snapshot %s of %s: %s", seq, run_id, exc)
        with self._lock:
            self._last_seq.pop((tenant, run_id), None)

    def delete(self, tenant: str, run_id: str) -> int:
        """Remove every snapshot of a run (recovery must not notice, except in time)."""
        ptr = self._pointer(tenant, run_id)
        keys = [v for k, v in ptr.items() if k in ("current", "previous", "quarantined")]
        try:
            return int(self.redis.delete(self.pointer_key(tenant, run_id), *keys))
        except REDIS_ERRORS as exc:
            raise RedisUnavailable(f"deleting snapshots of {run_id}: {exc}") from exc


class _Uncounted:
    """A store as a ``SnapshotSource`` whose loads are not counted as recoveries (a write's
    own fold is bookkeeping, not a resumption)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def load(
        self, tenant: str, run_id: str, *, partition: int, max_seq: int | None = None
    ) -> tuple[RunState, int] | None:
        return self.store.load(tenant, run_id, partition=partition, max_seq=max_seq, count=False)

    def discontinuous(self, tenant: str, run_id: str, seq: int) -> None:
        self.store.discontinuous(tenant, run_id, seq)
