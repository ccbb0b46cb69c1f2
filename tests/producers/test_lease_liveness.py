"""Run leases bound to their process's session: one liveness key per process, renewed by
the process, whatever the number of its runs; a run lease is free once that key is gone;
the per-run fencing token is unchanged, and a paused ex-owner is refused."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from workers.session_holder import LIVENESS_MS, Holder

from runlog._settings import Settings
from runlog.log._clients import SYNC_CONNECTIONS
from runlog.log._clients import redis_client as make_client
from runlog.log._holders import holder
from runlog.producers import _lease as lease_mod
from runlog.producers._lease import Held, Lease, LeaseManager
from runlog.projections._run_state import RunState
from runlog.projections._state_view import run_status
from runlog.schemas._keys import live_key, session_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def manager(test_settings: Settings, redis_client: redis.Redis) -> Iterator[LeaseManager]:
    mgr = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    yield mgr
    mgr.close()


def _wait_gone(client: redis.Redis, key: str) -> None:
    deadline = time.monotonic() + 10 * LIVENESS_MS / 1000
    while client.exists(key):
        assert time.monotonic() < deadline, f"{key} outlived its TTL"
        time.sleep(0.05)


def test_a_live_session_holds_its_runs_without_renewing_them_one_by_one(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """200 leases held through three liveness TTLs: none is renewed on its own (the
    renewals are the session's), and every one is still held: another manager is told
    whose it is and for how long its session lives without renewal."""
    runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(200)]
    leases = [manager.try_acquire("t", r, "a", 60_000) for r in runs]
    assert all(isinstance(x, Lease) for x in leases)
    per_run, sessions = lease_mod.METRICS["renewed"], lease_mod.METRICS["liveness_renewed"]
    time.sleep(3 * LIVENESS_MS / 1000)
    assert lease_mod.METRICS["renewed"] == per_run  # no run lease renewed on its own
    assert lease_mod.METRICS["liveness_renewed"] > sessions
    other = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    try:
        for rid, mine in zip(runs, leases, strict=True):
            assert isinstance(mine, Lease) and mine.check()
            held = other.try_acquire("t", rid, "b", 60_000)
            assert isinstance(held, Held), held
            assert held.holder == mine.token and 0 < held.ttl_ms <= LIVENESS_MS
            assert session_of(held.holder) == manager.session_id()
    finally:
        other.close()


def test_a_killed_holders_runs_are_free_once_its_session_key_is_gone(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    holder = Holder(test_settings, runs)
    try:
        value = redis_client.get(manager.lease_key("t", runs[0]))
        assert value is not None and redis_client.pttl(manager.lease_key("t", runs[0])) == -1
        sid = session_of(value.decode())
        assert sid is not None
        assert all(isinstance(manager.try_acquire("t", r, "b", 60_000), Held) for r in runs)
        holder.proc.kill()
        _wait_gone(redis_client, live_key(test_settings.redis_key_prefix, sid))
        for rid, epoch in zip(runs, holder.epochs, strict=True):
            got = manager.try_acquire("t", rid, "b", 60_000)
            assert isinstance(got, Lease), got
            assert got.epoch == epoch + 1  # the fencing token goes up as on any takeover
            assert got.handed_over_by is None  # an orphan, not a handover
    finally:
        holder.stop()


def test_a_killed_holders_session_is_buried_before_its_key_expires(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A process that died (its sockets closed) no longer subscribes to its session:
    once its key has less than ``BURY_BELOW`` of its TTL left (it missed its renewals, and
    its own deadline, ``SESSION_TRUST``, ended before) and nobody watches its channel any
    more, another process deletes the key
    and takes the runs, epoch bumped, without waiting for the expiry."""
    liveness = 6000
    manager = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=liveness
    )
    runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    holder = Holder(test_settings, runs, liveness)
    try:
        sid = session_of(redis_client.get(manager.lease_key("t", runs[0])).decode())
        assert sid is not None
        key = live_key(test_settings.redis_key_prefix, sid)
        channel = live_key(test_settings.redis_key_prefix, sid)
        assert redis_client.pubsub_numsub(channel) == [(channel.encode(), 1)]  # watched
        assert manager.bury([sid]) == []  # alive: its key is fresh
        holder.proc.kill()
        holder.proc.wait(10)
        left = []
        got: Lease | Held = Held("", 0)
        while not isinstance(got, Lease):
            left.append(int(redis_client.pttl(key)))
            assert left[-1] != -2, "the key expired before anyone buried it"
            if manager.bury([sid]):
                got = manager.try_acquire("t", runs[0], "b", 60_000)
                assert isinstance(got, Lease), got
            time.sleep(0.05)
        # Buried while its key would still have lived, once under the share it may be.
        assert 0 < left[-1] < liveness * lease_mod.BURY_BELOW
        assert not redis_client.exists(key)
        assert got.epoch == holder.epochs[0] + 1 and got.handed_over_by is None
        for rid, epoch in zip(runs[1:], holder.epochs[1:], strict=True):
            other = manager.try_acquire("t", rid, "b", 60_000)
            assert isinstance(other, Lease) and other.epoch == epoch + 1
    finally:
        holder.stop()
        manager.close()


