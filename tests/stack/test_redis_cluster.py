"""Leases and projections on a real Redis Cluster of three masters (``RUNLOG_REDIS_CLUSTER``).

The cluster is the stack's (``runlog stack up --redis-cluster``), started here if it is not
running: three ``redis-server`` masters on ``RUNLOG_STACK_REDIS_CLUSTER_PORT`` and the two
ports after it. Every check runs with keys spread over all three masters.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
import redis
import redis.cluster
from ci_support import IN_CI
from projections_support import dump

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._index import RunIndex
from runlog.consumers.runner import ProjectionRunner, rebuild
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import InvalidTenant
from runlog.log._clients import redis_client as make_client
from runlog.producers._lease import Held, Lease, LeaseManager
from runlog.schemas._vocabulary import EventType
from runlog.stack import StackConfig
from runlog.stack import _redis_cluster as redis_cluster
from tools.loadgen import LoadGenerator

# Outside CI a machine without Debian's redis-server skips these; under CI=true it must
# not hide a missing service, so the tests run and fail.
pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None and not IN_CI,
    reason="no redis-server",
)


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    """Three local masters for this module, stopped afterwards (nothing left running)."""
    state = StackConfig.from_env().state_dir
    url = redis_cluster.up(state)
    yield url
    Services.close_shared(redis_url=url)  # no lease renewal left retrying a gone cluster
    redis_cluster.down(state)


@pytest.fixture
def on_cluster(test_settings: Settings, cluster_url: str) -> Iterator[Settings]:
    s = test_settings.model_copy(update={"redis_url": cluster_url, "redis_cluster": True})
    yield s
    client = make_client(s)
    for key in list(client.scan_iter(match=f"{s.redis_key_prefix}*", count=1000)):
        client.delete(key)
    client.close()


def _masters(client: redis.Redis, keys: list[str]) -> set[str]:
    cluster = client
    assert isinstance(cluster, redis.cluster.RedisCluster)
    return {cluster.get_node_from_key(k).name for k in keys}


def test_the_client_is_a_cluster_client(on_cluster: Settings) -> None:
    client = make_client(on_cluster)
    assert isinstance(client, redis.cluster.RedisCluster)
    assert len(client.get_primaries()) == 3


def test_leases_on_the_cluster(on_cluster: Settings) -> None:
    client = make_client(on_cluster)
    mgr = LeaseManager(client, key_prefix=on_cluster.redis_key_prefix)
    runs = [f"cluster-lease-{i}" for i in range(12)]
    assert len(_masters(client, [mgr.lease_key("t", r) for r in runs])) == 3
    for r in runs:
        first = mgr.try_acquire("t", r, "a", 5_000, floor=4)
        assert isinstance(first, Lease) and first.epoch == 5
        assert isinstance(mgr.try_acquire("t", r, "b", 5_000), Held)
        assert first.check()
        assert mgr.renew(first)
        assert first.raise_floor(9) == 10 and first.check()
        first.release()
        second = mgr.try_acquire("t", r, "b", 5_000)
        assert isinstance(second, Lease) and second.epoch == 11
        taken = mgr.try_acquire("t", r, "c", 5_000, force=True)
        assert isinstance(taken, Lease) and taken.epoch == 12
        assert not second.check()  # fenced by the takeover
        taken.release()


def test_session_bound_leases_on_the_cluster(on_cluster: Settings) -> None:
    """Leases bound to a process's session, with the liveness key on another master than
    most of the runs: held while the session lives, free (the epoch one up) once it ends,
    and the ex-owner's checks refuse."""
    client = make_client(on_cluster)
    holder = LeaseManager(client, key_prefix=on_cluster.redis_key_prefix, liveness_ttl_ms=1_000)
    taker = LeaseManager(client, key_prefix=on_cluster.redis_key_prefix, liveness_ttl_ms=1_000)
    runs = [f"cluster-session-{i}" for i in range(12)]
    assert len(_masters(client, [holder.lease_key("t", r) for r in runs])) == 3
    try:
        held = [holder.try_acquire("t", r, "a", 60_000) for r in runs]
        assert all(isinstance(x, Lease) for x in held)
        for r, lease in zip(runs, held, strict=True):
            got = taker.try_acquire("t", r, "b", 60_000)
            assert isinstance(got, Held) and got.holder == lease.token  # type: ignore[union-attr]
        holder.close()  # the session ends: its key is deleted
        for r, lease in zip(runs, held, strict=True):
            assert isinstance(lease, Lease) and not lease.check()
            got = taker.try_acquire("t", r, "b", 60_000)
            assert isinstance(got, Lease) and got.epoch == lease.epoch + 1
    finally:
        holder.close()
        taker.close()


