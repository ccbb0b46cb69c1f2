"""A fleet run started with a data subject is sealed under that subject's key.

``runlog.start(..., subject=...)`` carries the subject in the start request; the worker that
starts the run records it in RUN_STARTED and seals the run's content under the subject's
key (encryption on in the workers' environment). Shredding the subject erases the run's
content while the run still replays to its finish.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, wait_finished
from pydantic import SecretStr

import runlog
from runlog.log import keys as keys_mod
from runlog.log.reader import LogReader
from runlog.log.replay import replay
from runlog.schemas.models import RunStarted
from runlog.schemas.sealing import ERASED
from runlog.settings import Settings


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
