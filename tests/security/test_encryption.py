"""Sealed content on the real stack: per-subject data keys, crypto-shredding, compaction.

Encryption on: a marker planted in a message, a tool's arguments and its result reaches
Kafka's segment files only sealed; the run replays and verifies with its plaintext. After
``shred`` of its subject, the run still replays and verifies on its structure, its content
erased, while another subject's run is unchanged; once the keys topic is compacted the
wrapped key's bytes are gone from its segment files too. A writer SIGKILLed right after it
made a new subject's key loses nothing: the run decodes on restart. Encryption off: the
marker is on disk in plaintext (so the byte scans above do look where the bytes are).
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from projections_support import env_for
from scan_support import on_disk

import runlog
from runlog._settings import Settings
from runlog._topics import delete_topics, ensure_topics, topic_specs
from runlog.consumers._verify import verify_run
from runlog.log import _keys as keys_mod
from runlog.log._keys import KafkaKeyStore, keys_for, new_kek
from runlog.log._replay import replay
from runlog.schemas._sealing import ERASED


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    s = test_settings.model_copy(
        update={
            "encryption": "on",
            "kek": runlog_secret(f"k1:{new_kek()}"),
            "keys_refresh_ms": 200,
        }
    )
    yield s
    keys_mod.close_shared()


def runlog_secret(value: str) -> Any:
    from pydantic import SecretStr

    return SecretStr(value)


def _echo(args: dict[str, Any], *, idempotency_key: str) -> str:
    return f"result for {args['q']}"


def _write(s: Settings, marker: str, subject: str | None) -> str:
    tools = [runlog.tool("lookup", risk="safe")(_echo)]
    with runlog.open_run(
        tenant="acme", tools=tools, settings=s, goal=f"goal {marker}", subject=subject
    ) as run:
        run.append("user_message", content=f"my name is {marker}")
        got = run.call_tool("lookup", {"q": marker})
        assert marker in got
        run.finish("done", summary=f"summary {marker}")
        return run.run_id


def _contents(state: Any) -> str:
    return json.dumps(state.to_dict(), default=str, ensure_ascii=False)


def test_encryption_off_writes_plaintext(test_settings: Settings) -> None:
    """The control: with RUNLOG_ENCRYPTION off the marker is in the segment files."""
    marker = f"MARK-{uuid.uuid4().hex}"
    _write(test_settings, marker, None)
    assert on_disk(test_settings.events_topic, marker.encode())


def test_sealed_round_trip_shred_and_other_runs(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    s = sealed
    marker, other = f"MARK-{uuid.uuid4().hex}", f"KEEP-{uuid.uuid4().hex}"
    rid = _write(s, marker, "user-42")
    rid2 = _write(s, other, None)  # the run is its own subject
    # Nothing of either content in the events topic's segment files.
    for text in (marker, other):
        assert not on_disk(s.events_topic, text.encode()), f"{text} on disk in plaintext"
    # Both replay and verify with their plaintext.
    st = replay(s, redis_client, rid, tenant="acme").state
    assert marker in _contents(st) and st.subject == "user-42"
    assert verify_run(s, redis_client, rid, tenant="acme").ok
    assert other in _contents(replay(s, redis_client, rid2, tenant="acme").state)

    store = keys_for(s)
    assert store is not None
    before = replay(s, redis_client, rid2, tenant="acme").state.to_dict()
    destroyed = store.shred("acme", "user-42")
    assert len(destroyed) == 1
    assert store.shred("acme", "user-42") == []  # idempotent

    # A fresh process (no cached key) and this one both see the content erased.
    keys_mod.close_shared()
    st = replay(s, redis_client, rid, tenant="acme").state
    text = _contents(st)
    at = text.find(marker)
    assert at < 0, text[max(0, at - 300) : at + 100]
    assert ERASED in text
    assert st.status == "finished" and st.outcome == "done" and st.seq > 0
    report = verify_run(s, redis_client, rid, tenant="acme")
    assert report.ok, report.to_dict()
    # The other subject's run is exactly what it was.
    assert replay(s, redis_client, rid2, tenant="acme").state.to_dict() == before

    # `runlog show` in a process of its own: erased, not an error.
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "show", rid, "--tenant", "acme"],
        env=_env(s),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert marker not in done.stdout


def _env(s: Settings, **extra: str) -> dict[str, str]:
    assert s.kek is not None
    return env_for(
        s,
        RUNLOG_ENCRYPTION=s.encryption,
        RUNLOG_KEK=s.kek.get_secret_value(),
        RUNLOG_KEYS_REFRESH_MS=str(s.keys_refresh_ms),
        **extra,
    )


def test_a_running_reader_learns_of_a_shred(sealed: Settings, redis_client: redis.Redis) -> None:
    """A process that has the key cached stops opening with it once another shredded it."""
    s = sealed
    marker = f"MARK-{uuid.uuid4().hex}"
    rid = _write(s, marker, "user-7")
    assert marker in _contents(replay(s, redis_client, rid, tenant="acme").state)
    other = KafkaKeyStore(s, keys_mod.load_keks(s))
    try:
        assert other.shred("acme", "user-7")
    finally:
        other.close()
    time.sleep(s.keys_refresh_ms / 1000 + 0.3)
    text = _contents(replay(s, redis_client, rid, tenant="acme").state)
    assert marker not in text and ERASED in text


def test_compaction_removes_a_shredded_keys_bytes(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    """The keys topic's compaction (a tiny ``segment.ms`` here) removes the record a
    shred tombstoned: the wrapped key is no longer in any of the topic's segment files."""
    s = sealed.model_copy(
        update={
            "topic_prefix": f"{sealed.topic_prefix}-c",
            "keys_segment_ms": 100,
            "keys_max_compaction_lag_ms": 100,
        }
    )
    ensure_topics(s).raise_for_drift()
    store = KafkaKeyStore(s, keys_mod.load_keks(s), refresh_s=0.1)
    try:
        store.sealer("acme", "user-gone")
        (key_id,) = store.key_ids("acme", "user-gone")
        wrapped = base64.b64encode(store._wrapped[key_id].wrapped)
        assert on_disk(s.keys_topic, wrapped)
        assert store.shred("acme", "user-gone") == [key_id]
        # Compaction never cleans the open segment: later writes roll it (segment.ms).
        deadline = time.monotonic() + 120
        while on_disk(s.keys_topic, wrapped):
            assert time.monotonic() < deadline, "the shredded key's bytes are still on disk"
            store.sealer("acme", f"filler-{uuid.uuid4().hex[:6]}")
            time.sleep(1.0)
        assert store.key_ids("acme", "user-gone") == []
    finally:
        store.close()
        delete_topics(s, [spec.name for spec in topic_specs(s)], timeout=10)


