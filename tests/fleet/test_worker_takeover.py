"""What a worker does when runs come to it from another worker: a dead worker's runs are
adopted with their leases taken in one round trip (``LeaseManager.acquire_dead``); a
partition it takes over does not dispatch the runs a live worker still holds (they come
by handover), and a handover announced while a dispatch of the run is trying is
dispatched the moment that one ends. Real Redis; the workers are not started (no group)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from workers.session_holder import Holder

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.fleet._handoffs import announce
from runlog.fleet._lifecycle import Record
from runlog.fleet._registry import Agent
from runlog.fleet._runner import Result
from runlog.fleet._worker import LATE_GRACE_S, Entry, Worker, held_key
from runlog.producers._lease import BURY_BELOW, Lease, LeaseManager, sessions_key
from runlog.schemas._keys import lease_key, live_key, partition_for, session_of

pytestmark = pytest.mark.timeout(60)


def _noop(run: object, order: object) -> None:
    return None


@pytest.fixture
def worker(test_settings: Settings) -> Iterator[Worker]:
    svc = Services(test_settings)
    w = Worker(test_settings, svc.run_deps(), {"payer": Agent("payer", _noop)}, worker_id="w")
    try:
        yield w
    finally:
        w._listening.clear()
        for lease in w.claimed.values():
            lease.release()
        for rid, batch in w.batches.items():
            batch.drop(rid)
        svc.close()


@pytest.fixture
def other(test_settings: Settings, worker: Worker) -> Iterator[LeaseManager]:
    """Another process's leases (a session of its own)."""
    mgr = LeaseManager(
        worker.deps.redis, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=60_000
    )
    yield mgr
    mgr.close()


def _runs(n: int) -> list[str]:
    return [f"r-{uuid.uuid4().hex[:10]}" for _ in range(n)]


def _table(w: Worker, rids: list[str], offset: int = 5) -> set[int]:
    """Records ``open`` for ``rids`` in the worker's tables, as a partition's read gives."""
    parts = set()
    for rid in rids:
        p = partition_for(rid, w.settings.partitions)
        w.tables.setdefault(p, {})[rid] = Entry(Record("open", "t1", "payer"), offset)
        parts.add(p)
    return parts


def _taken(w: Worker) -> dict[str, Lease]:
    """The leases the worker took for adopted runs: alone, or in a batch of runs."""
    return {**w.claimed, **{rid: b.leases()[rid] for rid, b in w.batches.items()}}


def _pop_handoffs(w: Worker) -> None:
    w._listening.set()
    listener = threading.Thread(target=w._listen, daemon=True)
    listener.start()
    deadline = time.monotonic() + 10
    while w.handoffs.empty():
        assert time.monotonic() < deadline, "nothing popped"
        time.sleep(0.01)
    w._listening.clear()
    w._take_handoffs()


def test_a_taken_partition_dispatches_no_run_a_live_worker_holds_until_it_is_handed_over(
    worker: Worker, other: LeaseManager, test_settings: Settings
) -> None:
    held, free, orphan = _runs(3)
    mine = other.try_acquire("t1", held, "o", 60_000)
    assert isinstance(mine, Lease)
    gone = LeaseManager(
        worker.deps.redis, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=60_000
    )
    assert isinstance(gone.try_acquire("t1", orphan, "g", 60_000), Lease)
    worker.deps.redis.delete(live_key(test_settings.redis_key_prefix, gone.session_id()))
    try:
        for p in _table(worker, [held, free, orphan]):
            worker._catch_up(p)
        assert set(worker.ready) == {free, orphan}  # the orphan's holder is dead
        ((due, _, rid),) = worker.heap
        assert rid == held and due - time.monotonic() >= test_settings.lease_ttl_ms / 1000 - 1
        # Its holder lets it go: the announcement dispatches it now, not at the retry.
        other.hand_over(mine)
        announce(worker.deps.redis, test_settings, [(held, Record("open", "t1", "payer"))])
        _pop_handoffs(worker)
        assert held in worker.ready
    finally:
        gone.close()