def test_a_paused_or_unwatched_session_is_never_buried(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A process that is paused (or slow, or cut off by a network that did not close its
    sockets) still holds its subscription: it is not buried however late its renewals are,
    and comes back to its runs if it returns before the key expires. A session whose key does
    not say it is watched (an older version's) only expires."""
    liveness = 4000
    manager = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=liveness
    )
    run = f"run-{uuid.uuid4().hex[:8]}"
    holder = Holder(test_settings, [run], liveness)
    try:
        sid = session_of(redis_client.get(manager.lease_key("t", run)).decode())
        assert sid is not None
        key = live_key(test_settings.redis_key_prefix, sid)
        holder.proc.send_signal(signal.SIGSTOP)
        while int(redis_client.pttl(key)) > liveness * lease_mod.BURY_BELOW - 500:
            time.sleep(0.05)
        for _ in range(5):
            assert manager.bury([sid]) == []
            assert isinstance(manager.try_acquire("t", run, "b", 60_000), Held)
        assert redis_client.exists(key)
        holder.proc.send_signal(signal.SIGCONT)
        assert holder.check() == [True]  # back before the expiry: still the owner
        old = f"{test_settings.redis_key_prefix}:live:old{uuid.uuid4().hex[:8]}"
        redis_client.set(old, "w|h|1", px=1000)
        assert manager.bury([old.rsplit(":", 1)[1]]) == []
        assert redis_client.exists(old)
    finally:
        holder.stop()
        manager.close()


def test_a_paused_ex_owner_is_refused_whether_or_not_its_runs_were_taken(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """SIGSTOP the holder past its liveness TTL. One run is taken by another owner meanwhile,
    the other is not taken by anyone: after SIGCONT the ex-owner's checks refuse both (a
    session once gone is never renewed again, so the untaken lease is not its any more)."""
    taken, untaken = f"run-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    holder = Holder(test_settings, [taken, untaken])
    try:
        assert holder.check() == [True, True]
        sid = session_of(redis_client.get(manager.lease_key("t", taken)).decode())
        assert sid is not None
        holder.proc.send_signal(signal.SIGSTOP)
        _wait_gone(redis_client, live_key(test_settings.redis_key_prefix, sid))
        got = manager.try_acquire("t", taken, "b", 60_000)
        assert isinstance(got, Lease) and got.epoch == holder.epochs[0] + 1
        holder.proc.send_signal(signal.SIGCONT)
        assert holder.check() == [False, False]
        # Its session stays dead: the untaken lease is free for the next owner.
        assert not redis_client.exists(live_key(test_settings.redis_key_prefix, sid))
        assert isinstance(manager.try_acquire("t", untaken, "c", 60_000), Lease)
    finally:
        holder.stop()


def test_a_handover_is_seen_by_the_next_owner(
    manager: LeaseManager, redis_client: redis.Redis, test_settings: Settings
) -> None:
    rid = f"run-{uuid.uuid4().hex[:8]}"
    first = manager.try_acquire("t", rid, "a", 60_000)
    assert isinstance(first, Lease)
    manager.hand_over(first)
    assert not first.check()
    nxt = manager.try_acquire("t", rid, "b", 60_000)
    assert isinstance(nxt, Lease)
    assert nxt.handed_over_by == first.token and nxt.epoch == first.epoch + 1
    nxt.release()
    again = manager.try_acquire("t", rid, "c", 60_000)
    assert isinstance(again, Lease) and again.handed_over_by is None  # a plain release


def test_a_clean_exit_frees_the_session_at_once(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    mgr = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=60_000
    )
    rid = f"run-{uuid.uuid4().hex[:8]}"
    held: Any = mgr.try_acquire("t", rid, "a", 60_000)
    assert isinstance(held, Lease)
    mgr.close()
    other = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    try:
        got = other.try_acquire("t", rid, "b", 60_000)
        assert isinstance(got, Lease) and got.epoch == held.epoch + 1
    finally:
        other.close()


def test_status_names_a_dead_workers_lease_and_a_handover(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """What `runlog runs`/`show`/`--json` and the console are told (the one rule, with the
    lease read now): a run held by a live worker is running; once the worker is SIGKILLed
    and its session's key is gone, it is orphaned and names the lease's dead holder; a run
    its worker let go while draining is orphaned and names who handed it over."""
    dead, handed = f"run-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    st = {rid: RunState(run_id=rid, tenant="t", status="running") for rid in (dead, handed)}
    proc = Holder(test_settings, [dead])
    try:
        told = run_status(st[dead], holder(redis_client, test_settings, "t", dead))
        assert told.status == "running" and told.owner_alive
        sid = session_of(redis_client.get(manager.lease_key("t", dead)).decode())
        proc.proc.kill()
        _wait_gone(redis_client, live_key(test_settings.redis_key_prefix, str(sid)))
        told = run_status(st[dead], holder(redis_client, test_settings, "t", dead))
        assert told.status == "orphaned" and not told.owner_alive
        assert told.owner is not None and told.owner.startswith(f"holder-{proc.proc.pid}")
        assert told.to_dict()["owner_alive"] is False
        assert f"lease held by holder-{proc.proc.pid}" in told.text()
    finally:
        proc.stop()
    mine = manager.try_acquire("t", handed, "drainer", 60_000)
    assert isinstance(mine, Lease)
    manager.hand_over(mine)
    told = run_status(st[handed], holder(redis_client, test_settings, "t", handed))
    assert told.status == "orphaned" and told.handed_over_by == "drainer"
    assert told.to_dict()["handed_over_by"] == "drainer" and "handed over by drainer" in told.text()


def _dead(client: redis.Redis, settings: Settings, mgr: LeaseManager) -> str:
    """End ``mgr``'s session as a SIGKILL does: its liveness key goes, nothing else."""
    sid = mgr.session_id()
    client.delete(live_key(settings.redis_key_prefix, sid))
    return sid


def test_a_dead_sessions_runs_are_taken_in_batches_each_as_strictly_as_one_by_one(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """``acquire_dead`` over more runs than one batch: every run the dead session held,
    or that is free, is taken at an epoch above its counter (one bump each, a handover
    note read); a run someone else holds (a live session, a lease with a TTL of its own)
    is left to its holder; the ex-owner is refused on every run; while the session lives
    nothing at all is taken."""
    prefix = test_settings.redis_key_prefix
    dead = LeaseManager(redis_client, key_prefix=prefix, liveness_ttl_ms=60_000)
    live = LeaseManager(redis_client, key_prefix=prefix, liveness_ttl_ms=60_000)
    ttl_only = LeaseManager(redis_client, key_prefix=prefix)
    try:
        runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(lease_mod.ACQUIRE_DEAD_BATCH + 44)]
        old = {r: dead.try_acquire("t", r, "a", 60_000) for r in runs}
        assert all(isinstance(x, Lease) for x in old.values())
        held_live, held_ttl, released, raised, handed = runs[:5]
        old[released].release()
        dead.hand_over(old[handed])  # type: ignore[arg-type]
        redis_client.set(manager.epoch_key("t", raised), 1000)
        assert manager.acquire_dead(dead.session_id(), [("t", r) for r in runs], "b", 60_000) == {}
        assert all(x.check() for r, x in old.items() if r not in (released, handed))  # type: ignore[union-attr]

        sid = _dead(redis_client, test_settings, dead)
        theirs = live.try_acquire("t", held_live, "c", 60_000)
        assert isinstance(theirs, Lease)
        redis_client.delete(manager.lease_key("t", held_ttl))
        ttl_lease = ttl_only.try_acquire("t", held_ttl, "d", 60_000)
        assert isinstance(ttl_lease, Lease)

        got = manager.acquire_dead(sid, [("t", r) for r in runs], "b", 60_000)
        assert set(got) == set(runs) - {held_live, held_ttl}
        for rid, lease in got.items():
            before = old[rid]
            assert isinstance(before, Lease)
            want = 1001 if rid == raised else before.epoch + 1
            assert lease.epoch == want, rid
            assert int(redis_client.get(manager.epoch_key("t", rid))) == want
            assert redis_client.get(manager.lease_key("t", rid)).decode() == lease.token
            assert session_of(lease.token) == manager.session_id()
            assert lease.check()
            assert lease.handed_over_by == (before.token if rid == handed else None)
            assert not before.check()  # the ex-owner is fenced
        assert theirs.check() and ttl_lease.check()  # left to their holders, epochs untouched
        assert int(redis_client.get(manager.epoch_key("t", held_live))) == theirs.epoch
    finally:
        for mgr in (dead, live, ttl_only):
            mgr.close()


def test_a_batch_take_raced_against_single_takes_gives_each_run_one_owner(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A batch taker and four one-by-one takers (sessions of their own) go at once, from
    a barrier, for the runs of a dead session: each run has exactly one new owner, its
    epoch bumped exactly once, and the lease in Redis is that owner's."""
    prefix = test_settings.redis_key_prefix
    dead = LeaseManager(redis_client, key_prefix=prefix, liveness_ttl_ms=60_000)
    singles = [
        LeaseManager(redis_client, key_prefix=prefix, liveness_ttl_ms=60_000) for _ in range(4)
    ]
    try:
        runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(120)]
        old = {r: dead.try_acquire("t", r, "a", 60_000) for r in runs}
        sid = _dead(redis_client, test_settings, dead)
        for mgr in (manager, *singles):
            mgr.session_id()  # sessions made before the race
        barrier = threading.Barrier(1 + len(singles))
        won: dict[str, list[Lease]] = {r: [] for r in runs}
        lock = threading.Lock()

        def batch() -> None:
            barrier.wait()
            got = manager.acquire_dead(sid, [("t", r) for r in runs], "b", 60_000)
            with lock:
                for rid, lease in got.items():
                    won[rid].append(lease)

        def single(mgr: LeaseManager, order: list[str]) -> None:
            barrier.wait()
            for rid in order:
                got = mgr.try_acquire("t", rid, "s", 60_000)
                if isinstance(got, Lease):
                    with lock:
                        won[rid].append(got)

        threads = [threading.Thread(target=batch)]
        for i, mgr in enumerate(singles):
            order = runs[i::2] + runs[(i + 1) % 2 :: 2]
            threads.append(threading.Thread(target=single, args=(mgr, order)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for rid in runs:
            assert len(won[rid]) == 1, (rid, won[rid])
            (winner,) = won[rid]
            before = old[rid]
            assert isinstance(before, Lease)
            assert winner.epoch == before.epoch + 1
            assert int(redis_client.get(manager.epoch_key("t", rid))) == before.epoch + 1
            assert redis_client.get(manager.lease_key("t", rid)).decode() == winner.token
    finally:
        for mgr in (dead, *singles):
            mgr.close()


def test_the_session_is_renewed_while_every_connection_of_the_process_pool_is_out(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A burst of work (hundreds of threads opening runs) can hold every connection of the
    process's Redis pool for longer than a liveness TTL. The renewer must not wait behind
    it: if it did, the liveness key would expire and every lease of the process with it."""
    client = make_client(test_settings)
    mgr = LeaseManager(
        client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    try:
        lease = mgr.try_acquire("t", f"busy-pool-{uuid.uuid4().hex[:8]}", "a", 60_000)
        assert isinstance(lease, Lease)
        key = live_key(test_settings.redis_key_prefix, mgr.session_id())
        pool = client.connection_pool
        held = [pool.get_connection() for _ in range(SYNC_CONNECTIONS)]
        try:
            for _ in range(3 * LIVENESS_MS // 100):  # three TTLs with the pool empty
                assert redis_client.exists(key), "the liveness key expired"
                time.sleep(0.1)
        finally:
            for conn in held:
                pool.release(conn)
        assert not lease.lost and mgr.renew(lease), "the lease went with the session"
    finally:
        mgr.close()
        client.close()


def _renewers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "runlog-lease" and t.is_alive()}


class _SlowStart(threading.Thread):
    """A thread that takes 20 ms to start, as on a loaded machine: the window in which
    another caller still sees no renewer."""

    def start(self) -> None:
        time.sleep(0.02)
        super().start()


def test_a_burst_of_first_acquires_starts_one_renewer_and_close_stops_it(
    test_settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads acquiring runs at once on a manager with no session yet (a worker's start)
    share one session and one renewer thread: each that saw none started its own, and
    close() stopped only the last."""
    monkeypatch.setattr(lease_mod.threading, "Thread", _SlowStart)
    before = _renewers()
    mgr = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    threads, gate = 16, threading.Barrier(16)
    got: list[Any] = []

    def take(i: int) -> None:
        gate.wait()
        got.append(mgr.try_acquire("t", f"burst-{uuid.uuid4().hex[:8]}-{i}", "a", 60_000))

    workers = [threading.Thread(target=take, args=(i,)) for i in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len(got) == threads and all(isinstance(x, Lease) for x in got)
        assert len({session_of(x.token) for x in got}) == 1  # one session for the process
        assert len(_renewers() - before) == 1
    finally:
        mgr.close()
    assert not _renewers() - before, "a renewer outlived its manager"
