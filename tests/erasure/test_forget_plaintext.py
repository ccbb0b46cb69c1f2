"""``runlog forget`` says plainly what it cannot erase: a run written with encryption off
(the default) keeps its content in clear in the events topic (a record of the log is never
rewritten; only the topic's retention deletes it). The CLI's text and ``--json`` say so,
name the runs and the setting that fixes it for future runs; a run written sealed says
nothing of the kind. Real stack, real projection runner."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from erasure.test_forget import TENANT, _cli, _env, make_run
from projections_support import start_runner, stop, wait_assigned, wait_caught_up
from pydantic import SecretStr
from scan_support import topic_bytes

import runlog
import runlog._api
from runlog._settings import Settings
from runlog.errors import ForkRefused
from runlog.log import _keys as keys_mod
from runlog.log._keys import new_kek

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def runner(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> Iterator[None]:
    log = str(tmp_path / "runner.log")
    proc = start_runner(test_settings, "all", unique_group("plain"), log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, test_settings)
        yield
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]


def test_forget_with_encryption_off_says_the_log_keeps_the_plaintext(
    test_settings: Settings,
    runner: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = test_settings
    assert s.encryption != "on"
    _env(monkeypatch, s)
    marker = f"CLEAR{uuid.uuid4().hex}"
    rid = make_run(s, marker)

    rc, out, err = _cli(
        capsys, "forget", "--run", rid, "--tenant", TENANT, "--reason", "art. 17", "--by", "dpo"
    )
    assert rc == 0, err
    assert "NOT erased from the events topic" in out and rid in out, out
    assert "RUNLOG_ENCRYPTION=on" in out, out
    # Again, as JSON: the same (forget is idempotent; the log still holds it).
    rc, out, err = _cli(
        capsys, "forget", "--run", rid, "--tenant", TENANT, "--reason", "x", "--by", "dpo", "--json"
    )
    assert rc == 0, err
    got = json.loads(out)
    assert got["log_plaintext_kept"] is True and got["log_plaintext_runs"] == [rid]
    assert "RUNLOG_ENCRYPTION=on" in got["log_plaintext_note"]
    # What it says is true: the marker is in the topic's records.
    assert marker.encode() in topic_bytes(s)


def test_forget_of_a_sealed_run_says_nothing_is_kept(test_settings: Settings) -> None:
    """The negative control: the same run written sealed is erased from the log too (no
    projection runner: this test asks about the log only)."""
    s = test_settings.model_copy(
        update={"encryption": "on", "kek": SecretStr(f"k1:{new_kek()}"), "keys_refresh_ms": 200}
    )
    try:
        marker = f"SEALED{uuid.uuid4().hex}"
        rid = make_run(s, marker)
        report = runlog._api.forget(
            tenant=TENANT, run_id=rid, reason="art. 17", by="dpo", wait_s=0.5, settings=s
        )
        assert report.keys_shredded
        assert report.log_plaintext_kept is False and report.log_plaintext_runs == []
        assert report.log_plaintext_note == ""
        assert marker.encode() not in topic_bytes(s)
    finally:
        keys_mod.close_shared()


def test_an_erased_run_is_not_forked(test_settings: Settings) -> None:
    """A fork begins with its parent's state: with encryption off the log still holds the
    erased content in clear, and a fork made after the forget would carry it into a new run
    (readable there, under no erasure). It is refused, and nothing is written."""
    s = test_settings
    marker = f"FORK{uuid.uuid4().hex}"
    rid = make_run(s, marker)
    runlog._api.forget(
        tenant=TENANT, run_id=rid, reason="art. 17", by="dpo", wait_s=0.5, settings=s
    )
    before = topic_bytes(s).count(marker.encode())
    with pytest.raises(ForkRefused):
        runlog.fork(rid, at_seq=2, tenant=TENANT, forked_by="ops", settings=s)
    assert topic_bytes(s).count(marker.encode()) == before  # no new copy in the log
