"""The operator's view from the command line: ``runlog runs`` (the run index kept by the
state projection) and ``runlog show`` (a run's story, read from the log)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from projections_support import env_for

import runlog
from runlog._settings import Settings
from runlog.consumers import _index as index
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import _state as state_store
from runlog.log._reader import LogReader
from runlog.projections import _state_view as state_view
from runlog.projections._run_state import RunState
from runlog.projections._state_view import StateView
from tools.loadgen import LoadGenerator

pytestmark = pytest.mark.timeout(180)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from runlog.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _runs(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    rc, out, err = _cli(capsys, "runs", "--json", *argv)
    assert rc == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def _make_runs(s: Settings) -> dict[str, str]:
    """One run in each index status (two tenants); returns status -> run id."""

    def wire_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise TimeoutError("bank timed out after the request was sent")

    wire = runlog.tool(
        "wire", risk="irreversible", reconcile=lambda a, **k: runlog.Inconclusive("bank down")
    )(wire_fn)
    book = runlog.tool(
        "book", risk="reversible", reconcile=lambda a, **k: runlog.Conflict("2B, not 1A")
    )(wire_fn)
    out: dict[str, str] = {}
    with runlog.open_run(tenant="acme", settings=s, goal="say hello") as run:
        run.append("user_message", content="hello")
        run.finish("succeeded", "said hello")
        out["finished"] = run.run_id
    with runlog.open_run(tenant="acme", settings=s) as run:
        run.append("user_message", content="refund?")
        run.request_approval("refund 7 EUR")
        out["waiting"] = run.run_id
    with runlog.open_run(tenant="acme", tools=[wire], settings=s) as run:
        with pytest.raises(runlog.CallUncertain):
            run.call_tool("wire", {"eur": 5, "card_number": "4111-1111"})
        out["uncertain"] = run.run_id
    with runlog.open_run(tenant="acme", tools=[book], settings=s) as run:
        with pytest.raises(runlog.Escalated):
            run.call_tool("book", {"seat": "1A"})
        out["stopped"] = run.run_id
    run = runlog.open_run(tenant="globex", settings=s)  # held open: its lease is live
    run.append("user_message", content="still going")
    out["running"] = run.run_id
    HELD.append(run)
    return out


HELD: list[runlog.Run] = []
EXPECTED = {
    "finished": "finished",
    "waiting": "waiting",
    "uncertain": "orphaned",  # open calls but nobody holds it: nothing settles them
    "stopped": "waiting",  # a conflict waits for a person
    "running": "running",
}
"""Each scenario's status in the one vocabulary (``runlog.projections._state_view``)."""


