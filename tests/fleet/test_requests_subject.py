"""A fleet run started with a data subject is sealed under that subject's key.

``runlog.start(..., subject=...)`` carries the subject in the start request; the worker that
starts the run records it in RUN_STARTED and seals the run's content under the subject's
key (encryption on in the workers' environment). Shredding the subject erases the run's
content while the run still replays to its finish.

The start request itself carries the run's input on the lifecycle topic: it is sealed
there too (a byte scan of the topic's segment files finds no marker), and the worker opens
it when it starts the run. A request whose subject is forgotten before any worker started
it is dropped (its lifecycle record tombstoned), neither started nor retried, and the
worker goes on with other runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, wait_finished
from pydantic import SecretStr
from scan_support import on_disk

import runlog
from runlog._settings import Settings
from runlog.log import _keys as keys_mod
from runlog.log._reader import LogReader
from runlog.log._replay import replay
from runlog.schemas._models import RunStarted
from runlog.schemas._sealing import ERASED


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    s = test_settings.model_copy(
        update={
            "lease_ttl_ms": 3000,
            "encryption": "on",
            "kek": SecretStr(f"k1:{keys_mod.new_kek()}"),
            "keys_refresh_ms": 200,
        }
    )
    yield s
    keys_mod.close_shared()


def test_a_started_run_is_sealed_for_its_subject(
    sealed: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    assert sealed.kek is not None
    fleet = Fleet(
        sealed, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=sealed.kek.get_secret_value()
    )
    try:
        fleet.spawn()
        marker = f"to-{uuid.uuid4().hex}"
        rid = runlog.start(
            "payer", {"to": marker, "steps": 1}, tenant="t1", settings=sealed, subject="user-f"
        )
        (st,) = wait_finished(sealed, [rid], 60, fleet).values()
    finally:
        fleet.stop_all()
    assert st.outcome == "succeeded" and st.subject == "user-f"
    with LogReader(sealed) as reader:
        first = next(iter(reader.read(rid))).event
    assert isinstance(first.payload, RunStarted) and first.payload.subject == "user-f"
    assert marker in (first.payload.input_json or "")
    store = keys_mod.keys_for(sealed)
    assert store is not None and len(store.shred("t1", "user-f")) == 1
    keys_mod.close_shared()
    after = replay(sealed, redis_client, rid, tenant="t1").state
    text = json.dumps(after.to_dict(), default=str, ensure_ascii=False)
    assert marker not in text and ERASED in text
    assert after.outcome == "succeeded" and after.seq == st.seq


def _lifecycle_on_disk(settings: Settings, needle: bytes) -> bool:
    """Whether ``needle`` is in any file of the lifecycle topic's partition directories."""
    return on_disk(settings.lifecycle_topic, needle)


def test_the_start_input_is_sealed_on_the_lifecycle_topic(sealed: Settings, tmp_path: Path) -> None:
    assert sealed.kek is not None
    marker = f"to-{uuid.uuid4().hex}"
    # Requested with no worker up: the request sits on the lifecycle topic meanwhile.
    rid = runlog.start(
        "payer", {"to": marker, "steps": 1}, tenant="t1", settings=sealed, subject="user-l"
    )
    assert not _lifecycle_on_disk(sealed, marker.encode()), "start input on disk in plaintext"
    fleet = Fleet(
        sealed, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=sealed.kek.get_secret_value()
    )
    try:
        fleet.spawn()
        (st,) = wait_finished(sealed, [rid], 60, fleet).values()
    finally:
        fleet.stop_all()
    # The worker opened it: the agent ran on the input as given.
    assert st.outcome == "succeeded" and marker in (st.agent_input or "")
    assert not _lifecycle_on_disk(sealed, marker.encode())


def test_a_forgotten_start_request_is_dropped_not_retried(sealed: Settings, tmp_path: Path) -> None:
    assert sealed.kek is not None
    subject = f"user-{uuid.uuid4().hex[:8]}"
    gone = runlog.start(
        "payer", {"to": "gone", "steps": 1}, tenant="t1", settings=sealed, subject=subject
    )
    store = keys_mod.keys_for(sealed)
    assert store is not None
    # The person is forgotten before any worker took the request: the request's own key
    # (its input was sealed under the subject's) is the one destroyed.
    assert len(store.shred("t1", subject)) == 1
    fleet = Fleet(
        sealed, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=sealed.kek.get_secret_value()
    )
    try:
        name = fleet.spawn(concurrency=2)
        deadline = time.monotonic() + 60
        while f"start of {gone} dropped" not in fleet.tail(name, 100_000):
            assert fleet.procs[name].poll() is None, fleet.tail(name)
            assert time.monotonic() < deadline, fleet.tail(name)
            time.sleep(0.2)
        # The worker is alive and goes on with other runs.
        other = runlog.start("payer", {"to": "kept", "steps": 1}, tenant="t1", settings=sealed)
        (st,) = wait_finished(sealed, [other], 60, fleet).values()
        assert st.outcome == "succeeded"
        time.sleep(1.0)  # a retry, if there were one, would be due by now
    finally:
        fleet.stop_all()
    log = fleet.tail(name, 1_000_000)
    assert log.count(f"start of {gone} dropped") == 1, log[-3000:]
    assert "'erased': 1" in log, log[-3000:]
    # Never started: no events, so no new key was made for the forgotten subject.
    with LogReader(sealed) as reader:
        assert list(reader.read(gone)) == []
    assert store.key_ids("t1", subject) == []
