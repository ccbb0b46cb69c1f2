"""Who holds a run's lease now, read from the leases in Redis (``runlog.log._holders``):
the live half of a run's status, for many runs in one pipelined read."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis

from runlog._settings import Settings
from runlog.errors import RedisUnavailable
from runlog.log._holders import holder, holders, status_now
from runlog.producers._lease import Lease, LeaseManager
from runlog.projections._run_state import RunState
from runlog.schemas._keys import live_key

pytestmark = pytest.mark.timeout(60)

LIVENESS_MS = 5_000
"""Leases bound to the manager's session, as a worker's are."""


@pytest.fixture
def manager(test_settings: Settings, redis_client: redis.Redis) -> Iterator[LeaseManager]:
    mgr = LeaseManager(
        redis_client, key_prefix=test_settings.redis_key_prefix, liveness_ttl_ms=LIVENESS_MS
    )
    yield mgr
    mgr.close()


def _run() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


def _take(manager: LeaseManager, tenant: str, run_id: str, owner: str) -> Lease:
    lease = manager.try_acquire(tenant, run_id, owner, 30_000)
    assert isinstance(lease, Lease), lease
    return lease


def test_each_run_gets_its_own_holder_or_none_in_one_read(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """Held runs name their owner and epoch, a free run is None; the same run id under two
    tenants is two runs."""
    held = [_run() for _ in range(5)]
    free = _run()
    leases = {r: _take(manager, "acme", r, f"worker-{i}") for i, r in enumerate(held)}
    other_tenant = _take(manager, "globex", free, "worker-g")
    before = datetime.now(UTC)
    got = holders(
        redis_client, test_settings, [("acme", r) for r in held] + [("acme", free), ("acme", free)]
    )
    assert set(got) == {("acme", r) for r in held} | {("acme", free)}  # asked twice, one answer
    assert got[("acme", free)] is None
    for i, r in enumerate(held):
        h = got[("acme", r)]
        assert h is not None
        assert (h.owner, h.epoch, h.alive) == (f"worker-{i}", leases[r].epoch, True)
        assert h.handed_over_by is None
        assert before < h.expires_at <= datetime.now(UTC) + timedelta(minutes=5)
    g = holder(redis_client, test_settings, "globex", free)
    assert g is not None and (g.owner, g.epoch) == ("worker-g", other_tenant.epoch)
    assert holders(redis_client, test_settings, []) == {}


def test_a_released_run_is_held_by_nobody(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    run_id = _run()
    lease = _take(manager, "acme", run_id, "worker-a")
    assert holder(redis_client, test_settings, "acme", run_id) is not None
    manager.release(lease)
    assert holder(redis_client, test_settings, "acme", run_id) is None


def test_a_lease_whose_session_is_gone_names_a_dead_owner(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """The lease key is still there, but the session it is bound to died (its liveness key
    expired): the holder is told, not alive, so the run is an orphan free to take."""
    run_id = _run()
    lease = _take(manager, "acme", run_id, "worker-a")
    sid = manager.session_id()
    redis_client.delete(live_key(test_settings.redis_key_prefix, sid))
    h = holder(redis_client, test_settings, "acme", run_id)
    assert h is not None
    assert (h.owner, h.epoch, h.alive) == ("worker-a", lease.epoch, False)
    st = RunState(run_id=run_id, tenant="acme", status="running", seq=3)
    told = status_now(redis_client, test_settings, st)
    assert told.status == "orphaned" and told.owner_alive is False


def test_a_run_let_go_by_a_drain_names_who_let_it_go(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    run_id = _run()
    lease = _take(manager, "acme", run_id, "worker-draining")
    manager.hand_over(lease)
    h = holder(redis_client, test_settings, "acme", run_id)
    assert h is not None
    assert h.handed_over_by == "worker-draining" and h.owner == ""
    st = RunState(run_id=run_id, tenant="acme", status="running", seq=3)
    told = status_now(redis_client, test_settings, st)
    assert told.status == "orphaned" and told.handed_over_by == "worker-draining"


def test_a_finished_run_is_not_asked_about(
    manager: LeaseManager, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A finished run's status is the log's alone: a lease still held under its id (a
    writer that has not let go yet) does not make it running."""
    run_id = _run()
    _take(manager, "acme", run_id, "worker-a")
    st = RunState(run_id=run_id, tenant="acme", status="finished", seq=9, outcome="done")
    assert status_now(redis_client, test_settings, st).status == "finished"


def test_redis_down_is_redis_unavailable_naming_what_was_read(test_settings: Settings) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    with pytest.raises(RedisUnavailable, match="run leases"):
        holders(dead, test_settings, [("acme", _run())])