def test_runs_lists_each_status_from_the_index(
    test_settings: Settings,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = test_settings
    for k, v in env_for(s).items():
        monkeypatch.setenv(k, v)
    by_status = _make_runs(s)
    try:
        _each_status_listed(s, redis_client, capsys, by_status)
    finally:
        while HELD:
            HELD.pop().close()


def _each_status_listed(
    s: Settings,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    by_status: dict[str, str],
) -> None:
    ProjectionRunner(s, redis_client, ("state",)).catch_up(timeout_s=60)

    listed = _runs(capsys)["runs"]
    assert {r["run_id"]: r["status"] for r in listed} == {
        v: EXPECTED[k] for k, v in by_status.items()
    }
    held = next(r for r in listed if r["status"] == "running")
    assert held["owner"] and held["lease_expires_at"]
    orphan = next(r for r in listed if r["status"] == "orphaned")
    assert orphan["since"] == orphan["last_event_at"] and orphan["owner"] is None
    # Most recently active first: the globex run was the last to write.
    assert listed[0]["run_id"] == by_status["running"]
    stamps = [r["last_event_at"] for r in listed]
    assert stamps == sorted(stamps, reverse=True)
    done = next(r for r in listed if r["status"] == "finished")
    assert done["outcome"] == "succeeded" and done["last_type"] == "run_finished"
    assert done["tenant"] == "acme" and done["seq"] == 3 and done["epoch"] >= 1
    rows = {r["run_id"]: r for r in listed}
    assert rows[by_status["waiting"]]["pending_approvals"] == 1
    assert rows[by_status["waiting"]]["waiting_for"] == "person"
    assert rows[by_status["uncertain"]]["uncertain_calls"] == 1

    only = _runs(capsys, "--tenant", "globex")["runs"]
    assert [r["run_id"] for r in only] == [by_status["running"]]
    waiting = _runs(capsys, "--status", "waiting")["runs"]
    assert {r["run_id"] for r in waiting} == {by_status["waiting"], by_status["stopped"]}
    assert [r["run_id"] for r in _runs(capsys, "--status", "orphaned")["runs"]] == [
        by_status["uncertain"]
    ]
    assert len(_runs(capsys, "--since", "1h")["runs"]) == 5
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert _runs(capsys, "--since", future)["runs"] == []

    # Paging: two at a time, every run once, in the same order as one page.
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = _runs(capsys, "--limit", "2", *(["--cursor", cursor] if cursor else []))
        seen += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [r["run_id"] for r in listed]

    rc, out, _ = _cli(capsys, "runs")
    assert rc == 0 and by_status["stopped"] in out and "STATUS" in out

    # A decision moves the run from one status set to the other, in the index too.
    approval = next(iter(_pending(s, "acme", by_status["waiting"])))
    runlog.decide(
        by_status["waiting"], approval, approved=True, decided_by="ann", tenant="acme", settings=s
    )
    ProjectionRunner(s, redis_client, ("state",)).catch_up(timeout_s=60)
    assert [r["run_id"] for r in _runs(capsys, "--status", "waiting")["runs"]] == [
        by_status["stopped"]
    ]
    # Decided, and nobody holds it (the decider took it only to record the decision).
    orphaned = [r for r in _runs(capsys, "--status", "orphaned")["runs"]]
    assert by_status["waiting"] in [r["run_id"] for r in orphaned]
    decided = next(r for r in orphaned if r["run_id"] == by_status["waiting"])
    assert decided["resumptions"] == 0  # a person's decision is not a resumption


def _pending(s: Settings, tenant: str, run_id: str) -> list[str]:
    from runlog.consumers._timeline import run_timeline
    from runlog.log._clients import redis_client

    client = redis_client(s)
    try:
        with LogReader(s) as reader:
            tl = run_timeline(reader, client, s, tenant, run_id)
    finally:
        client.close()
    return list(tl.state.pending_approvals)


def test_show_tells_the_story_with_secrets_redacted(
    test_settings: Settings,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = test_settings.model_copy(update={"redact_fields": ("card_number", "password")})
    for k, v in env_for(s, RUNLOG_REDACT_FIELDS="card_number,Password").items():
        monkeypatch.setenv(k, v)

    def login_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        return json.dumps({"session": "s-1", "password": "hunter2"})

    login = runlog.tool("login", risk="safe")(login_fn)
    with runlog.open_run(tenant="acme", tools=[login], settings=s) as run:
        run.append("user_message", content="log in")
        run.call_tool("login", {"user": "ann", "password": "hunter2"})
        approval = run.request_approval("pay with the card")
        rid = run.run_id
    runlog.decide(
        rid, approval, approved=False, decided_by="bob", note="not today", tenant="acme", settings=s
    )

    rc, out, err = _cli(capsys, "show", rid, "--tenant", "acme", "--json")
    assert rc == 0, err
    assert "hunter2" not in out
    story = json.loads(out)
    kinds = [e["type"] for e in story["events"]]
    assert kinds[:2] == ["run_started", "user_message"]
    started = next(e for e in story["events"] if e["type"] == "tool_call_started")
    assert json.loads(started["args_json"]) == {"password": "[redacted]", "user": "ann"}
    assert started["risk"] == "safe" and started["idempotency_key"]
    done = next(e for e in story["events"] if e["type"] == "tool_call_completed")
    assert json.loads(done["result"])["password"] == "[redacted]"
    decided = next(e for e in story["events"] if e["type"] == "approval_decided")
    assert decided["decided_by"] == "bob" and decided["approved"] is False
    assert decided["note"] == "not today" and decided["latency_ms"] >= 0
    resumed = next(e for e in story["events"] if e["type"] == "run_resumed")
    assert resumed["reason"] == "decision by bob" and resumed["previous_epoch"] >= 1
    (call,) = story["calls"]
    assert call["tool"] == "login" and call["outcome"] == "completed"

    rc, text, _ = _cli(capsys, "show", rid, "--tenant", "acme")
    assert rc == 0 and "approved" not in text and "rejected by bob: not today" in text
    assert "hunter2" not in text

    # Another tenant's run is refused exactly like a run that does not exist.
    rc, _, theirs = _cli(capsys, "show", rid, "--tenant", "globex")
    rc2, _, unknown = _cli(capsys, "show", "r-no-such-run", "--tenant", "globex")
    assert rc == rc2 == 4
    assert theirs.replace(rid, "ID") == unknown.replace("r-no-such-run", "ID")


def test_show_names_fenced_writes_with_the_rules_reason(
    test_settings: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env_for(test_settings).items():
        monkeypatch.setenv(k, v)
    gen = LoadGenerator(test_settings, seed=3)
    run_ids = gen.generate(runs=6, events_per_run=20)
    for rid in run_ids:
        rc, out, err = _cli(capsys, "show", rid, "--tenant", "load", "--json")
        assert rc == 0, err
        story = json.loads(out)
        fenced = [e for e in story["events"] if not e["valid"]]
        assert len(fenced) == story["fenced_writes"]
        if fenced:
            assert {e["fenced_reason"] for e in fenced} <= {
                "stale_epoch",
                "stale_epoch_duplicate_seq",
            }
            return
    pytest.fail("the load generator wrote no fenced write")


def test_index_pages_100k_runs_at_constant_cost(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """The index alone (written as the store writes it): 100,000 runs, paged 1,000 at a
    time, each once and in order; a late page costs what the first one does."""
    s = test_settings
    n = 100_000
    base = datetime(2026, 1, 1, tzinfo=UTC)
    root = f"{s.redis_key_prefix}:proj:state"
    parts = [state_store.IndexKeys(f"{root}:{{{s.events_topic}:{p}}}") for p in range(s.partitions)]
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        st = RunState(
            run_id=f"r{i:06d}",
            tenant=("acme", "globex")[i % 2],
            status="finished" if i % 3 else "running",
            seq=5,
            epoch=1,
            started_at=base + timedelta(seconds=i),
            last_event_at=base + timedelta(seconds=i, milliseconds=500),
        )
        view = StateView(state=st, partition=i % s.partitions)
        keys = parts[i % s.partitions]
        pipe.hset(keys.summary(st.run_id), mapping=view.summary())
        state_store.index_write(
            pipe, keys, st.run_id, view, None, {state_store.LAST_TYPES: {st.run_id: "x"}}
        )
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()

    idx = index.RunIndex(redis_client, s)
    assert idx.counts()["finished"] == n - len(range(0, n, 3))
    seen: list[str] = []
    cursor = None
    timings: list[float] = []
    while True:
        t0 = time.perf_counter()
        page = idx.page(limit=1000, cursor=cursor)
        timings.append(time.perf_counter() - t0)
        seen += [r.run_id for r in page.rows]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [f"r{i:06d}" for i in reversed(range(n))]
    # Nobody holds these runs' leases: not finished and unowned is orphaned.
    running = idx.page(tenants=["acme"], status="orphaned", limit=10)
    assert [r.run_id for r in running.rows] == [f"r{i:06d}" for i in range(99_996, 99_900, -6)][:10]
    # The last pages cost what the first ones do (keyset paging, no offset to skip).
    early, late = sorted(timings[:10])[5], sorted(timings[-10:])[5]
    assert late < early * 3 + 0.05, (early, late)

    zsets = sum(
        int(redis_client.memory_usage(k) or 0)
        for keys in parts
        for k in [keys.tenant("acme"), keys.tenant("globex")]
        + [keys.status(st, t) for st in state_view.PHASES for t in ("acme", "globex")]
    )
    sample = [parts[i % s.partitions].summary(f"r{i:06d}") for i in range(0, n, 997)]
    per_hash = sum(int(redis_client.memory_usage(k) or 0) for k in sample) / len(sample)
    print(
        f"\nindex of {n} runs: sorted sets {zsets / n:.0f} B/run, summary hash "
        f"{per_hash:.0f} B/run; page of 1000: first {timings[0] * 1000:.1f} ms, "
        f"median early {early * 1000:.1f} ms, median late {late * 1000:.1f} ms"
    )


def test_show_into_a_closed_pipe_stops_quietly(test_settings: Settings) -> None:
    """`runlog show RUN | head`: the reader goes away before runlog has written; runlog
    stops as a command killed by SIGPIPE does (exit 141), with no traceback."""
    env = env_for(test_settings)
    (rid,) = LoadGenerator(test_settings, seed=5).generate(runs=1, events_per_run=20)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runlog.cli", "show", rid, "--tenant", "load"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _show_with(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *flags, "show", "r-any", "--tenant", "t"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_a_wrong_broker_address_is_one_line_and_librdkafka_speaks_only_when_asked(
    test_settings: Settings,
) -> None:
    """A broker address nothing listens on: runlog's one-line error naming the address, with
    none of librdkafka's retries before it. Something that listens but is no broker (it hangs
    up): librdkafka's own log lines only with `runlog --verbose`."""
    env = env_for(test_settings)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    done = _show_with({**env, "RUNLOG_BOOTSTRAP_SERVERS": closed})
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "KafkaUnavailable" in done.stderr and closed in done.stderr, done.stderr

    # A listener that hangs up on every connection: librdkafka retries and logs each failure.
    hangs_up = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def hang_up() -> None:
        hangs_up.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = hangs_up.accept()
                conn.close()

    server = threading.Thread(target=hang_up, daemon=True)
    server.start()
    not_kafka = {**env, "RUNLOG_BOOTSTRAP_SERVERS": f"127.0.0.1:{hangs_up.getsockname()[1]}"}
    try:
        quiet = _show_with(not_kafka)
        loud = _show_with(not_kafka, "--verbose")
    finally:
        stop.set()
        server.join(timeout=5)
        hangs_up.close()
    assert quiet.returncode != 0
    assert "KafkaUnavailable" in quiet.stderr, quiet.stderr
    assert quiet.stderr.strip().count("\n") == 0, quiet.stderr
    assert "rdkafka" not in quiet.stderr, quiet.stderr
    assert loud.returncode != 0 and "rdkafka" in loud.stderr, loud.stderr


def test_an_empty_runs_list_says_whether_a_projection_service_keeps_the_index(
    test_settings: Settings,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = test_settings
    for k, v in env_for(s).items():
        monkeypatch.setenv(k, v)
    rc, out, err = _cli(capsys, "runs")
    assert rc == 0 and out == ""  # no empty table
    assert "no projection service is running" in err and "runlog project state" in err
    assert _runs(capsys)["projection_services"] == {}

    runner = ProjectionRunner(s, redis_client, ("state",))  # `runlog project state`'s group
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            rc, out, err = _cli(capsys, "runs")
            if "the state projection is running" in err:
                break
            assert time.monotonic() < deadline, err
            time.sleep(0.5)
        assert rc == 0 and out == "" and f"{s.topic_prefix}.projection.state" in err
    finally:
        runner.stop()
        thread.join(timeout=30)