def test_a_handover_announced_while_a_dispatch_tries_the_run_is_dispatched_when_it_ends(
    worker: Worker, test_settings: Settings
) -> None:
    (rid,) = _runs(1)
    _table(worker, [rid])
    worker.active[rid] = Future()  # a dispatch that will find the lease still held
    worker.launched[rid] = 5
    announce(worker.deps.redis, test_settings, [(rid, Record("open", "t1", "payer"))])
    _pop_handoffs(worker)
    assert rid not in worker.ready
    del worker.active[rid]
    worker._settle(rid, Result("locked", retry_s=15.0, why="held"), worker.launched.pop(rid))
    assert list(worker.ready) == [rid] and not worker.heap


def test_a_dead_workers_runs_are_adopted_with_their_leases_taken_at_once(
    worker: Worker, test_settings: Settings
) -> None:
    """A session that dies holding runs: the adopter takes every lease at the next epoch
    before any dispatch, except one taken by a live worker meanwhile (its open finds it)."""
    prefix = test_settings.redis_key_prefix
    client = worker.deps.redis
    dead = LeaseManager(client, key_prefix=prefix, liveness_ttl_ms=60_000)
    live = LeaseManager(client, key_prefix=prefix, liveness_ttl_ms=60_000)
    try:
        runs = _runs(40)
        old = {r: dead.try_acquire("t1", r, "d", 60_000) for r in runs}
        sid = dead.session_id()
        client.hset(held_key(test_settings, sid), mapping={r: "t1\tpayer" for r in runs})
        client.delete(live_key(prefix, sid))
        taken_meanwhile = live.try_acquire("t1", runs[0], "l", 60_000)
        assert isinstance(taken_meanwhile, Lease)
        worker._adopt()
        assert set(worker.ready) == set(runs)
        # The runs with a slot at once (concurrency 8) are claimed together (``Batch``),
        # the others one by one as they launch: every lease is taken now.
        first = set(list(worker.ready)[: worker.concurrency])
        assert set(worker.batches) == first - {runs[0]}  # runs[0] is held: no lease taken
        assert set(_taken(worker)) == set(runs[1:])
        for rid, lease in _taken(worker).items():
            before = old[rid]
            assert isinstance(before, Lease)
            assert lease.epoch == before.epoch + 1 and lease.check() and not before.check()
        assert taken_meanwhile.check()
        assert not client.hexists(sessions_key(prefix), sid)
        assert not client.exists(held_key(test_settings, sid))
    finally:
        dead.close()
        live.close()


def test_a_killed_workers_runs_are_adopted_before_its_session_key_expires(
    worker: Worker, test_settings: Settings
) -> None:
    """A process holding runs is SIGKILLed (its subscription to its session ends with its
    sockets): the worker's looks see the session late, wait ``LATE_GRACE_S``, bury it
    while its key would still live, and adopt the runs at the next epoch. Without the
    burial the key would only go at expiry (6 s here), which the loop below fails on."""
    prefix = test_settings.redis_key_prefix
    client = worker.deps.redis
    liveness = 6000
    runs = _runs(5)
    holder = Holder(test_settings, runs, liveness)
    try:
        value = client.get(lease_key(prefix, "t", runs[0]))
        sid = session_of(value.decode())
        assert sid is not None
        client.hset(held_key(test_settings, sid), mapping={r: "t\tpayer" for r in runs})
        key = live_key(prefix, sid)
        worker._adopt()
        assert not worker.ready and not worker.late  # alive
        holder.proc.kill()
        holder.proc.wait(10)
        seen_late, left = 0.0, -2
        while not worker.ready:
            left = int(client.pttl(key))
            assert left != -2 or worker.ready, "the key expired before anyone buried it"
            worker._adopt()
            if worker.late and not seen_late:
                seen_late = time.monotonic()
            time.sleep(0.05)
        assert time.monotonic() - seen_late >= LATE_GRACE_S
        assert 0 < left < liveness * BURY_BELOW  # buried while it would still have lived
        assert not client.exists(key)
        assert set(worker.ready) == set(runs) == set(_taken(worker))
        for rid, epoch in zip(runs, holder.epochs, strict=True):
            assert _taken(worker)[rid].epoch == epoch + 1
    finally:
        holder.stop()
