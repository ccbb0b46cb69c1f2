"""A record nobody can decode in a run's range: named, reported, and set aside by a person.

Refusing to act on a log it cannot read is right for a writer; what must not happen is a
refusal without a clue (no topic, partition or offset), a verify that says "0 records", or
readers that disagree once someone decides the record does not count.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.cli import EXIT_FAILURE, EXIT_OK
from runlog.cli import main as cli_main
from runlog.consumers._verify import verify_run
from runlog.errors import UnreadableRecord
from runlog.log._replay import replay
from runlog.log._setaside import list_set_aside
from runlog.producers._handle import engine_of
from runlog.producers._writer import EventWriter
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fast(test_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    for name, value in test_settings.as_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RUNLOG_REDIS_KEY_PREFIX", test_settings.redis_key_prefix)
    with services_for(test_settings):
        yield test_settings


def _run_with_garbage(settings: Settings) -> tuple[str, int, int]:
    """A run of two events, then bytes under its key that no codec reads."""
    rid = new_run_id()
    with runlog.open_run(rid, settings=settings) as run:
        run.append(EventType.USER_MESSAGE, content="before the garbage")
    writer = EventWriter(settings)
    try:
        got = writer.send(
            settings.events_topic,
            rid.encode(),
            b"\xc3\x01not avro at all",
            [],
            partition=engine_of(run).partition,
        ).result(timeout=30)
    finally:
        writer.close()
    return rid, got.partition, got.offset


def test_an_unreadable_record_stops_readers_naming_it_and_the_remedy(fast: Settings) -> None:
    rid, partition, offset = _run_with_garbage(fast)
    where = f"{fast.events_topic}[{partition}]@{offset}"
    with pytest.raises(UnreadableRecord) as info:
        runlog.open_run(rid, settings=fast, wait_s=5)
    text = str(info.value)
    assert where in text and f"--partition {partition} --offset {offset}" in text
    assert (info.value.partition, info.value.offset) == (partition, offset)

    client = redis.Redis.from_url(fast.redis_url)
    try:
        report = verify_run(fast, client, rid)
    finally:
        client.close()
    assert not report.ok
    assert report.records == 2 and report.seq == 2, report.text()
    assert "stopped at" in (report.error or "") and where in (report.error or "")


def _set_aside(partition: int, offset: int, *, reason: str) -> int:
    """``runlog records set-aside`` of one record, decided by ops; the exit code."""
    argv = ["--partition", str(partition), "--offset", str(offset), "--by", "ops"]
    return cli_main(["records", "set-aside", *argv, "--reason", reason])


def test_a_set_aside_record_is_skipped_the_same_way_by_every_reader(
    fast: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    rid, partition, offset = _run_with_garbage(fast)
    # A record that decodes cannot be set aside: the decision is only for unreadable ones
    # (a refusal: exit 1, as every refusal of the CLI).
    assert _set_aside(partition, offset - 1, reason="test") == EXIT_FAILURE
    assert _set_aside(partition, offset, reason="stray bytes from a bad deploy") == EXIT_OK
    assert "set aside" in capsys.readouterr().out

    client = redis.Redis.from_url(fast.redis_url)
    try:
        (entry,) = list_set_aside(client, fast)
        assert (entry["partition"], entry["offset"], entry["by"]) == (partition, offset, "ops")
        assert entry["error"].startswith("UnknownFingerprint")
        # The writer resumes past it; replay and verify fold exactly what the writer folded.
        with runlog.open_run(rid, settings=fast, wait_s=5) as run:
            run.append(EventType.USER_MESSAGE, content="after the garbage")
            live = run.state.digest()
        assert replay(fast, client, rid).state.digest() == live
        report = verify_run(fast, client, rid)
        assert report.ok, report.text()
        assert report.records == 4  # started, message, resumed, message: the garbage skipped
    finally:
        client.close()
