"""Caches in running processes learn of an erasure through the log: a long-lived reader (a
console, a worker, a projection runner) holds a subject's unwrapped data key in memory,
and would open its content until its next key-store refresh (``RUNLOG_KEYS_REFRESH_MS``,
here a minute, as a process that read nothing of the key store meanwhile). Once it reads a
``content_erased`` naming the keys, it re-reads the key store's news at once: another run
of the subject that this process served before ``runlog forget`` (run in another process)
serves erased right after, without a restart. Real stack, encryption on."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from erasure.test_forget_sealed import TENANT, _env, _run
from pydantic import SecretStr

from runlog._settings import Settings
from runlog.consumers._timeline import run_timeline
from runlog.log import _keys as keys_mod
from runlog.log._clients import redis_client
from runlog.log._keys import new_kek
from runlog.log._reader import LogReader
from runlog.schemas._models import ERASED

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def slow_refresh(test_settings: Settings) -> Iterator[Settings]:
    yield test_settings.model_copy(
        update={
            "encryption": "on",
            "kek": SecretStr(f"k1:{new_kek()}"),
            "keys_refresh_ms": 60_000,
        }
    )
    keys_mod.close_shared()


def _shown(s: Settings, rid: str) -> str:
    """What the console shows of ``rid`` (``Console.timeline``: a fresh read of the log)."""
    client = redis_client(s)
    try:
        with LogReader(s) as reader:
            t = run_timeline(reader, client, s, TENANT, rid)
    finally:
        client.close()
    return json.dumps([str(e) for e in t.entries], ensure_ascii=False)


def test_a_long_lived_reader_serves_erased_after_forget_without_restart(
    slow_refresh: Settings,
) -> None:
    s = slow_refresh
    subject = f"user-{uuid.uuid4().hex[:8]}"
    one, two = f"ONE{uuid.uuid4().hex}", f"TWO{uuid.uuid4().hex}"
    first = _run(s, one, subject)
    second = _run(s, two, subject)
    # This process served the subject's second run before the forget: its key is cached.
    assert two in _shown(s, second)

    # `runlog forget` in another process: the first run and, with it, its subject's other
    # run (they share the key it shreds).
    done = subprocess.run(
        [
            *(sys.executable, "-m", "runlog.cli", "forget", "--run", first, "--tenant", TENANT),
            *("--whole-subject", "--reason", "art. 17", "--by", "dpo", "--wait", "1", "--json"),
        ],
        env=_env(s),
        capture_output=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert sorted(r["run_id"] for r in report["runs"]) == sorted([first, second])
    assert report["keys_shredded"]

    # The long-lived reader serves the erased run (its log says so) and, having read the
    # erasure, the subject's other run erased too: its key is no longer in use here.
    shown = _shown(s, first)
    assert one not in shown and ERASED in shown
    shown = _shown(s, second)
    assert two not in shown and ERASED in shown