CHILD = """
import os, sys
import runlog
from runlog._settings import Settings
s = Settings()
run = runlog.open_run(tenant="acme", settings=s, subject=sys.argv[1])
run.append("user_message", content=sys.argv[2])
run.barrier()
print(run.run_id, flush=True)
sys.stdin.read()
"""


def test_sigkill_after_a_new_key_loses_nothing(sealed: Settings, redis_client: redis.Redis) -> None:
    s = sealed
    marker = f"MARK-{uuid.uuid4().hex}"
    subject = f"user-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, subject, marker],
        env=_env(s),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        rid = child.stdout.readline().strip()
        assert rid, "the writer did not get its first event acknowledged"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    keys_mod.close_shared()  # this process never saw the key: it must come from the store
    st = replay(s, redis_client, rid, tenant="acme").state
    assert marker in _contents(st)
    assert not on_disk(s.events_topic, marker.encode())


def test_projections_fold_an_erased_run_without_quarantine(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    """A projection rebuilt after a shred folds the run's structure with its content erased:
    nothing is quarantined, the run's status and seq are what they were."""
    from runlog.consumers._queries import get_state, quarantined
    from runlog.consumers.runner import rebuild

    s = sealed
    marker = f"MARK-{uuid.uuid4().hex}"
    rid = _write(s, marker, "user-p")
    store = keys_for(s)
    assert store is not None and store.shred("acme", "user-p")
    rebuild(redis_client, s, ["state"])
    view = get_state(redis_client, s, rid)
    assert view is not None
    text = json.dumps(view, default=str, ensure_ascii=False)
    assert marker not in text and ERASED in text
    assert view["state"]["status"] == "finished" and view["state"]["seq"] == 5
    assert quarantined(redis_client, s, ("state",)) == []


def test_kek_rotation_lets_the_old_kek_go(sealed: Settings, redis_client: redis.Redis) -> None:
    """``rotate`` re-wraps every live key under the last KEK; a reader holding only the new
    KEK then opens runs sealed before the rotation (so the old KEK can be destroyed)."""
    from pydantic import SecretStr

    s = sealed
    marker = f"MARK-{uuid.uuid4().hex}"
    rid = _write(s, marker, "user-r")
    assert s.kek is not None
    old = s.kek.get_secret_value()
    new = f"k2:{new_kek()}"
    both = s.model_copy(update={"kek": SecretStr(f"{old},{new}")})
    rotating = KafkaKeyStore(both, keys_mod.load_keks(both))
    try:
        assert rotating.rotate() >= 1
        assert rotating.rotate() == 0  # everything is under k2 already
    finally:
        rotating.close()
    keys_mod.close_shared()
    only_new = s.model_copy(update={"kek": SecretStr(new)})
    assert marker in _contents(replay(only_new, redis_client, rid, tenant="acme").state)
    keys_mod.close_shared()


def test_file_store_for_development(sealed: Settings, tmp_path: Path) -> None:
    """The file store: a key made by one process is found by another, shredded by one it
    is gone for the other (at its next refresh), and shredding twice returns []."""
    from runlog.log._keys import FileKeyStore
    from runlog.schemas._sealing import aad

    keks = keys_mod.load_keks(sealed)
    a = FileKeyStore(tmp_path / "keys", keks, refresh_s=0)
    b = FileKeyStore(tmp_path / "keys", keks, refresh_s=0)
    sealed_value = a.sealer("acme", "user-f").seal("hello", aad("r", 1, "content"))
    assert b.open(*sealed_value, aad("r", 1, "content")) == "hello"
    with pytest.raises(ValueError):  # another field's associated data does not open it
        b.open(*sealed_value, aad("r", 1, "summary"))
    assert b.shred("acme", "user-f") == [sealed_value.key_id]
    assert b.shred("acme", "user-f") == []
    assert a.open(*sealed_value, aad("r", 1, "content")) is None
    assert not any(
        b"hello" in f.read_bytes() or sealed_value.key_id in f.name
        for f in (tmp_path / "keys").iterdir()
    )


def test_a_reader_without_keys_stops_instead_of_guessing(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    """Sealed records met by a reader given no KEK: ``NoKeys`` (a setting to fix), neither
    plaintext nor ERASED nor a quarantined record."""
    rid = _write(sealed, f"MARK-{uuid.uuid4().hex}", None)
    keyless = sealed.model_copy(update={"encryption": "off", "kek": None})
    with pytest.raises(runlog.errors.NoKeys):
        replay(keyless, redis_client, rid, tenant="acme")
