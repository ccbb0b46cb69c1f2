"""``runlog forget`` with encryption on, end to end on the real stack: the issue's byte scan.

Two runs of one named subject and a run of another carry unique markers in what a user
said, a tool's arguments and result and the summary; a projection runner (its own process,
encryption on) folds them. After ``forget --subject``: the subject's data keys are gone from
the key store, the erasure names them, the records still in the events topic decode with
their content ``ERASED`` (no key opens them, whatever copy of the log someone kept); no
marker is in the segment files of any runlog topic, in any Redis key or in Redis's AOF and
RDB files, also once the projections are rebuilt from zero; the other subject's run still
reads and verifies with its plaintext.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from projections_support import env_for, stop, wait_assigned, wait_caught_up
from pydantic import SecretStr
from scan_support import events_records, on_disk, redis_bytes

import runlog
from runlog._settings import Settings
from runlog.consumers import _erasure as erasure
from runlog.consumers._verify import verify_run
from runlog.consumers.runner import rebuild
from runlog.consumers.stores import PROJECTIONS
from runlog.log import _keys as keys_mod
from runlog.log._keys import keys_for, new_kek
from runlog.log._replay import replay
from runlog.schemas import _codec as codec
from runlog.schemas._models import ERASED
from runlog.schemas._sealing import is_erased
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(300)

TENANT = "acme"


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    yield test_settings.model_copy(
        update={
            "encryption": "on",
            "kek": SecretStr(f"k1:{new_kek()}"),
            "keys_refresh_ms": 200,
        }
    )
    keys_mod.close_shared()


def _env(s: Settings) -> dict[str, str]:
    assert s.kek is not None
    return env_for(
        s,
        RUNLOG_ENCRYPTION="on",
        RUNLOG_KEK=s.kek.get_secret_value(),
        RUNLOG_KEYS_REFRESH_MS=str(s.keys_refresh_ms),
    )


def _run(s: Settings, marker: str, subject: str) -> str:
    @runlog.tool("lookup", risk="safe")
    def lookup(args: dict[str, Any], *, idempotency_key: str) -> str:
        return f"found {args['q']} for you"

    with runlog.open_run(tenant=TENANT, tools=[lookup], settings=s, subject=subject) as run:
        run.append(EventType.USER_MESSAGE, content=f"my name is {marker}-user")
        run.call_tool("lookup", {"q": f"{marker}-args"})
        run.finish("succeeded", f"told {marker}-summary")
        return run.run_id


def _persistence(client: redis.Redis) -> bytes:
    root = Path(client.config_get("dir")["dir"])
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _topics(s: Settings) -> list[str]:
    return [s.events_topic, s.quarantine_topic, s.keys_topic, s.lifecycle_topic]


def test_forget_a_subject_with_encryption_on_leaves_no_plaintext_anywhere(
    sealed: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> None:
    s = sealed
    subject = f"user-{uuid.uuid4().hex[:8]}"
    gone, kept = f"GONE{uuid.uuid4().hex}", f"KEPT{uuid.uuid4().hex}"
    first, second = _run(s, gone, subject), _run(s, gone, subject)
    other = _run(s, kept, f"user-{uuid.uuid4().hex[:8]}")
    store = keys_for(s)
    assert store is not None
    held = store.key_ids(TENANT, subject)
    assert held, "the subject has a data key"
    log = tmp_path / "runner.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runlog.cli", "project", "all", "--group", unique_group("fs")],
            env=_env(s),
            stdout=out,
            stderr=out,
        )
    try:
        wait_assigned(proc, str(log))
        wait_caught_up(redis_client, s)
        # The projections hold the plaintext (the runner opens what it folds).
        assert gone.encode() in redis_bytes(s)

        report = runlog.forget(
            subject=subject, tenant=TENANT, reason="art. 17", by="dpo", settings=s
        )
        assert sorted(r.run_id for r in report.runs) == sorted([first, second])
        assert sorted(report.keys_shredded) == sorted(held)
        assert report.projections_purged is True and report.persistence_rewritten is True
        assert store.key_ids(TENANT, subject) == []

        for rid in (first, second):
            st = replay(s, redis_client, rid, tenant=TENANT).state
            assert st.erased is not None and st.erased.erased_by == "dpo"
            assert verify_run(s, redis_client, rid, tenant=TENANT).verdict == "erased"
        # Below the fold: the records themselves no longer open (the key is destroyed).
        events = [
            codec.decode(m.value(), None, store)
            for m in events_records(s)
            if m.key() == first.encode()
        ]
        erasure_events = [e for e in events if e.type is EventType.CONTENT_ERASED]
        assert erasure_events and sorted(erasure_events[0].payload.key_ids) == sorted(held)
        message = next(e for e in events if e.type is EventType.USER_MESSAGE)
        assert is_erased(message) and message.payload.content == ERASED

        assert erasure.rewrite_persistence(redis_client)
        needle = gone.encode()
        for topic in _topics(s):
            assert not on_disk(topic, needle), f"{gone} in a segment file of {topic}"
        assert needle not in redis_bytes(s)
        assert needle not in _persistence(redis_client)
        # The other subject's run is untouched: it reads and verifies with its plaintext.
        kept_state = replay(s, redis_client, other, tenant=TENANT).state
        assert kept_state.erased is None
        assert any(kept in m.content for m in kept_state.messages)
        assert verify_run(s, redis_client, other, tenant=TENANT).verdict == "ok"
        assert kept.encode() in redis_bytes(s)
    finally:
        assert stop(proc) == 0, log.read_text()[-2000:]

    # Projections rebuilt from zero fold records that no longer open: still nothing of it.
    rebuild(redis_client, s, PROJECTIONS)
    assert erasure.rewrite_persistence(redis_client)
    assert needle not in redis_bytes(s)
    assert needle not in _persistence(redis_client)
    assert kept.encode() in redis_bytes(s)