def test_renewal_lives_through_a_cluster_outage(on_cluster: Settings) -> None:
    """A cluster client that reaches no node raises an error that is not a ``RedisError``.
    The renewal thread must take it as an outage and go on: with the cluster back after
    longer than the liveness TTL, the lease is known lost (the session's key expired) and
    a taker gets the run one epoch up, instead of a dead thread and a lease that never
    learns it was lost."""
    client = make_client(on_cluster)
    holder = LeaseManager(client, key_prefix=on_cluster.redis_key_prefix, liveness_ttl_ms=1_000)
    state = StackConfig.from_env().state_dir
    try:
        lease = holder.try_acquire("t", "cluster-outage", "a", 60_000)
        assert isinstance(lease, Lease)
        redis_cluster.down(state)
        time.sleep(1.5)  # every renewal in these periods reaches no node
        thread = holder._thread
        assert thread is not None and thread.is_alive()
        redis_cluster.up(state)
        assert not lease.check()
        taker = LeaseManager(
            make_client(on_cluster), key_prefix=on_cluster.redis_key_prefix, liveness_ttl_ms=1_000
        )
        try:
            got = taker.try_acquire("t", "cluster-outage", "b", 60_000)
            assert isinstance(got, Lease) and got.epoch == lease.epoch + 1
        finally:
            taker.close()
    finally:
        redis_cluster.up(state)
        holder.close()


def test_runs_open_append_and_resume_on_the_cluster(on_cluster: Settings) -> None:
    fast = on_cluster.model_copy(update={"lease_ttl_ms": 2_000})
    ids = []
    for _ in range(6):
        with runlog.open_run(None, settings=fast) as run:
            run.append(EventType.USER_MESSAGE, content="hello")
            ids.append(run.run_id)
    for rid in ids:
        with runlog.open_run(rid, settings=fast) as run:
            assert run.epoch == 2 and run.state.resumptions == 1
            run.append(EventType.USER_MESSAGE, content="again")


def test_a_tenant_that_would_break_the_hash_tag_is_refused_by_name(
    on_cluster: Settings,
) -> None:
    """``{tenant:run}`` is the hash tag of a run's keys. A tenant starting with ``}`` would
    make the tag empty (each key in its own slot: the lease script fails on a cross-slot
    error), and a brace anywhere would move the tag. Such a tenant is refused with a
    runlog error naming it, before any Redis key is written; a plain tenant works."""
    client = make_client(on_cluster)
    try:
        for tenant in ("}acme", "ac}me", "{acme", "acme{"):
            with pytest.raises(InvalidTenant) as err:
                runlog.open_run("order-1", tenant=tenant, settings=on_cluster)
            assert isinstance(err.value, ValueError)
            assert repr(tenant) in str(err.value)
        assert list(client.scan_iter(match=f"{on_cluster.redis_key_prefix}*")) == []
    finally:
        client.close()
    with runlog.open_run("order-1", tenant="acme", settings=on_cluster) as run:
        run.append(EventType.USER_MESSAGE, content="hello")


