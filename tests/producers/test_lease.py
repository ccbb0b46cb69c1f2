"""The lease itself: epochs above the log's floor, and renewals racing an epoch raise."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from runlog._settings import Settings
from runlog.producers import _lease as lease_mod
from runlog.producers._handle import engine_of
from runlog.producers._lease import Held, Lease, LeaseManager

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def manager(test_settings: Settings, redis_client: redis.Redis) -> Any:
    mgr = LeaseManager(redis_client, key_prefix=test_settings.redis_key_prefix)
    yield mgr
    mgr.close()


def test_epochs_go_above_the_floor_and_the_holder_excludes_others(manager: LeaseManager) -> None:
    first = manager.try_acquire("acme", "run-1", "a", 1500)
    assert isinstance(first, Lease) and first.epoch == 1
    held = manager.try_acquire("acme", "run-1", "b", 1500)
    assert isinstance(held, Held) and held.holder == "a|1" and 0 < held.ttl_ms <= 1500
    assert first.raise_floor(41) == 42 and first.check()
    first.release()
    second = manager.try_acquire("acme", "run-1", "b", 1500)
    assert isinstance(second, Lease) and second.epoch == 43  # never back to the counter
    assert not first.check()  # the old token is not current any more
    second.release()


def test_a_renewal_right_after_an_epoch_raise_keeps_the_lease(
    manager: LeaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the renewer ran between Redis taking the new epoch and the lease object
    learning it, sent the old token, was refused, and marked a healthy lease lost."""
    got = manager.try_acquire("acme", "run-2", "a", 1500)
    assert isinstance(got, Lease)
    lease = got
    real_log = lease_mod.log

    class RenewInTheWindow:
        """Stands in for the module logger; renews at the first point after the lock."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real_log, name)

        def info(self, msg: str, *args: Any) -> None:
            if msg.startswith("epoch raised"):
                manager.renew(lease)
            real_log.info(msg, *args)

    monkeypatch.setattr(lease_mod, "log", RenewInTheWindow())
    assert lease.raise_floor(9) == 10
    assert not lease.lost and lease.check()
    assert manager.renew(lease)
    lease.release()


def test_ownership_changes_are_counted_not_written_as_events(test_settings: Settings) -> None:
    """Acquisitions and takeovers are telemetry; only RUN_RESUMED enters the log."""
    import runlog

    before = runlog.lease_metrics()
    with runlog.open_run(settings=test_settings) as first:
        rid = first.run_id
    with runlog.open_run(rid, settings=test_settings) as second:
        assert second.state.resumptions == 1
    after = runlog.lease_metrics()
    from runlog.log._reader import LogReader

    with LogReader(test_settings) as reader:
        logged = [r.event.type.value for r in reader.read(rid)]
    assert logged == ["run_started", "run_resumed"]  # no lease heartbeat is an event
    assert after.get("acquired", 0) - before.get("acquired", 0) == 2
    assert after.get("takeovers", 0) - before.get("takeovers", 0) == 1
    assert after.get("released", 0) - before.get("released", 0) == 2


def test_explicit_takeover_fences_a_live_owner_and_readers_agree(test_settings: Settings) -> None:
    """takeover=True does not wait for the lease; the old owner's next append is fenced
    and its write, though in the log, is excluded by every reader."""
    import time

    import runlog
    from runlog.log._reader import LogReader
    from runlog.projections._run_state import fold

    s = test_settings.model_copy(update={"lease_ttl_ms": 60_000})  # expiry would take a minute
    old = runlog.open_run(settings=s)
    old.append("user_message", content="before the takeover")
    t0 = time.monotonic()
    new = runlog.open_run(old.run_id, settings=s, wait_s=0, takeover=True)
    took = time.monotonic() - t0
    try:
        assert took < 10, f"takeover waited {took:.1f} s"
        assert new.epoch > old.epoch
        with pytest.raises(runlog.Fenced):
            old.append("user_message", content="stale: the old owner did not know")
        new.append("user_message", content="after the takeover")
        live = new.state
    finally:
        new.close()
        engine_of(old).lease.release()
    with LogReader(s) as reader:
        logged = fold(r.event for r in reader.read(new.run_id))
    contents = [m.content for m in logged.messages]
    assert contents == ["before the takeover", "after the takeover"]
    assert logged.fenced_writes == 1  # the stale append landed and is excluded
    assert logged.epoch == new.epoch and live.seq == logged.seq
