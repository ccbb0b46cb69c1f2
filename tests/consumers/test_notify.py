"""A person learns that a decision waits: deadlines on approval requests, one notification
per request (through SIGKILLs, redeliveries and rebuilds), retries with a record of each
attempt, and ``runlog approvals --overdue``. Real Kafka, Redis, HTTP and processes."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from projections_support import env_for, stop
from ui_support import TOKEN_ADMIN, console, projecting, wait_for

import runlog
from runlog._settings import Settings
from runlog.cli import main as cli_main
from runlog.consumers import _queries as queries
from runlog.consumers._notify import Notifier, Webhook
from runlog.consumers._store import ProjectionKeys
from runlog.consumers.runner import ProjectionRunner, rebuild
from runlog.consumers.stores import NOTIFY
from runlog.errors import Escalated
from runlog.projections._notify import identity
from runlog.schemas._vocabulary import EventType

FAST = {
    "notify_backoff_s": 0.05,
    "notify_backoff_cap_s": 0.2,
    "notify_timeout_s": 1.0,
}


class Receiver:
    """A webhook receiver on 127.0.0.1: answers each POST with the next scripted status
    (then 200) and keeps every request it was sent."""

    def __init__(
        self, port: int = 0, statuses: list[int] | None = None, *, hold_first: bool = False
    ) -> None:
        self.requests: list[dict[str, Any]] = []
        self.gets = 0
        self.statuses = list(statuses or [])
        self.lock = threading.Lock()
        self.arrived = threading.Event()
        """Set when the first request came in."""
        self.release = threading.Event()
        """With ``hold_first``: the first request is answered only once this is set."""
        if not hold_first:
            self.release.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.requests.append(
                        {
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "body": json.loads(body),
                        }
                    )
                    status = outer.statuses.pop(0) if outer.statuses else 200
                    first = not outer.arrived.is_set()
                    outer.arrived.set()
                if first:
                    outer.release.wait(10)
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                with outer.lock:
                    outer.gets += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def keys(self) -> list[str]:
        with self.lock:
            return [r["headers"]["idempotency-key"] for r in self.requests]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _keys(settings: Settings) -> ProjectionKeys:
    return ProjectionKeys(settings.redis_key_prefix, NOTIFY, settings.events_topic)


def _deliveries(client: redis.Redis, settings: Settings) -> dict[str, dict[str, Any]]:
    k = _keys(settings)
    out: dict[str, dict[str, Any]] = {}
    for p in range(settings.partitions):
        for ident, raw in client.hgetall(k.deliveries(p)).items():
            out[ident.decode()] = json.loads(raw)
    return out


def _attempts(client: redis.Redis, settings: Settings, ident: str) -> list[dict[str, Any]]:
    k = _keys(settings)
    for p in range(settings.partitions):
        got = client.lrange(k.attempts(p, ident), 0, -1)
        if got:
            return [json.loads(a) for a in got]
    return []


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _catch_up(settings: Settings, client: redis.Redis) -> None:
    ProjectionRunner(settings, client, [NOTIFY]).catch_up(timeout_s=60)


def _deliver_until(notifier: Notifier, cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "notifications not settled in time"
        notifier.deliver_due()
        time.sleep(0.02)


# --------------------------------------------------------------------------- deadlines


def test_a_request_records_its_deadline_as_an_absolute_time(test_settings: Settings) -> None:
    before = datetime.now(UTC)
    with runlog.open_run(tenant="t1", settings=test_settings) as run:
        with_deadline = run.request_approval("refund above 50 EUR", deadline_s=90)
        without = run.request_approval("no hurry")
        with pytest.raises(ValueError):
            run.request_approval("bad", deadline_s=0)
        with pytest.raises(ValueError):
            run.request_approval("bad", deadline_s=float("nan"))
        run_id = run.run_id
    after = datetime.now(UTC)
    # What the log says, read back by a new owner.
    with runlog.open_run(run_id, tenant="t1", settings=test_settings) as again:
        due = again.state.approvals[with_deadline].due_at
        assert due is not None
        assert before + timedelta(seconds=90) <= due <= after + timedelta(seconds=90)
        assert again.state.approvals[without].due_at is None


def test_the_asyncio_run_records_a_deadline_too(test_settings: Settings) -> None:
    async def main() -> tuple[str, datetime | None]:
        async with runlog.aio.open_run(tenant="t1", settings=test_settings) as run:
            ap = await run.request_approval("async ask", deadline_s=30)
            return ap, run.state.approvals[ap].due_at

    _, due = asyncio.run(main())
    assert due is not None and due > datetime.now(UTC) + timedelta(seconds=20)


def test_an_escalated_call_takes_the_default_deadline(test_settings: Settings) -> None:
    s = test_settings.model_copy(update={"approval_deadline_s": 600.0})

    @runlog.tool(risk="irreversible")
    def wire(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise TimeoutError("bank did not answer after accepting the request")

    with (
        runlog.open_run(tenant="t1", tools=[wire], settings=s) as run,
        pytest.raises(Escalated) as raised,
    ):
        run.call_tool("wire", {"amount": 5})
    # The call's outcome is unknown and the tool cannot say: a person decides, by a deadline.
    with runlog.open_run(run.run_id, tenant="t1", tools=[wire], settings=s) as again:
        approval = again.state.approvals[str(raised.value.approval_id)]
        assert approval.kind == "uncertain_call" and approval.approved is None
        assert approval.due_at is not None
        left = (approval.due_at - datetime.now(UTC)).total_seconds()
        assert 500 < left <= 600


# --------------------------------------------------------------------------- delivery


def test_a_webhook_that_fails_twice_gets_three_attempts_and_one_delivery(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings.model_copy(update={**FAST, "ui_url": "https://console.example/"})
    rec = Receiver(statuses=[503, 500])
    try:
        with runlog.open_run(tenant="t1", settings=s) as run:
            ap = run.request_approval("ship order 42?", deadline_s=3600)
            due = run.state.approvals[ap].due_at
        ident = identity("t1", run.run_id, ap)
        _catch_up(s, redis_client)
        notifier = Notifier(redis_client, s, Webhook(rec.url, timeout_s=1.0))
        _deliver_until(
            notifier, lambda: _deliveries(redis_client, s)[ident]["status"] == "delivered"
        )
        notifier.deliver_due()  # nothing left: no fourth request
    finally:
        rec.close()
    assert rec.keys() == [ident, ident, ident]  # the same Idempotency-Key on every attempt
    body = rec.requests[-1]["body"]
    assert body["tenant"] == "t1" and body["run_id"] == run.run_id
    assert body["approval_id"] == ap and body["reason"] == "ship order 42?"
    assert body["kind"] == "action" and body["id"] == ident
    assert due is not None and body["due_at"] == due.isoformat()
    assert body["url"] == f"https://console.example/runs/{run.run_id}"
    assert rec.requests[0]["headers"]["content-type"] == "application/json"
    d = _deliveries(redis_client, s)[ident]
    assert d["status"] == "delivered" and d["attempts"] == 3
    assert d["delivered_at"] is not None and "500" in d["last_error"]
    attempts = _attempts(redis_client, s, ident)
    assert [a["outcome"] for a in attempts] == ["retry", "retry", "delivered"]
    assert [a["status"] for a in attempts] == [503, 500, 200]


def test_a_refusal_is_not_retried_and_a_python_hook_is_retried(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings.model_copy(update=FAST)
    rec = Receiver(statuses=[404])
    try:
        with runlog.open_run(tenant="t1", settings=s) as run:
            ap = run.request_approval("who is there?")
        _catch_up(s, redis_client)
        ident = identity("t1", run.run_id, ap)
        notifier = Notifier(redis_client, s, Webhook(rec.url, timeout_s=1.0))
        _deliver_until(notifier, lambda: _deliveries(redis_client, s)[ident]["status"] == "failed")
        notifier.deliver_due()
    finally:
        rec.close()
    assert len(rec.requests) == 1  # a 404 will not change by asking again
    assert _deliveries(redis_client, s)[ident]["attempts"] == 1

    # A redirect is not followed (urllib would turn the POST into a bodiless GET).
    rec = Receiver(statuses=[302])
    try:
        with runlog.open_run(tenant="t1", settings=s) as run:
            moved = identity("t1", run.run_id, run.request_approval("moved?"))
        _catch_up(s, redis_client)
        notifier = Notifier(redis_client, s, Webhook(rec.url, timeout_s=1.0))
        _deliver_until(notifier, lambda: _deliveries(redis_client, s)[moved]["status"] == "failed")
    finally:
        rec.close()
    assert len(rec.requests) == 1 and rec.gets == 0
    assert "302" in _deliveries(redis_client, s)[moved]["last_error"]

    got: list[dict[str, Any]] = []

    def hook(notification: dict[str, Any]) -> None:
        got.append(notification)
        if len(got) == 1:
            raise ConnectionError("chat service restarting")

    with runlog.open_run(tenant="t2", settings=s) as run2:
        ap2 = run2.request_approval("second")
    _catch_up(s, redis_client)
    ident2 = identity("t2", run2.run_id, ap2)
    py = Notifier(redis_client, s, hook)
    _deliver_until(py, lambda: _deliveries(redis_client, s)[ident2]["status"] == "delivered")
    assert [n["id"] for n in got] == [ident2, ident2]
    assert "ConnectionError" in _deliveries(redis_client, s)[ident2]["last_error"]


def test_loops_sharing_the_queue_deliver_each_notification_once(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """Two loops, a slow hook, short claims: a claim covers one delivery, so a loop never
    holds a notification it will not reach before its claim runs out."""
    s = test_settings.model_copy(update=FAST)
    with runlog.open_run(tenant="t1", settings=s) as run:
        asked = [run.request_approval(f"ask {i}") for i in range(4)]
    _catch_up(s, redis_client)
    got: list[str] = []
    lock = threading.Lock()

    def slow(notification: dict[str, Any]) -> None:
        time.sleep(0.6)
        with lock:
            got.append(notification["approval_id"])

    loops = [Notifier(redis_client, s, slow, claim_s=1.0, poll_s=0.05) for _ in range(2)]
    for loop in loops:
        loop.start()
    try:
        _wait("every request notified", lambda: len(set(got)) == len(asked))
        time.sleep(1.5)  # past every claim: a second delivery would have started by now
    finally:
        for loop in loops:
            loop.stop()
    assert sorted(got) == sorted(asked)


def _log_since(log_path: Path, offset: int) -> str:
    with log_path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _runner(settings: Settings, group: str, url: str, log_path: Path) -> subprocess.Popen[bytes]:
    out = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "runlog.cli", "project", NOTIFY, "--group", group],
        env=env_for(
            settings,
            RUNLOG_NOTIFY_WEBHOOK_URL=url,
            RUNLOG_NOTIFY_BACKOFF_S="0.1",
            RUNLOG_NOTIFY_BACKOFF_CAP_S="0.3",
            RUNLOG_NOTIFY_TIMEOUT_S="1",
            RUNLOG_NOTIFY_MAX_ATTEMPTS="1000",
        ),
        stdout=out,
        stderr=out,
    )


def test_one_notification_per_request_through_sigkill_redelivery_and_rebuild(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> None:
    s = test_settings
    port = _free_port()  # nothing listens yet: every attempt is refused
    url = f"http://127.0.0.1:{port}/hook"
    group = unique_group("notify")
    log_path = tmp_path / "runner.log"
    asked: list[str] = []
    with runlog.open_run(tenant="t1", settings=s) as run:
        for i in range(3):
            asked.append(identity("t1", run.run_id, run.request_approval(f"ask {i}")))
        decided_ap = run.request_approval("decided while no one listens")
        asked_decided = identity("t1", run.run_id, decided_ap)
    with runlog.open_run(tenant="t2", settings=s) as other:
        asked.append(identity("t2", other.run_id, other.request_approval("other tenant")))

    proc = _runner(s, group, url, log_path)
    try:
        # Queued (in the transaction that moved the position) and failing to deliver.
        _wait(
            "every notification queued and refused at least once",
            lambda: all(
                _deliveries(redis_client, s).get(i, {}).get("attempts", 0) >= 1
                for i in [*asked, asked_decided]
            ),
        )
        # A person decides one before anyone heard of it: its notification is dropped.
        with runlog.open_run(run.run_id, tenant="t1", settings=s) as again:
            again.decide(decided_ap, approved=False, decided_by="alice", note="not now")
        _wait(
            "the decided request's notification dropped",
            lambda: _deliveries(redis_client, s)[asked_decided]["status"] == "dropped",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        rec = Receiver(port=port)
        try:
            proc = _runner(s, group, url, log_path)
            _wait(
                "every notification delivered",
                lambda: all(
                    _deliveries(redis_client, s)[i]["status"] == "delivered" for i in asked
                ),
            )
            assert sorted(rec.keys()) == sorted(asked)  # one each; none for the decided one
            d = _deliveries(redis_client, s)[asked_decided]
            assert d["dropped_because"] == "decided before delivery"
            assert d["decision"]["decided_by"] == "alice"
            assert stop(proc) == 0

            # Every record delivered again from offset zero (a new group, no Kafka offsets,
            # and positions gone back): the runs' stored offsets say each one is applied.
            k = _keys(s)
            for p in range(s.partitions):
                if redis_client.exists(k.pos(p)):
                    redis_client.set(k.pos(p), -1)
            proc = _runner(s, unique_group("again"), url, log_path)
            with runlog.open_run(tenant="t3", settings=s) as late:
                fresh = identity("t3", late.run_id, late.request_approval("after restarts"))
            _wait(
                "the new request delivered",
                lambda: _deliveries(redis_client, s).get(fresh, {}).get("status") == "delivered",
            )
            assert stop(proc) == 0
            assert sorted(rec.keys()) == sorted([*asked, fresh])

            # A rebuild refolds every request from offset zero and queues nothing.
            now = datetime.now(UTC)
            pending_before = queries.approvals_report(redis_client, s, now=now).pending
            stored_before = queries.dump_projection(redis_client, s, NOTIFY)
            rebuild(redis_client, s, [NOTIFY])
            assert queries.dump_projection(redis_client, s, NOTIFY) == stored_before
            seen = log_path.stat().st_size
            proc = _runner(s, group, url, log_path)
            # Its partitions assigned (a loaded machine may take seconds to get there),
            # then long enough for several delivery passes.
            _wait("the runner assigned", lambda: "assigned" in _log_since(log_path, seen))
            time.sleep(2.0)
            assert stop(proc) == 0
            assert sorted(rec.keys()) == sorted([*asked, fresh])
            assert queries.approvals_report(redis_client, s, now=now).pending == pending_before
        finally:
            rec.close()
    finally:
        stop(proc, signal.SIGKILL)
    assert "Traceback" not in log_path.read_text()


def test_a_delivery_killed_in_flight_is_sent_again_with_the_same_key(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> None:
    """At least once: the hook took it, the process died before recording that; after the
    claim times out a new process delivers it again, and the receiver sees the same key."""
    s = test_settings
    rec = Receiver(hold_first=True)
    log_path = tmp_path / "runner.log"
    group = unique_group("inflight")
    try:
        with runlog.open_run(tenant="t1", settings=s) as run:
            ident = identity("t1", run.run_id, run.request_approval("approve the refund?"))
        proc = _runner(s, group, rec.url, log_path)
        try:
            assert rec.arrived.wait(60), log_path.read_text()[-2000:]
            proc.send_signal(signal.SIGKILL)  # while its request waits for an answer
            proc.wait(timeout=10)
            rec.release.set()
            assert _deliveries(redis_client, s)[ident]["status"] == "queued"  # claimed
            proc = _runner(s, group, rec.url, log_path)
            _wait(
                "the notification delivered by the new process",
                lambda: _deliveries(redis_client, s)[ident]["status"] == "delivered",
            )
            assert stop(proc) == 0
        finally:
            stop(proc, signal.SIGKILL)
    finally:
        rec.close()
    assert rec.keys() == [ident, ident]
    assert rec.requests[0]["body"] == rec.requests[1]["body"]
    d = _deliveries(redis_client, s)[ident]
    assert d["attempts"] == 1  # the killed attempt's outcome was never known, so not counted
    assert [a["outcome"] for a in _attempts(redis_client, s, ident)] == ["delivered"]


def test_a_projection_catching_up_does_not_notify_what_was_decided_further_on(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Any
) -> None:
    """A notify projection started on a log that already holds requests: one decided many
    batches later is never notified; one still waiting is, once the runner caught up."""
    s = test_settings.model_copy(update=FAST)
    with runlog.open_run(tenant="t1", settings=s) as run:
        decided = run.request_approval("decided long ago")
        waiting = run.request_approval("still waiting")
        for i in range(3000):
            run.emit(EventType.USER_MESSAGE, content=f"message {i}")
        run.barrier()
        run.decide(decided, approved=True, decided_by="carol")
    got: list[str] = []
    runner = ProjectionRunner(
        s,
        redis_client,
        [NOTIFY],
        group=unique_group("backlog"),
        batch_size=5,
        notify=lambda n: got.append(n["approval_id"]),
    )
    runner.catch_up_batch = 5  # a long backlog: many transactions before the decision
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        _wait("the waiting request notified", lambda: waiting in got)
        time.sleep(0.5)
    finally:
        runner.stop()
        thread.join(timeout=30)
    assert got == [waiting]
    d = _deliveries(redis_client, s)[identity("t1", run.run_id, decided)]
    assert d["status"] == "dropped" and d["attempts"] == 0


# --------------------------------------------------------------------------- the list


def test_runlog_approvals_lists_exactly_the_overdue_ones(
    test_settings: Settings,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = test_settings
    with runlog.open_run(tenant="t1", settings=s) as run:
        late = run.request_approval("past due", deadline_s=0.5)
        soon = run.request_approval("due in an hour", deadline_s=3600)
        never = run.request_approval("no deadline")
        done = run.request_approval("decided", deadline_s=0.5)
        run.decide(done, approved=True, decided_by="bob")
    with runlog.open_run(tenant="t2", settings=s) as other:
        other_late = other.request_approval("other tenant, past due", deadline_s=0.5)
    _catch_up(s, redis_client)
    time.sleep(0.6)
    for name, value in (
        ("RUNLOG_TOPIC_PREFIX", s.topic_prefix),
        ("RUNLOG_REDIS_KEY_PREFIX", s.redis_key_prefix),
        ("RUNLOG_PARTITIONS", str(s.partitions)),
    ):
        monkeypatch.setenv(name, value)

    def listed(*args: str) -> list[dict[str, Any]]:
        capsys.readouterr()
        assert cli_main(["approvals", "--json", *args]) == 0
        rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["pending"]
        return rows

    assert [a["approval_id"] for a in listed("--overdue")] == [late, other_late]
    assert [a["approval_id"] for a in listed("--overdue", "--tenant", "t1")] == [late]
    assert [a["approval_id"] for a in listed("--tenant", "t1")] == [late, soon, never]
    row = listed("--tenant", "t1")[0]
    assert row["reason"] == "past due" and row["overdue"] and row["overdue_s"] > 0
    assert row["requested_by"] and row["requested_at"] and row["due_at"]
    assert row["notification"]["status"] == "queued"  # no hook delivered it yet
    capsys.readouterr()
    assert cli_main(["approvals", "--overdue"]) == 0
    text = capsys.readouterr()
    assert late in text.out and other_late in text.out
    assert soon not in text.out and never not in text.out and done not in text.out
    assert "2 overdue approval request(s)" in text.err


def test_the_console_shows_when_each_decision_is_due(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings
    with runlog.open_run(tenant="acme", settings=s) as run:
        late = run.request_approval("past due", deadline_s=0.5)
        soon = run.request_approval("due in an hour", deadline_s=3600)
        never = run.request_approval("no deadline")
    time.sleep(0.6)
    with projecting(s, redis_client), console(s) as base:
        web = httpx.Client(base_url=base, timeout=30)
        auth = {"Authorization": f"Bearer {TOKEN_ADMIN}"}

        def rows() -> dict[str, str]:
            page = web.get("/approvals", headers=auth).text
            row = r'<td class="mono">(ap-[0-9a-f]+)</td>.*?<td class="due">([^<]*)<'
            found = re.findall(row, page, flags=re.S)
            return dict(found)

        due = wait_for("the three requests listed", lambda: len(rows()) == 3 and rows())
        assert due[late].startswith("OVERDUE ")
        assert due[soon] in ("in 59m", "in 60m")
        assert due[never] == "-"
        run_page = web.get(f"/runs/{run.run_id}", headers=auth).text
        assert run_page.count('class="due"') == 2 and "due OVERDUE" in run_page
