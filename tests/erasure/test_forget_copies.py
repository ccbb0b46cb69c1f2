"""``runlog forget`` reaches every copy of a subject's content that runlog keeps outside the
log (``runlog.log._copies``), with encryption on, on the real stack.

The subject's marker is put into each of them while the runs' owner is busy (this process
holds both runs): a cancellation queued with its reason (the inbox and the cancel flag), a
decision queued with its note, an inbox entry that did not parse (set aside), a pending
notification of an approval request (the notify projection, folded by ``runlog project
all``), a snapshot. After ``forget --subject`` the marker is in no Redis key or value and,
once Redis rewrote them, in neither its AOF nor its RDB.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from erasure.test_forget_sealed import TENANT, _env, _persistence
from projections_support import stop, wait_assigned, wait_caught_up
from pydantic import SecretStr
from scan_support import redis_bytes

import runlog
from runlog._settings import Settings
from runlog.consumers import _erasure as erasure
from runlog.consumers.stores import NOTIFY, PROJECTIONS
from runlog.log import _copies as copies
from runlog.log import _keys as keys_mod
from runlog.log._clients import redis_client as make_client
from runlog.log._keys import new_kek
from runlog.log._snapshots import SnapshotStore
from runlog.producers._handle import engine_of
from runlog.producers._lease import Lease, LeaseManager
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    yield test_settings.model_copy(
        update={"encryption": "on", "kek": SecretStr(f"k1:{new_kek()}"), "keys_refresh_ms": 200}
    )
    keys_mod.close_shared()


@pytest.fixture
def plain_rdb(redis_client: redis.Redis) -> Iterator[None]:
    """RDB strings uncompressed while the test runs, so that a byte scan of the files could
    see the marker there at all; restored afterwards."""
    was = redis_client.config_get("rdbcompression")["rdbcompression"]
    redis_client.config_set("rdbcompression", "no")
    yield
    redis_client.config_set("rdbcompression", was)


@pytest.fixture
def runner(
    sealed: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / "runner.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runlog.cli", "project", "all", "--group", unique_group("cp")],
            env=_env(sealed),
            stdout=out,
            stderr=out,
        )
    try:
        wait_assigned(proc, str(log))
        yield proc
    finally:
        assert stop(proc) == 0, log.read_text()[-2000:]


def test_forget_leaves_no_copy_of_a_queued_item_in_redis_or_its_files(
    sealed: Settings,
    redis_client: redis.Redis,
    runner: subprocess.Popen[bytes],
    plain_rdb: None,
) -> None:
    s = sealed
    subject = f"user-{uuid.uuid4().hex[:8]}"
    marker = f"SSN{uuid.uuid4().hex}"
    needle = marker.encode()
    with contextlib.ExitStack() as held:
        # The owner is busy: this process holds both runs while people act on them.
        busy = held.enter_context(runlog.open_run(tenant=TENANT, settings=s, subject=subject))
        asking = held.enter_context(runlog.open_run(tenant=TENANT, settings=s, subject=subject))
        busy.append(EventType.USER_MESSAGE, content=f"{marker}-user")
        SnapshotStore(make_client(s), s).write(engine_of(busy))
        approval = asking.request_approval(f"refund to {marker}-question")
        inbox = copies.inbox_key(s.redis_key_prefix, TENANT, asking.run_id)
        redis_client.rpush(inbox, f"not a decision {marker}-malformed")
        asking.poll_decisions()  # the owner sets the entry that does not parse aside
        assert redis_client.llen(copies.malformed_key(s.redis_key_prefix, TENANT, asking.run_id))

        how = runlog.cancel(
            busy.run_id,
            reason=f"{marker} Jane Doe asked to stop",
            by="ops",
            tenant=TENANT,
            settings=s,
            wait_s=0.2,
        )
        assert how == "queued"
        how = runlog.decide(
            asking.run_id,
            approval,
            approved=True,
            decided_by="ops",
            note=f"{marker}-note",
            tenant=TENANT,
            settings=s,
            wait_s=0.2,
        )
        assert how == "queued"
        wait_caught_up(redis_client, s, (*PROJECTIONS, NOTIFY))
        # The positive control: every copy is there, and Redis's files hold it.
        stored = redis_bytes(s)
        for part in ("asked to stop", "-note", "-malformed", "-question"):
            assert (marker + part).encode() in stored or (
                part == "asked to stop" and needle in stored
            ), part
        assert redis_client.exists(copies.cancel_flag_key(s.redis_key_prefix, TENANT, busy.run_id))

        report = runlog.forget(
            subject=subject, tenant=TENANT, reason="art. 17", by="dpo", settings=s
        )
        assert sorted(r.run_id for r in report.runs) == sorted([busy.run_id, asking.run_id])
        assert report.projections_purged is True and report.persistence_rewritten is True
        # The owner learns it was stopped at its next append; closing it writes nothing.
        for run in (busy, asking):
            with contextlib.suppress(runlog.Fenced):
                run.append(EventType.USER_MESSAGE, content="after the forget")
        held.close()

    assert needle not in redis_bytes(s)
    assert needle not in _persistence(redis_client)


def _race_once(s: Settings) -> tuple[str, dict[str, object]]:
    """One race of a decision and a cancellation with ``forget`` of their runs' subject;
    returns the marker they carried and what each caller was told."""
    subject = f"user-{uuid.uuid4().hex[:8]}"
    marker = f"RACE{uuid.uuid4().hex}"
    outcome: dict[str, object] = {}
    with contextlib.ExitStack() as held:
        run = held.enter_context(runlog.open_run(tenant=TENANT, settings=s, subject=subject))
        other = held.enter_context(runlog.open_run(tenant=TENANT, settings=s, subject=subject))
        approval = run.request_approval("refund")
        barrier = threading.Barrier(3)

        def decide() -> None:
            barrier.wait()
            try:
                outcome["decide"] = runlog.decide(
                    run.run_id,
                    approval,
                    approved=True,
                    decided_by="ops",
                    note=f"{marker}-note",
                    tenant=TENANT,
                    settings=s,
                    wait_s=0.5,
                )
            except runlog.RunlogError as exc:
                outcome["decide"] = exc

        def cancel() -> None:
            barrier.wait()
            try:
                outcome["cancel"] = runlog.cancel(
                    other.run_id,
                    reason=f"{marker}-reason",
                    by="ops",
                    tenant=TENANT,
                    settings=s,
                    wait_s=0.5,
                )
            except runlog.RunlogError as exc:
                outcome["cancel"] = exc

        threads = [threading.Thread(target=decide), threading.Thread(target=cancel)]
        for t in threads:
            t.start()
        barrier.wait()
        report = runlog.forget(
            subject=subject, tenant=TENANT, reason="art. 17", by="dpo", settings=s
        )
        for t in threads:
            t.join(timeout=60)
        assert sorted(r.run_id for r in report.runs) == sorted([run.run_id, other.run_id])
        for r in (run, other):
            with contextlib.suppress(runlog.RunlogError):
                r.append(EventType.USER_MESSAGE, content="after")
    return marker, outcome


@pytest.mark.parametrize("attempt", range(3))
def test_a_decision_racing_forget_leaves_no_copy(
    sealed: Settings,
    redis_client: redis.Redis,
    runner: subprocess.Popen[bytes],
    plain_rdb: None,
    attempt: int,
) -> None:
    """A person decides (and another cancels) while ``forget`` runs: released together from
    a barrier, with the owner busy. Whichever lands first, no note or reason is left in
    Redis or its files: an item queued before the erasure is deleted by forget (its second
    pass), one queued after it is withdrawn by the caller that reads the erasure."""
    marker, outcome = _race_once(sealed)
    assert marker.encode() not in redis_bytes(sealed), outcome
    assert erasure.rewrite_persistence(redis_client)
    assert marker.encode() not in _persistence(redis_client), outcome


def test_a_decision_queued_after_the_erasure_is_withdrawn_by_its_caller(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    """The latest a decision can come: its run is erased and someone holds its lease (a
    process that took it before it read the erasure), so the decision goes to the inbox
    after ``forget`` purged it. The caller reads the erasure, withdraws its entry and is
    told the run ended; nothing of the note stays."""
    s = sealed
    marker = f"LATE{uuid.uuid4().hex}"
    with runlog.open_run(tenant=TENANT, settings=s, subject=f"u-{uuid.uuid4().hex[:8]}") as run:
        approval = run.request_approval("refund")
    runlog.forget(
        run_id=run.run_id, tenant=TENANT, reason="art. 17", by="dpo", wait_s=1, settings=s
    )
    leases = LeaseManager(redis_client, key_prefix=s.redis_key_prefix)
    held = leases.try_acquire(TENANT, run.run_id, "late-holder", 30_000)
    assert isinstance(held, Lease)
    try:
        with pytest.raises(runlog.RunFinished):
            runlog.decide(
                run.run_id,
                approval,
                approved=True,
                decided_by="ops",
                note=f"{marker}-note",
                tenant=TENANT,
                settings=s,
                wait_s=2,
            )
    finally:
        held.release()
    assert redis_client.llen(copies.inbox_key(s.redis_key_prefix, TENANT, run.run_id)) == 0
    assert marker.encode() not in redis_bytes(s)