def test_projections_on_the_cluster_equal_a_single_redis(
    on_cluster: Settings, test_settings: Settings, redis_client: redis.Redis
) -> None:
    gen = LoadGenerator(on_cluster, seed=11)
    run_ids = gen.generate(runs=30, events_per_run=40)
    client = make_client(on_cluster)
    runner = ProjectionRunner(on_cluster, client, PROJECTIONS)
    runner.catch_up(timeout_s=120)
    assert runner.stats.applied["state"] == gen.sent
    positions = [h.keys.pos(p) for h in runner.handlers for p in range(on_cluster.partitions)]
    assert len(_masters(client, positions)) > 1  # the partitions' slots span masters

    # The same log into the single Redis: the same keys and bytes.
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=120)
    live = dump(client, on_cluster)
    assert live == dump(redis_client, test_settings)

    # More records through a live group member, then a rebuild from zero: byte-identical.
    sent = gen.sent
    for _ in range(3):
        gen.step(gen.new_run())
    gen.flush()
    member = ProjectionRunner(on_cluster, client, PROJECTIONS, group=f"{on_cluster.topic_prefix}.g")
    deadline = time.monotonic() + 60

    def until_applied(r: ProjectionRunner) -> None:
        if r.stats.applied["state"] >= gen.sent - sent or time.monotonic() > deadline:
            r.stop()

    member.run(on_batch=until_applied)
    assert member.stats.applied["state"] == gen.sent - sent
    before = dump(client, on_cluster)
    rebuild(client, on_cluster, PROJECTIONS)
    assert dump(client, on_cluster) == before
    view = queries.get_state(client, on_cluster, run_ids[0])
    assert view is not None and view["state"]["status"] == "finished"
    assert queries.get_audit(client, on_cluster, run_ids[0])
    assert queries.uncertain_report(client, on_cluster) is not None
    runs = RunIndex(client, on_cluster)
    assert runs.tenants() == ["load"]
    row = runs.find(run_ids[0])
    assert row is not None and row.status == "finished"
    assert len(runs.page(limit=50).rows) == len(run_ids) + 3


def test_the_asyncio_client_on_the_cluster(on_cluster: Settings) -> None:
    import asyncio

    from runlog.log._clients import async_redis_client

    keys = [f"{on_cluster.redis_key_prefix}:{{async-{i}}}:k" for i in range(12)]

    async def roundtrip() -> list[bytes | None]:
        client = async_redis_client(on_cluster)
        try:
            for k in keys:
                await client.set(k, k)
            return [await client.get(k) for k in keys]
        finally:
            await client.aclose()

    assert asyncio.run(roundtrip()) == [k.encode() for k in keys]


def test_notifications_on_the_cluster(on_cluster: Settings) -> None:
    """The notify projection queues in its position's transaction and the delivery loop
    claims with scripts: every key of one partition in one slot, partitions over masters."""
    from runlog.consumers._notify import Notifier
    from runlog.consumers.stores import NOTIFY

    client = make_client(on_cluster)
    asked = set()
    for i in range(6):
        with runlog.open_run(None, tenant="t", settings=on_cluster) as run:
            asked.add(run.request_approval(f"ask {i}", deadline_s=3600))
    ProjectionRunner(on_cluster, client, [NOTIFY]).catch_up(timeout_s=120)
    got: list[str] = []
    notifier = Notifier(client, on_cluster, lambda n: got.append(n["approval_id"]))
    deadline = time.monotonic() + 30
    while len(got) < len(asked):
        assert time.monotonic() < deadline, got
        notifier.deliver_due()
    rebuild(client, on_cluster, [NOTIFY])
    notifier.deliver_due()
    assert sorted(got) == sorted(asked)
    rep = queries.approvals_report(client, on_cluster)
    assert {a["approval_id"] for a in rep.pending} == asked
    assert {a["notification"]["status"] for a in rep.pending} == {"delivered"}
    handler = ProjectionRunner(on_cluster, client, [NOTIFY]).handlers[0]
    outboxes = [handler.keys.outbox(p) for p in range(on_cluster.partitions)]
    assert len(_masters(client, outboxes)) > 1
