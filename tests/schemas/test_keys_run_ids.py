"""Run ids: one documented alphabet, checked at every entry point; keys that name no run.

* ``check_run_id`` accepts 1 to 200 characters of ``[A-Za-z0-9_.:@-]`` (every id
  ``new_run_id`` mints) and refuses anything else with ``InvalidRunId`` naming why.
* ``open_run``, ``decide`` and the per-run CLI commands refuse an invalid id before
  touching Kafka or Redis.
* A record whose key is missing, empty, not UTF-8 or not a valid run id is quarantined by
  the projection runners (``InvalidRecordKey``), which keep going, also after a restart;
  ``runlog uncertain`` keeps working for everybody.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from codec_support import make_event
from confluent_kafka import Producer
from projections_support import env_for, start_runner, stop, wait_assigned

import runlog
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import InvalidRecordKey, InvalidRunId
from runlog.schemas import _codec as codec
from runlog.schemas._keys import MAX_RUN_ID_LEN, check_run_id, decode_key, new_run_id
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

BAD_IDS = ["", "a\x1fb", "a b", "a\nb", "x" * (MAX_RUN_ID_LEN + 1), "é", "a*", "a{b}", "a/b"]


def test_the_run_id_alphabet() -> None:
    for good in (new_run_id(), "a", "order-42", "r_1.2:3@acme", "x" * MAX_RUN_ID_LEN):
        assert check_run_id(good) == good
    for bad in BAD_IDS:
        with pytest.raises(InvalidRunId) as err:
            check_run_id(bad)
        assert isinstance(err.value, ValueError)  # a bad argument, like a bad tenant name
    for bad, why in (("", "empty"), ("a\x1fb", "holds"), ("x" * 201, "201 characters")):
        with pytest.raises(InvalidRunId, match=why):
            check_run_id(bad)


def test_record_keys_decode_one_way() -> None:
    assert decode_key(b"order-42") == "order-42"
    for raw, why in (
        (None, "no key"),
        (b"", "empty"),
        (b"\xff", "not UTF-8"),
        (b"\xfe", "not UTF-8"),
        (b"a\x1fb", "holds"),
    ):
        with pytest.raises(InvalidRecordKey, match=why):
            decode_key(raw)


def test_entry_points_refuse_invalid_run_ids(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in ("", "a\x1fb"):
        with pytest.raises(InvalidRunId):
            runlog.open_run(bad, settings=test_settings)
        with pytest.raises(InvalidRunId):
            runlog.decide(bad, "ap-1", approved=True, decided_by="p", settings=test_settings)
    for name, value in env_for(test_settings).items():
        monkeypatch.setenv(name, value)
    from runlog.cli import main

    for argv in (
        ["state", ""],
        ["audit", "a\x1fb"],
        ["replay", ""],
        ["verify", "a b"],
        ["snapshot", "write", ""],
        ["approve", "", "ap-1"],
        ["reject", "a\x1fb", "ap-1"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "InvalidRunId" in err and "run id" in err, (argv, err)


def _event(run_id: str, seq: int, et: EventType, epoch: int = 1, **payload: Any) -> Event:
    return make_event(et, payload, run_id=run_id, seq=seq, epoch=epoch, event_id=f"{seq:032x}")


def _uncertain_run(run_id: str) -> list[Event]:
    """A run whose tool call is left uncertain by a takeover (opens an uncertain call)."""
    return [
        _event(run_id, 1, EventType.RUN_STARTED, agent="a", goal="g"),
        _event(
            run_id,
            2,
            EventType.TOOL_CALL_STARTED,
            call_id="c1",
            name="pay",
            args_json='{"a":1}',
            idempotency_key="k" * 32,
            risk="irreversible",
        ),
        _event(
            run_id,
            3,
            EventType.RUN_RESUMED,
            epoch=2,
            previous_epoch=1,
            expected_prev_seq=2,
            reason="crash",
        ),
    ]


def _produce(settings: Settings, records: list[tuple[bytes | None, Event]]) -> None:
    producer = Producer({**settings.kafka_common(), "partitioner": "murmur2_random"})
    for key, ev in records:
        producer.produce(settings.events_topic, key=key, value=codec.encode(ev))
    assert producer.flush(30) == 0


def _wait(
    check: Callable[[], bool], proc: subprocess.Popen[bytes], log_path: Path, what: str
) -> None:
    deadline = time.monotonic() + 60
    while not check():
        assert proc.poll() is None, f"runner died: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: {log_path.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_records_keyed_by_no_valid_run_are_quarantined_and_runners_keep_going(
    test_settings: Settings,
    redis_client: redis.Redis,
    unique_group: Callable[..., str],
    tmp_path: Path,
) -> None:
    good = "good-run-1"
    bad: list[tuple[bytes | None, Event]] = [
        (b"", _event("", 1, EventType.RUN_STARTED)),
        (None, _event("no-key", 1, EventType.RUN_STARTED)),
        # Two byte strings that decoding with replacement would merge into one run id.
        (b"\xff", _event("\ufffd", 1, EventType.RUN_STARTED)),
        (b"\xfe", _event("\ufffd", 1, EventType.RUN_STARTED)),
        *[(b"a\x1fb", ev) for ev in _uncertain_run("a\x1fb")],
    ]
    _produce(test_settings, [(good.encode(), ev) for ev in _uncertain_run(good)] + bad)

    log_path = tmp_path / "runner.log"
    group = unique_group("ids")
    proc = start_runner(test_settings, "all", group, log_path=str(log_path))
    try:
        wait_assigned(proc, str(log_path))
        _wait(
            lambda: len(queries.quarantined(redis_client, test_settings)) == len(bad),
            proc,
            log_path,
            "records were not quarantined",
        )
        # A restarted runner (every service restart) still starts and keeps folding.
        stop(proc)
        proc = start_runner(test_settings, "all", group, log_path=str(log_path))
        wait_assigned(proc, str(log_path))
        later = "good-run-2"
        _produce(test_settings, [(later.encode(), ev) for ev in _uncertain_run(later)])
        _wait(
            lambda: queries.get_state(redis_client, test_settings, later) is not None,
            proc,
            log_path,
            "the restarted runner did not fold a later run",
        )
        assert proc.poll() is None
    finally:
        stop(proc)

    recs = queries.quarantined(redis_client, test_settings)
    assert {r["error"] for r in recs} == {"InvalidRecordKey"}
    assert all(r["run_id"] is None for r in recs)
    assert all(r["projections"] == list(PROJECTIONS) for r in recs)
    keys = sorted(
        b"<none>" if r["key_b64"] is None else base64.b64decode(r["key_b64"]) for r in recs
    )
    assert keys == sorted([b"", b"<none>", b"\xff", b"\xfe"] + [b"a\x1fb"] * 3)

    # `runlog uncertain` works and lists the good runs' calls only.
    env = env_for(test_settings)
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "uncertain", "--json"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    assert sorted(c["run_id"] for c in report["open"]) == ["good-run-1", "good-run-2"]


def test_a_non_utf8_key_is_quarantined_by_an_in_process_catch_up(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """The same rule in a synchronous catch-up (what rebuild uses)."""
    _produce(
        test_settings,
        [
            (b"\xff", _event("\ufffd", 1, EventType.RUN_STARTED)),
            (b"ok-1", _event("ok-1", 1, EventType.RUN_STARTED)),
        ],
    )
    runner = ProjectionRunner(test_settings, redis_client, ("state",))
    runner.catch_up(timeout_s=60)
    recs = queries.quarantined(redis_client, test_settings, ("state",))
    assert [(r["error"], r["run_id"]) for r in recs] == [("InvalidRecordKey", None)]
    assert "not UTF-8" in recs[0]["message"]
    assert queries.get_state(redis_client, test_settings, "ok-1") is not None
