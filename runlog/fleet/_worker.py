"""``runlog worker``: execute registered agents, dispatched by Kafka's consumer group.

One consumer (group ``<prefix>.workers``, cooperative-sticky) follows the lifecycle topic.
Each assigned partition is read from its beginning (the compacted topic is the table of its
open runs; no offsets are committed) and then followed. Once caught up, every ``requested``
or ``open`` run of the partition is dispatched in a free slot, every ``waiting_until`` one
goes into a timer heap, and each later record is acted on as it arrives. The lease decides
who acts: a run whose lease is held is tried again when the holder's lease runs out, so an
orphan (its worker died) is resumed by whoever owns its partition then.

The main thread polls the consumer, fires timers and launches dispatches; sync agents run
in a thread pool of ``concurrency`` slots, async agents in one event loop (same slots).
A dispatch's result comes back to the main thread through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from runlog._settings import Settings
from runlog.errors import ConfigError, RedisUnavailable
from runlog.fleet import _handoffs as handoffs
from runlog.fleet import _lifecycle as lifecycle
from runlog.fleet import _reconciling as reconciling
from runlog.fleet._lifecycle import DISPATCHABLE, LifecycleWriter, Record
from runlog.fleet._reconciling import ReconcileRequest, Served
from runlog.fleet._registry import Agent
from runlog.fleet._runner import (
    UNKNOWN_AGENT_RETRY_S,
    Result,
    batch_claim,
    check_end,
    check_unserved,
    execute,
    execute_async,
    locked_retry_s,
)
from runlog.log._clients import REDIS_ERRORS, async_redis_client
from runlog.log._holders import holders
from runlog.log._reader import Prefetch
from runlog.log._tail import WINDOW
from runlog.producers._engine import RunDeps
from runlog.producers._lease import Lease, sessions_key
from runlog.producers._opening import Batch, Claim
from runlog.schemas import _codec as codec
from runlog.schemas._keys import live_key, partition_for
from runlog.schemas._registry import registry

log = logging.getLogger(__name__)
T = TypeVar("T")

OPENING = 16
"""Runs a worker opens at once. Opening is reads of the log (replay, the claim's read-back)
on a reader of the process's pool, each reader a Kafka consumer: a burst of requests or
orphans opened all at once makes a consumer per open (its connections, metadata and first
fetch cost more than the read) and slows the runs already going. A few at a time reuse the
pool's readers (as many as it keeps idle, ``ReaderPool``'s ``keep``), and each open is a few
milliseconds; the rest wait their turn in their slot."""
ADOPTING = 64
"""Runs a worker opens at once when it takes them over (a dead session's, a drained
worker's) and their partition is read once for all of them (``Prefetch``, at most
``OPENING`` passes at once): such an open reads nothing of its own (its replay comes from
the pass, its claim is read back from the process's log tail), so it borrows no reader's
consumer, and what bounds it is round trips to Redis and the broker, not readers."""
ADOPT_BATCH = 256
"""At most this many of a dead session's runs of one partition are claimed together
(``Batch``): their claims sent in one produce batch and one flush, their ownership checked
in one round trip. A partition's runs are cut into equal batches."""
ADOPT_OPENS = 12
"""Batches opened at once, each as soon as the first of its runs is launched (not when
that dispatch gets its turn to open: it waits for ``ADOPTING`` behind the runs of the
batches launched before). A drain's handovers come as many small batches (those of each
partition announced together), mostly waiting on round trips: at 4 at once, 200 runs
handed over within half a second waited up to 0.4 s for a turn."""
HEARTBEAT_S = 2.0
"""How often a worker refreshes its entry in ``runlog workers`` (which expires after 3)."""
ADOPT_POLL_S = 0.25
"""How often a worker looks for dead sessions (one ``HKEYS`` and one ``PTTL`` per session:
the fleet's size, never its number of runs)."""
ADOPT_LATE_POLL_S = 0.1
"""How often while a session is late (its key under ``BURY_BELOW`` of its TTL)."""
LATE_GRACE_S = 0.3
"""How long a session is seen late, Redis answering, before it may be buried: more than a
renewal period (TTL/8), so a process whose subscription dropped with its connection (Redis
restarted) renews and subscribes again first."""
HELD_TTL_S = 7 * 24 * 3600
"""How long a session's set of held runs outlives its last change (a dead session's is
deleted by whoever adopts its runs)."""
HANDOFF_WAIT_S = 1
"""How long a worker's ``BLPOP`` on the handoffs list blocks (one command a second per
idle worker, whatever the number of runs)."""
HANDOFF_BATCH = 64
"""Announcements a worker pops in one round trip (the runs it then takes are replayed
from one pass over each partition)."""
WARM_PASS_S = 30.0
"""How long a pass read for a drain's runs before they come (``_warm_coming``) is kept for
their claims."""
HANDOFF_HORIZON_S = 10.0
"""A draining worker announces its partitions' durable sleeps that end within this much
(the rest are due after the group has moved the partitions)."""
HEARTBEAT_MAX_MS = 300
"""The group heartbeat's longest interval: when a worker drains, the others learn of the
rebalance at their next heartbeat and take its partitions then."""


def workers_key(settings: Settings, worker_id: str = "*") -> str:
    return f"{settings.redis_key_prefix}:workers:{worker_id}"


def live_workers(client: redis.Redis, settings: Settings) -> list[dict[str, str]]:
    """The workers that refreshed their entry within the last three heartbeats."""
    out = []
    for key in client.scan_iter(match=workers_key(settings), count=500):
        raw = client.hgetall(key)
        if raw:
            out.append({_text(k): _text(v) for k, v in raw.items()})
    return sorted(out, key=lambda w: (w.get("since", ""), w.get("id", "")))


def held_key(settings: Settings, session: str) -> str:
    """The runs a worker's session holds (run id -> ``tenant\tagent``): what another
    worker adopts when the session dies."""
    return f"{settings.redis_key_prefix}:held:{session}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _parsed(got: queue.Queue[bytes], parse: Callable[[bytes], T], what: str) -> Iterator[T]:
    """The announcements ``got`` holds now, each parsed; one that does not parse is
    reported and skipped (one bad announcement must not stop dispatch)."""
    while True:
        try:
            raw = got.get_nowait()
        except queue.Empty:
            return
        try:
            item = parse(raw)
        except Exception as exc:  # noqa: BLE001 - see above
            log.error("%s announcement: %s", what, exc)
            continue
        yield item


@dataclass
class Entry:
    record: Record | None
    """None: finished (its tombstone is at ``offset``)."""
    offset: int


class Worker:
    def __init__(
        self,
        settings: Settings,
        deps: RunDeps,
        agents: dict[str, Agent],
        *,
        concurrency: int = 8,
        worker_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.deps = deps
        self.agents = agents
        self.concurrency = max(1, concurrency)
        self.id = worker_id or deps.writer_id
        self.lw: LifecycleWriter = lifecycle.writer_for(settings)
        self.tables: dict[int, dict[str, Entry]] = {}
        self.high: dict[int, int] = {}
        self.caught_up: set[int] = set()
        self.ready: deque[str] = deque()
        self.queued: set[str] = set()
        self.heap: list[tuple[float, int, str]] = []
        self._seq = 0
        self.active: dict[str, Future[Result]] = {}
        self.launched: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}
        """The tenant of each active dispatch's run (what a drain announces: ``_shutdown``)."""
        self.adopted: dict[str, Entry] = {}
        self.late: dict[str, float] = {}
        """Sessions seen late (``_adopt``), with when they were first seen so."""
        """Runs of a dead worker's session this worker dispatches although their
        partitions are not (yet) its own (``_adopt``)."""
        self.prefetch: dict[str, Prefetch] = {}
        """An adopted run's pass over its partition, made for all the runs adopted with it
        (``Prefetch``): used by its first dispatch only."""
        self.claimed: dict[str, Lease] = {}
        """Leases of adopted or handed-over runs taken when they were scheduled
        (``LeaseManager.acquire_dead`` / ``acquire_free``, one round trip for many runs):
        used by their first dispatch, released if none comes."""
        self.batches: dict[str, Batch] = {}
        """Adopted runs claimed together (``Batch``): used by their first dispatch,
        dropped (their leases let go) if none comes."""
        self._held: dict[str, str | None] = {}
        """Changes to this session's held set not yet written (run id -> value, None: gone)."""
        """The lifecycle offset of the record each active dispatch was launched on."""
        self.results: queue.Queue[tuple[str, Future[Result]]] = queue.Queue()
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="runlog-agent")
        self._batch_pool = ThreadPoolExecutor(ADOPT_OPENS, thread_name_prefix="runlog-adopt")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._opening = threading.BoundedSemaphore(OPENING)
        self._opening_async: asyncio.Semaphore | None = None
        self._adopting = threading.BoundedSemaphore(ADOPTING)
        self._reads = threading.BoundedSemaphore(OPENING)
        """Passes (``Prefetch``) read at once: each borrows a reader, as an open does."""
        self._adopting_async: asyncio.Semaphore | None = None
        self._aredis: Any = None
        self.since = codec.now_utc().isoformat()
        self.stats = {"dispatched": 0, "finished": 0, "waiting": 0, "locked": 0, "retried": 0}
        self.stats["erased"] = 0  # start requests dropped: their subject was forgotten
        self.stats["rebuilt"] = 0  # records that disagreed with their run's log, rewritten
        self.stats["checked"] = 0  # records read in the log: an agent not served, a tombstone
        self.tombstoned: dict[str, Record] = {}
        """Runs tombstoned by someone while a dispatch of them was active, with the record
        they had: checked against the log if that dispatch wrote no record."""
        self.unserved: dict[str, int] = {}
        """Runs whose record (at this offset) names an agent not served here, checked
        against the log already."""
        self.stats["handed_over"] = 0  # runs let go at a step's boundary while draining
        self._consumer: Any = None
        self._stop = threading.Event()
        self.handoffs: queue.Queue[bytes] = queue.Queue()
        """Announcements popped by the listener (``_listen``), taken by the main loop."""
        self._listening = threading.Event()
        self.coming: queue.Queue[bytes] = queue.Queue()
        """Announcements of a drain's runs about to come (``handoffs.announce_coming``),
        popped by the listener, taken by the main loop (``_warm_coming``)."""
        self.warm: dict[int, tuple[Prefetch, float]] = {}
        """By partition: the pass read for a drain's runs before they came, and when."""
        self.announced: set[str] = set()
        """Runs announced handed over while a dispatch of them was active."""
        # Reconcile requests (``fleet.reconciling``) of the assigned partitions, by record
        # key: served in the agents' pool, apart from the runs' table (they are no run).
        self.requests: dict[str, tuple[int, ReconcileRequest]] = {}
        self.requests_due: list[tuple[float, str]] = []
        self.serving: dict[str, Future[Served]] = {}
        self.served: queue.Queue[tuple[str, Future[Served]]] = queue.Queue()

    # The group ---------------------------------------------------------------------------
    def _consumer_conf(self) -> dict[str, Any]:
        session = self.settings.worker_session_timeout_ms
        tunables = {
            "session.timeout.ms": session,
            # Often enough that a drained worker's partitions reach the others within a
            # fraction of a second (a member learns of a rebalance at its next heartbeat).
            "heartbeat.interval.ms": max(100, min(session // 3, HEARTBEAT_MAX_MS)),
            "fetch.wait.max.ms": 100,
        }
        common = self.settings.kafka_common()  # RUNLOG_KAFKA_EXTRA may tune the group
        conf = {
            **tunables,
            **common,
            "group.id": lifecycle.group(self.settings),
            "client.id": f"runlog-worker-{self.id}",
            # The compacted partition is the table: read whole on assignment, never
            # committed, so the group's offsets never hide a run.
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.partition.eof": False,
        }
        if str(common.get("group.protocol", "classic")).lower() == "consumer":
            # KIP-848: the broker assigns (incrementally) and owns the session timeout
            # (group.consumer.session.timeout.ms); the client may not set them.
            for key in ("session.timeout.ms", "heartbeat.interval.ms"):
                if key not in common:
                    conf.pop(key)
            conf.pop("partition.assignment.strategy")
        return conf

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        from confluent_kafka import OFFSET_BEGINNING

        empty: list[int] = []
        for tp in partitions:
            lo, hi = consumer.get_watermark_offsets(tp, timeout=10, cached=False)
            self.tables[tp.partition] = {}
            self.high[tp.partition] = hi
            tp.offset = OFFSET_BEGINNING
            empty.extend([tp.partition] if hi <= lo else [])
        consumer.incremental_assign(partitions)
        log.info("worker %s assigned %s", self.id, sorted(tp.partition for tp in partitions))
        for p in empty:
            self._catch_up(p)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {tp.partition for tp in partitions}
        for tp in partitions:
            self.tables.pop(tp.partition, None)
            self.caught_up.discard(tp.partition)
        for key in [k for k, (p, _) in self.requests.items() if p in gone]:
            del self.requests[key]
        consumer.incremental_unassign(partitions)
        log.info("worker %s revoked %s", self.id, sorted(tp.partition for tp in partitions))

    # The table ---------------------------------------------------------------------------
    def _apply(self, partition: int, offset: int, key: bytes, value: bytes | None) -> None:
        table = self.tables.get(partition)
        if table is None:
            return
        rid = key.decode()
        if reconciling.is_request_key(rid):
            self._apply_request(partition, rid, value)
            return
        have = table.get(rid)
        if have is not None and have.offset >= offset:
            if have.offset == offset and value is None:
                del table[rid]  # our own tombstone came back: forget the run
            return
        if value is None:
            gone = table.pop(rid, None)
            self.unserved.pop(rid, None)
            if gone is not None and gone.record is not None and partition in self.caught_up:
                self._check_end(rid, gone.record)
            return
        try:
            rec = Record.decode(value)
        except Exception as exc:  # noqa: BLE001 - one bad record must not stop dispatch
            log.error("lifecycle record of %s at %s/%s: %s", rid, partition, offset, exc)
            return
        table[rid] = Entry(rec, offset)
        if partition in self.caught_up:
            self._schedule(rid, table[rid])

    def _apply_request(self, partition: int, key: str, value: bytes | None) -> None:
        if value is None:
            self.requests.pop(key, None)
            return
        try:
            req = ReconcileRequest.decode(value)
        except Exception as exc:  # noqa: BLE001 - one bad record must not stop dispatch
            log.error("reconcile request %s: %s", key, exc)
            return
        self.requests[key] = (partition, req)
        self.requests_due.append((0.0, key))

    def _serve_requests(self) -> None:
        """Launch the reconcile requests that are due, of caught-up partitions, whose agent
        is registered here, in free slots of the agents' pool."""
        now, later = time.monotonic(), []
        for due, key in self.requests_due:
            got = self.requests.get(key)
            if got is None or key in self.serving:
                continue
            partition, req = got
            free = len(self.active) + len(self.serving) < self.concurrency
            if due > now or partition not in self.caught_up or not free:
                later.append((due, key))
                continue
            agent = self.agents.get(req.agent)
            if agent is None:
                log.error(
                    "reconcile of %s names agent %r, not registered here", req.run_id, req.agent
                )
                later.append((now + UNKNOWN_AGENT_RETRY_S, key))
                continue
            fut = self.pool.submit(reconciling.serve, self.deps, self.lw, req, agent, self.id)
            self.serving[key] = fut
            fut.add_done_callback(functools.partial(self._request_done, key))
        self.requests_due = later

    def _request_done(self, key: str, fut: Future[Served]) -> None:
        self.served.put((key, fut))

    def _reap_requests(self) -> None:
        while True:
            try:
                key, fut = self.served.get_nowait()
            except queue.Empty:
                return
            self.serving.pop(key, None)
            try:
                res = fut.result()
            except BaseException as exc:
                log.exception("reconcile request %s crashed: %s", key, exc)
                res = Served("retry", 5.0, repr(exc))
            if res.kind == "retry":
                self.requests_due.append((time.monotonic() + res.retry_s, key))
            else:
                self.requests.pop(key, None)

    def _catch_up(self, partition: int) -> None:
        self.caught_up.add(partition)
        table = self.tables.get(partition, {})
        log.info("worker %s: partition %s caught up, %s open runs", self.id, partition, len(table))
        held = self._held_elsewhere(table)
        for rid, entry in table.items():
            if rid in held:
                self._later(rid, held[rid])
                continue
            self._schedule(rid, entry)

    def _held_elsewhere(self, table: dict[str, Entry]) -> dict[str, float]:
        """The runs of a partition just taken whose lease a live holder has (run id -> when
        to try again, as a dispatch that finds it locked would): read in one round trip
        (``holders``), so that a partition moved from a draining worker does not cost an
        open of each of its runs mid-step, which would only find them held while their
        handovers come. A handover announces the run (``_take_handoffs``), and its
        ``open`` record dispatches it: neither waits for the retry."""
        wanted = [
            (entry.record.tenant, rid)
            for rid, entry in table.items()
            if entry.record is not None
            and entry.record.state in DISPATCHABLE
            and rid not in self.active
            and rid not in self.queued
        ]
        if not wanted:
            return {}
        try:
            found = holders(self.deps.redis, self.settings, wanted)
        except RedisUnavailable as exc:
            log.warning("worker %s: leases of %d runs: %s", self.id, len(wanted), exc)
            return {}  # each dispatch asks for itself
        now = codec.now_utc()
        out = {}
        for (_, rid), got in found.items():
            if got is not None and got.owner and got.alive:
                ttl_ms = max(0, int((got.expires_at - now).total_seconds() * 1000))
                out[rid] = locked_retry_s(self.settings, ttl_ms)
        return out

    def _schedule(self, rid: str, entry: Entry) -> None:
        rec = entry.record
        if rec is None or rid in self.active:
            return
        if rec.state in DISPATCHABLE:
            if rid not in self.queued:
                self.queued.add(rid)
                self.ready.append(rid)
        elif rec.state == "waiting_until" and rec.due_at is not None:
            self._later(rid, max(0.0, (rec.due_at - codec.now_utc()).total_seconds()))

    def _later(self, rid: str, delay_s: float) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (time.monotonic() + delay_s, self._seq, rid))

    def _entry(self, rid: str) -> Entry | None:
        table = self.tables.get(partition_for(rid, self.settings.partitions))
        found = None if table is None else table.get(rid)
        return found if found is not None else self.adopted.get(rid)

    def _fire_due(self) -> None:
        now = time.monotonic()
        while self.heap and self.heap[0][0] <= now:
            _, _, rid = heapq.heappop(self.heap)
            entry = self._entry(rid)
            if entry is None or entry.record is None or rid in self.active or rid in self.queued:
                continue
            if entry.record.state in DISPATCHABLE or entry.record.state == "waiting_until":
                due = entry.record.due_at
                if entry.record.state == "waiting_until" and due is not None:
                    left = (due - codec.now_utc()).total_seconds()
                    if left > 0.001:
                        self._later(rid, left)
                        continue
                self.queued.add(rid)
                self.ready.append(rid)

    # Dispatch ----------------------------------------------------------------------------
    def _launch(self) -> None:
        while self.ready and len(self.active) < self.concurrency:
            rid = self.ready.popleft()
            self.queued.discard(rid)
            prefetch = self.prefetch.pop(rid, None)
            lease = self.claimed.pop(rid, None)
            batch = self.batches.pop(rid, None)
            if batch is not None and not batch.started:
                batch.started = True
                self._batch_pool.submit(batch.open)
            entry = self._entry(rid)
            if entry is None or entry.record is None or rid in self.active:
                self._release(lease, rid, batch)
                continue
            rec = entry.record
            agent = self.agents.get(rec.agent)
            fut: Future[Result]
            if agent is None:
                self._release(lease, rid, batch)
                if self.unserved.get(rid) == entry.offset:
                    log.error("run %s names agent %r, not registered here", rid, rec.agent)
                    self._later(rid, UNKNOWN_AGENT_RETRY_S)
                    continue
                # Once per record: the log, not the record, says whose run it is.
                fut = self.pool.submit(check_unserved, self.deps, self.lw, rid, rec)
                self.unserved[rid] = entry.offset
            elif agent.is_async:
                loop = self._event_loop()
                fut = asyncio.run_coroutine_threadsafe(
                    execute_async(
                        self.deps,
                        self._aredis,
                        self.lw,
                        rid,
                        rec,
                        agent,
                        self._opening_async if prefetch is None else self._adopting_async,
                        prefetch,
                        lease,
                        batch,
                    ),
                    loop,
                )
            else:
                fut = self.pool.submit(
                    execute,
                    self.deps,
                    self.lw,
                    rid,
                    rec,
                    agent,
                    self._opening if prefetch is None else self._adopting,
                    prefetch,
                    lease,
                    batch,
                )
            self.active[rid] = fut
            self.launched[rid] = entry.offset
            if agent is not None:  # a check of the log takes no lease: nothing to adopt
                self._held[rid] = f"{rec.tenant}\t{rec.agent}"
                self.tenant_of[rid] = rec.tenant
            self.stats["dispatched" if agent is not None else "checked"] += 1
            fut.add_done_callback(functools.partial(self._done, rid))

    def _release(self, lease: Lease | None, rid: str = "", batch: Batch | None = None) -> None:
        """Let go of a lease taken for a dispatch that does not come (or of run ``rid``'s
        in ``batch``)."""
        try:
            if lease is not None:
                lease.release()
            if batch is not None:
                batch.drop(rid)
        except Exception as exc:  # noqa: BLE001 - its session's end frees it too
            log.warning("worker %s could not release %s: %s", self.id, rid or "a lease", exc)

    def _check_end(self, rid: str, rec: Record) -> None:
        """A tombstone this worker did not write (its own come back while the dispatch is
        active, or at the offset its result recorded) over a run it knew open or waiting:
        the log, read in a slot, says whether the run ended. While a dispatch of the run is
        active the tombstone may be its own: decided when the dispatch ends (``_reap``)."""
        if rid in self.active:
            self.tombstoned[rid] = rec
            return
        fut = self.pool.submit(check_end, self.deps, self.lw, rid, rec)
        self.active[rid] = fut
        self.stats["checked"] += 1
        fut.add_done_callback(functools.partial(self._done, rid))

    def _done(self, rid: str, fut: Future[Result]) -> None:
        self.results.put((rid, fut))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                self._aredis = async_redis_client(self.settings)
                self._opening_async = asyncio.Semaphore(OPENING)
                self._adopting_async = asyncio.Semaphore(ADOPTING)
                ready.set()
                loop.run_forever()

            threading.Thread(target=serve, name="runlog-agent-loop", daemon=True).start()
            ready.wait()
            self.loop = loop
        return self.loop

    def _soon_due(self) -> list[tuple[str, Record]]:
        """This worker's partitions' durable sleeps ending within ``HANDOFF_HORIZON_S``
        that no dispatch of its holds: announced when it drains, so that they are woken on
        time by another worker, not once the group has moved their partition."""
        horizon = codec.now_utc().timestamp() + HANDOFF_HORIZON_S
        out = []
        for table in self.tables.values():
            for rid, entry in table.items():
                rec = entry.record
                if rec is None or rec.state != "waiting_until" or rec.due_at is None:
                    continue
                if rid not in self.active and rec.due_at.timestamp() <= horizon:
                    out.append(
                        (rid, Record("waiting_until", rec.tenant, rec.agent, due_at=rec.due_at))
                    )
        return out

    def _reap(self) -> None:
        while True:
            try:
                rid, fut = self.results.get_nowait()
            except queue.Empty:
                return
            self.active.pop(rid, None)
            launched = self.launched.pop(rid, -1)
            self.tenant_of.pop(rid, None)
            self._held[rid] = None
            try:
                res = fut.result()
            except BaseException as exc:
                log.exception("dispatch of %s crashed: %s", rid, exc)
                res = Result("retry", retry_s=5.0, why=repr(exc))
            self._settle(rid, res, launched)
            rec = self.tombstoned.pop(rid, None)
            if rec is not None and res.kind in ("locked", "retry", "unserved"):
                # The dispatch wrote nothing: the tombstone that came meanwhile was not its.
                table = self.tables.get(partition_for(rid, self.settings.partitions))
                if table is not None and rid not in table:
                    self._check_end(rid, rec)

    def _settle(self, rid: str, res: Result, launched: int = -1) -> None:
        self.adopted.pop(rid, None)  # its partition's owner acts on what it wrote
        announced = rid in self.announced  # handed over while this dispatch tried
        self.announced.discard(rid)
        if res.kind == "handed_over":
            self.stats["handed_over"] += 1  # a drain: the partition is gone already
            return
        table = self.tables.get(partition_for(rid, self.settings.partitions))
        if table is None:
            return  # the partition moved meanwhile: its new owner reads the records
        if res.kind in ("forget", "erased"):
            if res.kind == "erased":
                self.stats["erased"] += 1
            table.pop(rid, None)
            return
        if res.kind == "ended":  # a tombstone the log confirms: only a newer record counts
            entry = table.get(rid)
            if entry is not None:
                self._schedule(rid, entry)
            return
        if res.kind == "unserved":
            log.error("run %s names an agent not registered here", rid)
            self._later(rid, res.retry_s)
            return
        if res.kind in ("locked", "retry"):
            self.stats["locked" if res.kind == "locked" else "retried"] += 1
            entry = table.get(rid)
            if entry is not None and (entry.offset > launched or announced):
                # A record came while this dispatch tried (a drained worker's handover
                # writes ``open`` once it let the run go): try again now, not at the retry.
                self._schedule(rid, entry)
                return
            self._later(rid, res.retry_s)
            return
        self.stats[res.kind if res.kind in ("finished", "rebuilt") else "waiting"] += 1
        entry = table.get(rid)
        if res.offset is not None and (entry is None or entry.offset < res.offset):
            entry = table[rid] = Entry(res.record, res.offset)
        if entry is not None:
            self._schedule(rid, entry)  # a newer record (a decision, a resume) came meanwhile

    # Dead sessions ------------------------------------------------------------------------
    def _write_held(self) -> None:
        """Write this session's held set's changes (one pipeline a loop at most): runs
        added at their launch, removed at their end. A change per dispatch, none per run
        per second."""
        if not self._held or not self.deps.leases.liveness_ttl_ms:
            self._held.clear()  # leases with a TTL each: no session to adopt from
            return
        changes, self._held = self._held, {}
        try:
            session = self.deps.leases.session_id()
            key = held_key(self.settings, session)
            pipe = self.deps.redis.pipeline(transaction=False)
            added: dict[Any, Any] = {rid: v for rid, v in changes.items() if v is not None}
            gone = [rid for rid, v in changes.items() if v is None]
            if added:
                pipe.hset(key, mapping=added)
            if gone:
                pipe.hdel(key, *gone)
            pipe.expire(key, HELD_TTL_S)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis down: the partition owner still retries
            log.warning("worker %s could not record the runs it holds: %s", self.id, exc)

    def _adopt(self) -> None:
        """Dispatch the runs of every session whose liveness key is gone (its worker died) or
        was just buried (its process is gone: ``LeaseManager.bury``):
        at once, not when the group moves the dead worker's partitions (its session timeout)
        and the lease would have expired. The lease decides who runs each: every live
        worker may try, one wins, the others find it held and leave it."""
        if not self.deps.leases.liveness_ttl_ms:
            return  # leases with a TTL each: the partition's owner resumes orphans
        client = self.deps.redis
        prefix = self.settings.redis_key_prefix
        try:
            sessions = [_text(s) for s in client.hkeys(sessions_key(prefix))]
            mine = self.deps.leases.session_id()
            others = [s for s in sessions if s != mine]
            if not others:
                self.late = {}
                return
            pipe = client.pipeline(transaction=False)
            for s in others:
                pipe.pttl(live_key(prefix, s))
            left = [int(t) for t in pipe.execute()]
            dead = [s for s, t in zip(others, left, strict=True) if t == -2]
            # A session that missed its renewals for a while: dead now if its process no
            # longer watches it (killed: ``LeaseManager.bury``), not at its key's expiry.
            below, now = self.deps.leases.bury_below_ms, time.monotonic()
            self.late = {
                s: self.late.get(s, now)
                for s, t in zip(others, left, strict=True)
                if 0 <= t < below
            }
            due = [s for s, seen in self.late.items() if now - seen >= LATE_GRACE_S]
            dead += self.deps.leases.bury(due)
            for s in dead:
                runs = client.hgetall(held_key(self.settings, s))
                taken = {}
                for raw_rid, raw in runs.items():
                    rid, value = _text(raw_rid), _text(raw)
                    if self._adopt_run(rid, value):
                        taken[rid] = value.partition("\t")[0]
                self._claim_dead(s, taken)
                self._prefetch(taken)
                self._batch(taken)
                pipe = client.pipeline(transaction=False)
                pipe.hdel(sessions_key(prefix), s)
                pipe.delete(held_key(self.settings, s))
                pipe.execute()
                log.info("worker %s: session %s is dead, %d runs adopted", self.id, s, len(runs))
        except Exception as exc:  # noqa: BLE001 - the partition owner still retries them
            log.warning("worker %s could not look for dead sessions: %s", self.id, exc)

    def _claim_dead(self, session: str | None, runs: dict[str, str]) -> None:
        """Take the leases of a dead session's runs just adopted (run id -> tenant), or with
        ``session`` None of runs just handed over (``_take_handoffs``: only free leases,
        ``LeaseManager.acquire_free``), in one round trip per batch, not three per run at
        each open; a run whose lease someone else holds is left to its open, which finds
        it so."""
        if not runs:
            return
        wanted = [(tenant, rid) for rid, tenant in runs.items()]
        leases = self.deps.leases
        try:
            if session is None:
                got = leases.acquire_free(wanted, self.deps.writer_id, self.settings.lease_ttl_ms)
            else:
                got = leases.acquire_dead(
                    session, wanted, self.deps.writer_id, self.settings.lease_ttl_ms
                )
        except RedisUnavailable as exc:
            log.warning("worker %s: leases of %d runs: %s", self.id, len(runs), exc)
            return
        for rid, lease in got.items():
            self._release(self.claimed.pop(rid, None))
            self.claimed[rid] = lease

    def _prefetch(self, runs: dict[str, str]) -> None:
        """One pass over each partition for the runs adopted together (run id -> tenant):
        their opens replay from it, not from a read of the partition each."""
        by_partition: dict[int, dict[str, str]] = {}
        for rid, tenant in runs.items():
            p = partition_for(rid, self.settings.partitions)
            by_partition.setdefault(p, {})[rid] = tenant
        for p, group in by_partition.items():
            warm, _ = self.warm.get(p, (None, 0.0))
            if (
                warm is not None
                and not warm.failed  # else one pass of their own, not a read each
                and all(warm.runs.get(r) == t for r, t in group.items())
            ):
                shared = warm  # read for them already: their batch reads on from its end
            else:
                shared = Prefetch(p, group, self._reads)
            for rid in group:
                self.prefetch[rid] = shared

    def _batch(self, runs: dict[str, str]) -> None:
        """Group the runs just adopted or handed over whose leases were taken
        (``_claim_dead``) by their
        pass over the partition, ``ADOPT_BATCH`` a batch (``Batch``), opened in
        ``_batch_pool`` when the first of its runs launches: all claimed together (one
        produce batch and flush, one ownership check, each claim confirmed by reading the
        log back), not one claim each; each dispatch takes its run opened."""
        groups: dict[int, dict[str, Claim]] = {}
        passes: dict[int, Prefetch] = {}
        # Only runs that will have a slot at once: a claim made long before its run can
        # go on would only hold it (the others are opened one by one, as they launch).
        free = self.concurrency - len(self.active) - (len(self.ready) - len(runs))
        for rid in list(runs)[: max(0, free)]:
            lease, shared, entry = self.claimed.get(rid), self.prefetch.get(rid), self._entry(rid)
            if lease is None or shared is None or entry is None or entry.record is None:
                continue
            rec = entry.record
            agent = self.agents.get(rec.agent)
            if agent is None or rec.input_sealed is not None:
                continue  # a sealed input is opened by its dispatch before its claim
            passes[shared.partition] = shared
            groups.setdefault(shared.partition, {})[rid] = batch_claim(self.deps, agent, rec, lease)
        for p, claims in groups.items():
            ids = list(claims)
            cuts = -(-len(ids) // ADOPT_BATCH)
            for i in range(cuts):
                chunk = {rid: claims[rid] for rid in ids[i::cuts]}
                batch = Batch(self.deps, chunk, passes[p])
                for rid in chunk:
                    del self.claimed[rid]
                    old = self.batches.pop(rid, None)
                    if old is not None:
                        old.drop(rid)
                    self.batches[rid] = batch

    def _adopt_run(self, rid: str, value: str) -> bool:
        """Schedule a dead session's run; whether it was."""
        tenant, _, agent = value.partition("\t")
        if rid in self.active or rid in self.queued or agent not in self.agents:
            return False
        table = self.tables.get(partition_for(rid, self.settings.partitions))
        entry = None if table is None else table.get(rid)
        if entry is None:
            # Its partition is not ours: an ``open`` without an input (it never starts a run
            # that has no events).
            entry = self.adopted[rid] = Entry(Record("open", tenant, agent), -1)
        self._schedule(rid, entry)
        return rid in self.queued

    # Handoffs (a draining worker's runs) ----------------------------------------------------
    def _listen(self) -> None:
        """Pop announcements while this worker takes work (one ``BLPOP`` a second when
        idle; a burst is taken ``HANDOFF_BATCH`` at a time, one round trip each). What is
        popped after the drain began is pushed back for another worker."""
        client = self.deps.redis
        keys = [handoffs.handoffs_key(self.settings), handoffs.coming_key(self.settings)]
        while self._listening.is_set():
            try:
                got = client.blpop(keys, timeout=HANDOFF_WAIT_S)
                key = "" if got is None else _text(got[0])
                more = client.lpop(key, HANDOFF_BATCH - 1) if got is not None else None
            except REDIS_ERRORS as exc:
                log.warning("worker %s: handoffs: %s", self.id, exc)
                time.sleep(HANDOFF_WAIT_S)
                continue
            if got is None:
                continue
            values = [got[1], *(more or [])]
            if not self._listening.is_set() or self.deps.draining.is_set():
                with contextlib.suppress(*REDIS_ERRORS):
                    client.lpush(key, *reversed(values))  # back at the head, in order
                return
            into = self.handoffs if key == keys[0] else self.coming
            for value in values:
                into.put(value if isinstance(value, bytes) else str(value).encode())

    def _warm_coming(self) -> None:
        """Read each partition once for the runs a drain announced as coming, now, while
        their last steps run (in ``_batch_pool``): when their handovers come, in a burst,
        the batches that claim them replay from that pass read on to the partition's end
        (``Prefetch.top_up``), not from a pass of their own each."""
        now = time.monotonic()
        for p in [p for p, (_, at) in self.warm.items() if now - at > WARM_PASS_S]:
            del self.warm[p]
        for p, runs in _parsed(self.coming, handoffs.parse_coming, "runs coming"):
            if not 0 <= p < self.settings.partitions:
                continue
            shared = Prefetch(p, runs, self._reads)
            self.warm[p] = (shared, now)
            deps = self.deps
            self._batch_pool.submit(shared.load, deps.settings, deps.redis, deps.reader_factory)

    def _take_handoffs(self) -> None:
        """Schedule the runs announced handed over, and take them as ``_adopt`` takes a
        dead session's: their (now free) leases in one round trip, one pass over each
        partition, then claimed in batches (``_batch``). A run whose lease is still held
        (its drainer has not let go yet, someone else took it) is opened the usual way."""
        taken: dict[str, str] = {}
        try:
            self._take_handoffs_into(taken)
        finally:
            self._claim_dead(None, taken)
            self._prefetch(taken)
            self._batch(taken)

    def _take_handoffs_into(self, taken: dict[str, str]) -> None:
        for rid, rec in _parsed(self.handoffs, handoffs.parse, "handoff"):
            if rec.input_json is not None or rec.input_sealed is not None:
                continue  # never a start: those come with the partition
            if rid in self.active:
                # A dispatch of it is trying (it may find the lease still held, just before
                # the handover): tried again the moment that one ends (``_settle``).
                self.announced.add(rid)
                continue
            if rid in self.queued:
                # Scheduled already (its ``open`` record, which follows the announcement,
                # came first) and not launched: taken with the others, unless it has its
                # pass or lease already.
                if rid not in self.prefetch and rid not in self.claimed and rid not in self.batches:
                    taken[rid] = rec.tenant
                continue
            if rec.agent not in self.agents:
                continue
            entry = self._entry(rid)
            if entry is None or entry.record is None or entry.record.state != rec.state:
                entry = self.adopted[rid] = Entry(rec, -1)
            self._schedule(rid, entry)
            if rid in self.queued:
                taken[rid] = rec.tenant

    # Presence ----------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        key = workers_key(self.settings, self.id)
        fields: dict[Any, Any] = {
            "id": self.id,
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "since": self.since,
            "runs_held": str(len(self.active)),
            "partitions": ",".join(str(p) for p in sorted(self.tables)),
            "agents": ",".join(sorted(self.agents)),
            "group": lifecycle.group(self.settings),
        }
        try:
            pipe = self.deps.redis.pipeline(transaction=False)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(HEARTBEAT_S * 3 * 1000))
            pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("worker %s could not refresh its presence: %s", self.id, exc)

    # The loop ----------------------------------------------------------------------------
    def _warm(self) -> None:
        """Make what a dispatch needs before the first one waits for it: the schemas' encoders
        and decoders, the agents' event loop and ``OPENING`` readers of the pool, each
        connected to the partitions' leaders, and the process's log tail following every
        partition that fits its window from the beginning (``LogTail.follow_whole``).
        A cold reader's first read costs a connection, metadata and a fetch session (some
        hundred milliseconds, the whole of an idle fleet's first dispatch); a warm one's is
        a fetch. Best effort: a reader that cannot be made now is made by the open that
        needs it, which reports why."""
        registry()  # every schema and its compiled encoder (tens of ms, once a process)
        codec.warm_decoders()  # and decoder: a first takeover decodes every type at once
        if any(agent.is_async for agent in self.agents.values()):
            self._event_loop()
        readers = []
        try:
            for _ in range(OPENING):
                readers.append(self.deps.reader_factory())
            for reader in readers:
                for p in range(reader.partition_count()):
                    reader.high_watermark(p)
            if readers and self.deps.tail is not None:
                # A tail that holds a partition whole tells an open that a requested run
                # has no record yet without the read from the partition's beginning.
                first = readers[0]
                for p in range(first.partition_count()):
                    if first.high_watermark(p) - first.low_watermark(p) <= WINDOW:
                        self.deps.tail.follow_whole(p)
        except Exception as exc:  # noqa: BLE001 - warming is an optimisation
            log.warning("worker %s could not warm its log readers: %s", self.id, exc)
        finally:
            for reader in readers:
                reader.close()

    def stop(self) -> None:
        self._stop.set()

    def run(
        self, *, drain_s: float | None = None, on_ready: Callable[[], None] | None = None
    ) -> None:
        """Dispatch until ``stop``, then drain (``_shutdown``) for at most ``drain_s``
        (default: the ``worker_drain_s`` setting)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(self._consumer_conf(), logger=log)
        self._consumer = consumer
        md = consumer.list_topics(self.lw.topic, timeout=10)
        tmd = md.topics.get(self.lw.topic)
        if tmd is None or tmd.error is not None:
            consumer.close()
            raise ConfigError(f"topic {self.lw.topic} is missing: run `runlog topics create`")
        lifecycle.check_partitions(self.settings, len(tmd.partitions))
        consumer.subscribe(
            [self.lw.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._warm()
        if self.deps.leases.liveness_ttl_ms:
            self._listening.set()
            threading.Thread(target=self._listen, name="runlog-handoffs", daemon=True).start()
        next_beat = next_adopt = 0.0
        if on_ready is not None:
            on_ready()
        try:
            while not self._stop.is_set():
                for msg in consumer.consume(num_messages=500, timeout=0.02):
                    if msg.error() is not None:
                        log.warning("lifecycle consumer: %s", msg.error())
                        continue
                    p, off = msg.partition() or 0, msg.offset() or 0
                    self._apply(p, off, msg.key() or b"", msg.value())
                    if p not in self.caught_up and off + 1 >= self.high.get(p, 0):
                        self._catch_up(p)
                pending = [p for p in self.tables if p not in self.caught_up]
                if pending:
                    tps = consumer.position([TopicPartition(self.lw.topic, p) for p in pending])
                    for tp in tps:
                        if tp.offset >= 0 and tp.offset >= self.high.get(tp.partition, 0):
                            self._catch_up(tp.partition)
                self._reap()
                self._reap_requests()
                self._warm_coming()
                self._take_handoffs()
                self._fire_due()
                self._launch()
                self._serve_requests()
                self._write_held()
                if time.monotonic() >= next_adopt:
                    self._adopt()
                    poll = ADOPT_LATE_POLL_S if self.late else ADOPT_POLL_S
                    next_adopt = time.monotonic() + poll
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + HEARTBEAT_S
        finally:
            self._shutdown(consumer, self.settings.worker_drain_s if drain_s is None else drain_s)

    def _shutdown(self, consumer: Any, drain_s: float) -> None:
        """Drain: take no new work, give the partitions up at once (their timers and starts
        move to the other workers now, not after the drain), let each running run finish
        the step it is in and hand it over (``producers._drain``), then go. A run whose step
        outlasts ``drain_s`` is left to its lease: it is resumed when that expires, its call
        uncertain only if this process is killed before the step completes."""
        self.deps.draining.set()
        self._listening.clear()
        # The sleeps about to end on the partitions given up: woken on time by another
        # worker, not once the group has moved them. (Each run handed over is announced
        # by its dispatch, the moment its lease is free: ``runner._handed_over``.) Read
        # before the consumer closes: its revocation drops the partitions' tables.
        soon = self._soon_due()
        coming: dict[int, dict[str, str]] = {}
        for rid, tenant in self.tenant_of.items():
            coming.setdefault(partition_for(rid, self.settings.partitions), {})[rid] = tenant
        try:
            consumer.close()  # leaves the group: its partitions move at once
        except Exception as exc:  # noqa: BLE001
            log.warning("closing the lifecycle consumer: %s", exc)
        handoffs.announce(self.deps.redis, self.settings, soon)
        # The runs in a step now: another worker reads their partitions while they finish.
        handoffs.announce_coming(self.deps.redis, self.settings, coming)
        self.tables.clear()
        self.caught_up.clear()
        self.heap.clear()
        self.ready.clear()
        self.queued.clear()
        self.adopted.clear()
        self.prefetch.clear()
        self.warm.clear()
        self.announced.clear()
        for lease in list(self.claimed.values()):
            self._release(lease)
        self.claimed.clear()
        for rid, batch in list(self.batches.items()):
            self._release(None, rid, batch)
        self.batches.clear()
        log.info("worker %s draining %d runs (at most %.1f s)", self.id, len(self.active), drain_s)
        deadline = time.monotonic() + drain_s
        while (self.active or self.serving) and time.monotonic() < deadline:
            time.sleep(0.01)
            self._reap()
            self._reap_requests()
            self._write_held()
        if self.active:
            log.warning(
                "worker %s: %d runs still in a step at the drain deadline: %s",
                self.id,
                len(self.active),
                sorted(self.active)[:10],
            )
        with contextlib.suppress(*REDIS_ERRORS):
            self.deps.redis.delete(workers_key(self.settings, self.id))
        self.pool.shutdown(wait=False, cancel_futures=True)
        # Not cancelled: a batch whose runs were launched opens, and its dispatches (an
        # async one awaits it) take their runs and hand them over at their first step.
        self._batch_pool.shutdown(wait=False)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
