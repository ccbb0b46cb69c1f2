"""``runlog forget`` on the real stack: after it, no plaintext of the forgotten run is left
in Redis (every key, every type, the projections rebuilt from zero included) nor in
Redis's own AOF and RDB files; every other run is unchanged and verifies; a kill -9
between destroying the key and purging completes on restart; a run in progress is
stopped (its owner fenced) before it is erased.

Each run carries a unique marker in what a user said, in a tool's arguments and result and
in its summary. The Kafka log itself still holds it until the payloads are encrypted per
subject (the key store's part): these tests scan Redis and its files, not the topic.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from projections_support import dump, start_runner, stop, wait_assigned, wait_caught_up
from scan_support import redis_bytes
from workers.common import EXIT_FENCED, read_log, start_worker, verdicts

import runlog
import runlog._api
from runlog._settings import Settings
from runlog.consumers import _erasure as erasure
from runlog.consumers import stores
from runlog.consumers._verify import verify_run
from runlog.consumers.runner import rebuild
from runlog.consumers.stores import PROJECTIONS
from runlog.log._clients import redis_client as make_client
from runlog.log._snapshots import SnapshotStore
from runlog.producers._handle import engine_of
from runlog.schemas._models import ERASED
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(300)

WORKERS = Path(__file__).resolve().parents[1] / "workers"
FORGET = WORKERS / "forget_worker.py"
CONTROL = WORKERS / "control_worker.py"
TENANT = "acme"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from runlog.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _env(monkeypatch: pytest.MonkeyPatch, s: Settings) -> None:
    from projections_support import env_for

    for k, v in env_for(s).items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def plain_rdb(redis_client: redis.Redis) -> Iterator[None]:
    """RDB strings uncompressed while the test runs, so a byte scan of the files can see
    a marker there at all (the positive control); restored afterwards."""
    was = redis_client.config_get("rdbcompression")["rdbcompression"]
    redis_client.config_set("rdbcompression", "no")
    yield
    redis_client.config_set("rdbcompression", was)


def persistence_bytes(client: redis.Redis) -> bytes:
    """Every file of Redis's data directory: the RDB and the AOF's parts."""
    root = Path(client.config_get("dir")["dir"])
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _lookup_tool() -> Any:
    @runlog.tool("lookup", risk="safe")
    def lookup(args: dict[str, Any], *, idempotency_key: str) -> str:
        return f"found {args['q']} for you"

    return lookup


def make_run(s: Settings, marker: str, *, snapshot: bool = False) -> str:
    """A finished run with ``marker`` in a user message, a tool's args and result and the
    summary (and, with ``snapshot``, a stored snapshot holding them)."""
    with runlog.open_run(tenant=TENANT, tools=[_lookup_tool()], settings=s) as run:
        run.append(EventType.USER_MESSAGE, content=f"my name is {marker}-user")
        run.call_tool("lookup", {"q": f"{marker}-args"})
        if snapshot:
            SnapshotStore(make_client(s), s).write(engine_of(run))
        run.finish("succeeded", f"told {marker}-summary")
        return run.run_id


def _keys_of(snapshot: dict[str, Any], run_id: str) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if run_id in k}


def test_forget_leaves_no_plaintext_in_redis_or_its_files(
    test_settings: Settings,
    redis_client: redis.Redis,
    unique_group: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    plain_rdb: None,
) -> None:
    s = test_settings
    _env(monkeypatch, s)
    gone, kept = f"GONE{uuid.uuid4().hex}", f"KEPT{uuid.uuid4().hex}"
    forgotten = make_run(s, gone, snapshot=True)
    other = make_run(s, kept)
    log = str(tmp_path / "runner.log")
    proc = start_runner(s, "all", unique_group("erase"), log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, s)
        assert erasure.rewrite_persistence(redis_client)
        # The positive control: the scans see the marker where it is.
        assert gone.encode() in redis_bytes(s)
        assert gone.encode() in persistence_bytes(redis_client)
        before = _keys_of(dump(redis_client, s), other)
        assert before

        # By subject: a run's default subject is the run itself (the run index has it).
        rc, out, err = _cli(
            capsys,
            "forget",
            "--subject",
            forgotten,
            "--tenant",
            TENANT,
            "--reason",
            "art. 17 request",
            "--by",
            "dpo",
            "--json",
        )
        assert rc == 0, err + out[-1500:]
        report = json.loads(out)
        assert [r["run_id"] for r in report["runs"]] == [forgotten]
        assert report["copies_deleted"] >= 2  # the snapshot pointer and its body
        assert report["projections_purged"] is True and report["persistence_rewritten"] is True

        assert gone.encode() not in redis_bytes(s)
        assert gone.encode() not in persistence_bytes(redis_client)
        assert kept.encode() in redis_bytes(s)
        assert _keys_of(dump(redis_client, s), other) == before

        # The run reads as erased, with who, when and why; its structure stays.
        rc, out, err = _cli(capsys, "show", forgotten, "--tenant", TENANT, "--json")
        assert rc == 0, err
        shown = json.loads(out)
        assert gone not in out
        assert shown["erased"]["by"] == "dpo" and shown["erased"]["reason"] == "art. 17 request"
        assert shown["outcome"] == "succeeded"
        assert [e["type"] for e in shown["events"]][-1] == "content_erased"
        assert any(e.get("content") == ERASED for e in shown["events"])
        rc, out, err = _cli(capsys, "runs", "--tenant", TENANT, "--json")
        assert rc == 0, err
        rows = {r["run_id"]: r for r in json.loads(out)["runs"]}
        assert rows[forgotten]["erased"]["by"] == "dpo" and "erased" not in rows[other]
        rc, out, err = _cli(capsys, "show", forgotten, "--tenant", TENANT)
        assert rc == 0, err
        assert "CONTENT ERASED by dpo" in out and gone not in out
        rc, out, err = _cli(capsys, "audit", forgotten, "--tenant", TENANT, "--json")
        assert rc == 0, err
        audit = json.loads(out)
        assert audit[-1]["kind"] == "content_erased" and audit[-1]["erased_by"] == "dpo"
        assert gone not in out
        rc, out, err = _cli(capsys, "verify", forgotten, "--tenant", TENANT)
        assert rc == 0 and out.startswith("ERASED"), out + err
        erased = verify_run(s, redis_client, forgotten, tenant=TENANT)
        assert erased.verdict == "erased", erased.text()
        assert verify_run(s, redis_client, other, tenant=TENANT).verdict == "ok"
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]

    # A rebuild from zero refolds the plaintext records (until they are encrypted) and the
    # erasure after them: it ends purged, and the runner rewrites Redis's files after it.
    rebuild(redis_client, s, PROJECTIONS)
    assert gone.encode() not in redis_bytes(s)
    assert gone.encode() not in persistence_bytes(redis_client)
    assert _keys_of(dump(redis_client, s), other) == before
    state = json.loads(
        redis_client.get(
            f"{s.redis_key_prefix}:proj:state:{{{s.events_topic}:"
            f"{erased_partition(s, forgotten)}}}:run:{forgotten}"
        )
        or "{}"
    )
    assert state["run_state"]["erased"]["erased_by"] == "dpo"


def erased_partition(s: Settings, run_id: str) -> int:
    from runlog.log._reader import LogReader

    with LogReader(s) as reader:
        return reader.partition_of(run_id)


def test_kill_9_between_shredding_and_purging_completes_on_restart(
    fast: Settings,
    redis_client: redis.Redis,
    unique_group: Any,
    tmp_path: Path,
    plain_rdb: None,
) -> None:
    """The forget process is SIGKILLed right after the key is destroyed, and the projection
    runner was SIGKILLed before it could fold the erasure: on restart the runner purges
    (the erasure is in the log), and running forget again purges the rest (snapshots,
    Redis's files) without destroying anything twice."""
    s = fast
    gone = f"GONE{uuid.uuid4().hex}"
    forgotten = make_run(s, gone, snapshot=True)
    group = unique_group("kill")
    log = str(tmp_path / "runner.log")
    proc = start_runner(s, "all", group, log_path=log)
    wait_assigned(proc, log)
    wait_caught_up(redis_client, s)
    proc.send_signal(signal.SIGKILL)  # down before the erasure is in the log
    proc.wait(timeout=10)

    w = start_worker(
        s, tmp_path, "f", "--tenant", TENANT, "--run", forgotten, "--halt", script=FORGET
    )
    assert w.wait_flag("shredded") == forgotten
    w.kill(signal.SIGKILL)
    assert w.proc.wait(timeout=10) == -signal.SIGKILL
    shredded = f"{s.redis_key_prefix}:test-shredded"
    assert redis_client.smembers(shredded) == {f"{TENANT}/{forgotten}".encode()}
    # The intent is in the log; nothing is purged yet: the runner is down, the snapshot kept.
    events = [r.event for r in read_log(s, forgotten)]
    assert events[-1].type is EventType.CONTENT_ERASED
    assert list(events[-1].payload.key_ids) == [f"key-{forgotten}"]  # named before the shred
    assert gone.encode() in redis_bytes(s)

    Path(log).write_text("")
    proc = start_runner(s, "all", group, log_path=log)
    try:
        wait_assigned(proc, log)
        deadline = time.monotonic() + 60
        part = erased_partition(s, forgotten)
        while not stores.purged(redis_client, s, part, forgotten):
            assert time.monotonic() < deadline, Path(log).read_text()[-2000:]
            time.sleep(0.1)
        projections = repr(dump(redis_client, s))
        assert forgotten in projections and gone not in projections
        # The forget process died before the snapshots' purge: they still hold it.
        assert gone.encode() in redis_bytes(s)

        again = start_worker(
            s, tmp_path, "g", "--tenant", TENANT, "--run", forgotten, script=FORGET
        )
        code, res = again.finish()
        assert code == 0, res["_stderr"][-3000:]
        report = json.loads(again.flag("report").read_text())
        assert report["runs"][0]["already"] is True
        assert report["keys_shredded"] == []  # destroyed once, by the killed process
        assert report["projections_purged"] is True and report["persistence_rewritten"] is True
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]
    assert gone.encode() not in redis_bytes(s)
    assert gone.encode() not in persistence_bytes(redis_client)
    erased = [r.event for r in read_log(s, forgotten) if r.event.type is EventType.CONTENT_ERASED]
    assert len(erased) == 1  # the re-run found the erasure in the log and appended none


