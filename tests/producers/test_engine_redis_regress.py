"""Redis going back in time must not let a stale owner start an effect.

Owner B takes the run over (epoch 2, RUN_RESUMED acknowledged); then Redis loses that:
it restarts from an AOF missing its last second, or fails over to a replica that never saw
the takeover. Here that is done for real on the test's Redis: the lease and epoch keys are
DUMPed before the takeover and RESTOREd after it. A's Redis checks now pass, but every
reader excludes A's records as fenced, so A must not reach a non-safe tool.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from workers.common import assert_log_sound, read_log, services_for, verdicts

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._handle import engine_of
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slow_lease(test_settings: Settings) -> Iterator[Settings]:
    """A long TTL: no renewal runs during the test, so only the restored keys speak."""
    s = test_settings.model_copy(update={"lease_ttl_ms": 30_000})
    with services_for(s):
        yield s


def test_a_stale_owner_never_reaches_a_tool_after_redis_lost_the_takeover(
    slow_lease: Settings, redis_client: redis.Redis
) -> None:
    invoked: list[str] = []

    def effect(args: dict[str, Any], *, idempotency_key: str) -> str:
        invoked.append(idempotency_key)
        return "paid"

    pay = runlog.tool("pay", risk="irreversible")(effect)
    a = runlog.open_run(settings=slow_lease, tools=[pay])
    rid = a.run_id
    leases = Services.shared(slow_lease).leases
    keys = [leases.lease_key(a.tenant, rid), leases.epoch_key(a.tenant, rid)]
    before = [(k, redis_client.dump(k), redis_client.pttl(k)) for k in keys]

    b = runlog.open_run(rid, settings=slow_lease, tools=[pay], takeover=True)
    assert b.epoch == 2 and b.state.epoch == 2
    for k, blob, ttl in before:  # Redis forgets the takeover
        assert blob is not None
        redis_client.restore(k, max(ttl, 0), blob, replace=True)
    assert engine_of(a).lease.check(), "Redis should now vouch for the stale owner A"

    with pytest.raises(runlog.Fenced):
        a.call_tool("pay", {"amount": 7})
    assert invoked == [], "a stale owner invoked an irreversible tool"
    a.close()
    b.close()

    events = [r.event for r in read_log(slow_lease, rid)]
    assert_log_sound(events)
    stale = [ev for ev, ok in verdicts(events) if not ok]
    assert [ev.type for ev in stale] == [EventType.TOOL_CALL_STARTED]
    assert stale[0].epoch == 1
