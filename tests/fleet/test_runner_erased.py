"""A run whose content was erased (``runlog forget``) is never dispatched by a worker and
never crashes one, whatever lifecycle record is left for it: a fork of a fleet run that was
erased has lost its agent input (its carried state is ``ERASED``), and a finished run whose
worker died between its finish and its tombstone leaves an ``open`` record behind. A real
``runlog worker`` that finds such a record drops it (the record tombstoned, counted as
erased), appends nothing to the run, and goes on with other runs."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition
from fleet_support import Fleet, wait_finished
from projections_support import env_for, stop, wait_assigned, wait_caught_up
from pydantic import SecretStr

import runlog
import runlog._api
from runlog._settings import Settings
from runlog.fleet import _lifecycle as lifecycle
from runlog.fleet._requests import wake
from runlog.log import _keys as keys_mod
from runlog.log._kafka import reader_config
from runlog.log._reader import LogReader
from runlog.schemas._keys import partition_for

pytestmark = pytest.mark.timeout(300)
TENANT = "t1"


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    yield test_settings.model_copy(
        update={
            "lease_ttl_ms": 3000,
            "encryption": "on",
            "kek": SecretStr(f"k1:{keys_mod.new_kek()}"),
            "keys_refresh_ms": 200,
        }
    )
    keys_mod.close_shared()


def _seqs(s: Settings, rid: str) -> list[int]:
    with LogReader(s) as reader:
        return [r.event.seq for r in reader.read(rid, partition=reader.partition_of(rid), start=0)]


def _lifecycle_last(s: Settings, rid: str) -> tuple[bool, bytes | None]:
    """(found, value) of the last lifecycle record of ``rid`` (value None: a tombstone)."""
    consumer = Consumer(
        {**reader_config(s), "enable.partition.eof": True, "group.id": uuid.uuid4().hex}
    )
    part = partition_for(rid, s.partitions)
    found, last = False, None
    try:
        consumer.assign([TopicPartition(lifecycle.topic(s), part, 0)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    break
                continue
            if msg.key() == rid.encode():
                found, last = True, msg.value()
    finally:
        consumer.close()
    return found, last


def test_an_erased_run_left_with_a_lifecycle_record_is_dropped_not_dispatched(
    sealed: Settings, tmp_path: Path, redis_client: redis.Redis, unique_group: Any
) -> None:
    s = sealed
    assert s.kek is not None
    subject = f"user-{uuid.uuid4().hex[:8]}"
    fleet = Fleet(s, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=s.kek.get_secret_value())
    try:
        fleet.spawn()
        parent = runlog.start(
            "payer", {"to": "p", "steps": 2}, tenant=TENANT, settings=s, subject=subject
        )
        wait_finished(s, [parent], 60, fleet)
    finally:
        fleet.stop_all()
    # With no worker up: a fork of it (dispatched by its record), then the person forgotten
    # (the run index, which finds the subject's runs and the forks, is the runner's).
    child = runlog.fork(parent, at_seq=2, tenant=TENANT, forked_by="ops", settings=s).run_id
    log_path = tmp_path / "runner.log"
    with open(log_path, "ab") as out:
        runner = subprocess.Popen(
            [sys.executable, "-m", "runlog.cli", "project", "all", "--group", unique_group("er")],
            env=env_for(s, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=s.kek.get_secret_value()),
            stdout=out,
            stderr=out,
        )
    try:
        wait_assigned(runner, str(log_path))
        wait_caught_up(redis_client, s)
        report = runlog._api.forget(
            tenant=TENANT, subject=subject, reason="art. 17", by="dpo", wait_s=30, settings=s
        )
    finally:
        assert stop(runner) == 0, log_path.read_text()[-2000:]
    assert {r.run_id for r in report.runs} == {parent, child}
    # Records left behind: a worker that died after the finish, a resume racing the forget.
    for rid in (parent, child):
        wake(s, rid, tenant=TENANT, agent="payer")
    before = {rid: _seqs(s, rid) for rid in (parent, child)}

    fleet2 = Fleet(s, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=s.kek.get_secret_value())
    try:
        name = fleet2.spawn()
        deadline = time.monotonic() + 60
        while not all(f"dispatch of {rid} dropped" in fleet2.tail(name, 10**6) for rid in before):
            assert fleet2.procs[name].poll() is None, fleet2.tail(name)
            assert time.monotonic() < deadline, fleet2.tail(name)
            time.sleep(0.2)
        other = runlog.start("payer", {"to": "o", "steps": 1}, tenant=TENANT, settings=s)
        (st,) = wait_finished(s, [other], 60, fleet2).values()
        assert st.outcome == "succeeded"
        time.sleep(1.0)  # a retry, if there were one, would be due by now
    finally:
        fleet2.stop_all()
    log = fleet2.tail(name, 10**6)
    assert "crashed" not in log, log[-3000:]
    assert "'erased': 2" in log, log[-3000:]
    for rid, seqs in before.items():
        assert log.count(f"dispatch of {rid} dropped") == 1, log[-3000:]
        assert _seqs(s, rid) == seqs  # nothing appended: not started, not resumed
        assert _lifecycle_last(s, rid) == (True, None)  # tombstoned


def test_a_start_request_of_a_forgotten_subject_is_dropped_with_encryption_off(
    test_settings: Settings, tmp_path: Path
) -> None:
    """With encryption off the start request holds the input in clear and no key shred
    reaches it: ``forget --subject`` tombstones the subject's start requests no worker has
    started, so a worker that comes up later never starts the forgotten person's run."""
    s = test_settings.model_copy(update={"lease_ttl_ms": 3000})
    assert s.encryption != "on"
    subject = f"user-{uuid.uuid4().hex[:8]}"
    gone = runlog.start(
        "payer", {"to": "gone", "steps": 1}, tenant=TENANT, settings=s, subject=subject
    )
    report = runlog._api.forget(
        tenant=TENANT, subject=subject, reason="art. 17", by="dpo", wait_s=1, settings=s
    )
    assert report.requests_dropped == [gone] and report.runs == []
    assert _lifecycle_last(s, gone) == (True, None)
    fleet = Fleet(s, tmp_path)
    try:
        fleet.spawn()
        other = runlog.start("payer", {"to": "kept", "steps": 1}, tenant=TENANT, settings=s)
        (st,) = wait_finished(s, [other], 60, fleet).values()
        assert st.outcome == "succeeded"
        time.sleep(1.0)
    finally:
        fleet.stop_all()
    assert _seqs(s, gone) == []  # never started