def test_forget_of_a_run_in_progress_fences_its_owner_first(
    fast: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner is alive between two calls: forget terminates the run (a higher epoch),
    then records the erasure; the owner's next append is fenced and it calls nothing."""
    s = fast
    _env(monkeypatch, s)
    rid = f"r-forget-{uuid.uuid4().hex[:8]}"
    w = start_worker(
        s,
        tmp_path,
        "w",
        "--run-id",
        rid,
        "--steps",
        "4",
        "--hold-at",
        "1",
        "--hold",
        "between",
        script=CONTROL,
    )
    w.wait_flag("between")
    _rc, out, err = _cli(
        capsys,
        "forget",
        "--run",
        rid,
        "--tenant",
        TENANT,
        "--reason",
        "user left",
        "--by",
        "dpo",
        "--wait",
        "0",
        "--json",
    )
    report = json.loads(out)
    assert report["runs"][0]["terminated"] is True, err
    w.go()
    code, result = w.finish()
    assert code == EXIT_FENCED, result
    # The owner's late append is in the log, fenced; the valid log ends terminated, erased.
    valid = [ev for ev, ok in verdicts([r.event for r in read_log(s, rid)]) if ok]
    assert [ev.type for ev in valid[-2:]] == [EventType.RUN_FINISHED, EventType.CONTENT_ERASED]
    assert valid[-2].payload.outcome == "terminated"
    assert not w.flag("effect-1").exists()
    erased = verify_run(s, redis_client, rid, tenant=TENANT)
    assert erased.verdict == "erased", erased.text()


def test_retention_forgets_the_old_ended_runs_only(
    test_settings: Settings,
    redis_client: redis.Redis,
    unique_group: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A policy covers the runs that ended before its cutoff: the job forgets those, not a
    newer run, not a run in progress; a dry run changes nothing; the policy is stored and
    shown."""
    from datetime import UTC, datetime, timedelta

    s = test_settings
    _env(monkeypatch, s)
    old_mark, new_mark = f"OLD{uuid.uuid4().hex}", f"NEW{uuid.uuid4().hex}"
    old = make_run(s, old_mark)
    time.sleep(0.05)
    mid = datetime.now(UTC)
    time.sleep(0.05)
    new = make_run(s, new_mark)
    with runlog.open_run(tenant=TENANT, settings=s) as live:
        live.append(EventType.USER_MESSAGE, content="still going")
        running = live.run_id
    log = str(tmp_path / "runner.log")
    proc = start_runner(s, "all", unique_group("ret"), log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, s)
        rc, out, err = _cli(
            capsys, "retention", "set", "--tenant", TENANT, "--finished-older-than", "30d"
        )
        assert rc == 0, err
        rc, out, err = _cli(capsys, "retention", "show", "--json")
        assert rc == 0, err
        (policy,) = json.loads(out)
        assert (policy["tenant"], policy["seconds"]) == (TENANT, 30 * 86400)
        rc, out, err = _cli(capsys, "retention", "apply", "--json")
        assert rc == 0, err
        assert json.loads(out)[0]["runs"] == []  # nothing ended 30 days ago

        at = mid + timedelta(hours=1)  # the cutoff is ``mid``: only ``old`` ended before it
        dry = runlog._api.apply_retention(
            tenant=TENANT, finished_older_than="1h", now=at, dry_run=True, settings=s
        )
        assert [j.runs for j in dry] == [[old]] and dry[0].report is None
        assert old_mark.encode() in redis_bytes(s)
        (job,) = runlog._api.apply_retention(
            tenant=TENANT, finished_older_than="1h", now=at, settings=s
        )
        assert job.runs == [old] and job.subjects == [old]
        assert job.report is not None and job.report.projections_purged is True
        assert job.report.persistence_rewritten is True
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]
    scan = redis_bytes(s)
    assert old_mark.encode() not in scan and new_mark.encode() in scan
    assert verify_run(s, redis_client, old, tenant=TENANT).verdict == "erased"
    for rid in (new, running):
        assert verify_run(s, redis_client, rid, tenant=TENANT).verdict == "ok"


def test_forget_follows_a_run_into_its_forks(
    test_settings: Settings,
    redis_client: redis.Redis,
    unique_group: Any,
    tmp_path: Path,
    plain_rdb: None,
) -> None:
    """A fork begins with its parent's state (what the user said included): forgetting the
    parent forgets the fork too, which nobody opened yet (it is stopped first)."""
    s = test_settings
    gone = f"GONE{uuid.uuid4().hex}"
    parent = make_run(s, gone)
    child = runlog.fork(parent, at_seq=2, tenant=TENANT, forked_by="ops", settings=s).run_id
    log = str(tmp_path / "runner.log")
    proc = start_runner(s, "all", unique_group("fork"), log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, s)
        assert child in redis_bytes(s).decode(errors="replace")
        assert gone.encode() in redis_bytes(s)
        report = runlog._api.forget(
            tenant=TENANT, run_id=parent, reason="art. 17", by="dpo", settings=s
        )
        assert [r.run_id for r in report.runs] == [parent, child]
        assert report.runs[1].terminated and report.projections_purged
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]
    assert gone.encode() not in redis_bytes(s)
    assert gone.encode() not in persistence_bytes(redis_client)
    for rid in (parent, child):
        assert verify_run(s, redis_client, rid, tenant=TENANT).verdict == "erased"


def test_forget_of_an_unknown_or_another_tenants_run_is_not_found(
    test_settings: Settings,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exit 4 for a run this tenant does not have (another tenant's alike), as every
    command answers; nothing is appended to the other tenant's run."""
    s = test_settings
    _env(monkeypatch, s)
    theirs = make_run(s, f"THEIRS{uuid.uuid4().hex}")
    for rid in (theirs, f"r-nothing-{uuid.uuid4().hex[:8]}"):
        rc, _, err = _cli(
            capsys, "forget", "--run", rid, "--tenant", "other", "--reason", "x", "--by", "dpo"
        )
        assert rc == 4, err
    assert all(r.event.type is not EventType.CONTENT_ERASED for r in read_log(s, theirs))
