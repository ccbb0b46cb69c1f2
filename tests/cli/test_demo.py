"""The demo: its ledger's evidence rules, and the supervised run end to end.

The end-to-end test runs ``python -m runlog.demo run`` exactly as ``make demo`` does (a
supervisor process, a ledger process, worker processes it SIGKILLs, SIGSTOPs and
restarts) against the test stack, on its own topics and Redis prefix.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from workers.common import times_out_first

from runlog.demo.agent import EXIT_FENCED, LedgerClient
from runlog.demo.ledger import Faults, LedgerServer, make_server
from runlog.producers.tools import Absent, Conflict, Match, ToolError, Unavailable
from runlog.settings import Settings
from runlog.topics import ensure_topics

SEED = 11
KILLS = 2


def _cleanup(s: Settings) -> None:
    from confluent_kafka.admin import AdminClient

    with contextlib.suppress(Exception):  # best effort: the broker keeps running
        AdminClient(s.kafka_common()).delete_topics(
            [s.events_topic, s.quarantine_topic], operation_timeout=10
        )
    client = redis.Redis.from_url(s.redis_url)
    try:
        keys = list(client.scan_iter(match=f"{s.redis_key_prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


# ------------------------------------------------------------------------- the ledger


@pytest.fixture
def ledger(test_settings: Settings) -> Iterator[tuple[LedgerServer, list[int]]]:
    faults = Faults(slow={"C-SLOW": 1.0}, lookup_unavailable={"C-DOWN"})
    server = make_server(test_settings, f"t{uuid.uuid4().hex[:6]}", faults=faults)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    epoch = [1]
    yield server, epoch
    server.shutdown()
    server.server_close()
    server.ledger.redis.close()


def _client(server: LedgerServer, epoch: list[int], timeout_s: float = 2.0) -> LedgerClient:
    return LedgerClient(
        f"http://127.0.0.1:{server.server_port}",
        "run-1",
        timeout_s=timeout_s,
        fencing_token=lambda: epoch[0],
    )


def _args(cid: str, amount: int = 1_000) -> dict[str, Any]:
    return {
        "correction_id": cid,
        "ledger": 3,
        "account": "2200",
        "amount_cents": amount,
        "period": "2025-Q3",
    }


def _effects(server: LedgerServer) -> dict[str, int]:
    effects: dict[str, int] = server.ledger.effects()["effects"]
    return effects


def test_the_lookup_gives_each_kind_of_evidence(ledger: tuple[LedgerServer, list[int]]) -> None:
    server, epoch = ledger
    client = _client(server, epoch)
    client.post_plain(_args("C-1"), idempotency_key="k1")
    found = client.lookup_plain(_args("C-1"), idempotency_key="k1")
    assert found == Match("C-1 applied: ledger 3 account 2200 £10.00 2025-Q3")
    assert isinstance(client.lookup_plain(_args("C-1", 2_000), idempotency_key="k"), Conflict)
    assert isinstance(client.lookup_plain(_args("C-none"), idempotency_key="k"), Absent)
    assert isinstance(client.lookup_plain(_args("C-DOWN"), idempotency_key="k"), Unavailable)
    # The plain endpoint really does not deduplicate: that is why it needs the lookup.
    client.post_plain(_args("C-1"), idempotency_key="k1")
    assert _effects(server)["correction:C-1"] == 2


def test_a_request_past_its_deadline_never_commits_so_absence_is_final(
    ledger: tuple[LedgerServer, list[int]],
) -> None:
    server, epoch = ledger
    client = _client(server, epoch, timeout_s=0.3)
    with pytest.raises(OSError):  # the client gives up; the server is still sleeping
        client.post_plain(_args("C-SLOW"), idempotency_key="k")
    assert isinstance(client.lookup_plain(_args("C-SLOW"), idempotency_key="k"), Absent)
    client.post_plain(_args("C-SLOW"), idempotency_key="k")  # the retry the rule allows
    # Let the slow original reach its commit script: the deadline refuses it.
    threading.Event().wait(1.2)
    assert _effects(server)["correction:C-SLOW"] == 1


def test_a_lookup_by_a_newer_owner_fences_the_older_owners_requests(
    ledger: tuple[LedgerServer, list[int]],
) -> None:
    server, epoch = ledger
    old = _client(server, [1])
    epoch[0] = 2
    new = _client(server, epoch)
    assert isinstance(new.lookup_plain(_args("C-2"), idempotency_key="k"), Absent)
    with pytest.raises(ToolError, match="stale fencing token"):
        old.post_plain(_args("C-2"), idempotency_key="k")
    with pytest.raises(ToolError, match="stale fencing token"):
        old.file_ticket({"ref": "EXC-9", "subject": "s", "body": "b"}, idempotency_key="k")
    assert "correction:C-2" not in _effects(server)
    assert "ticket:EXC-9" not in _effects(server)


def test_the_idempotent_endpoint_returns_the_first_response(
    ledger: tuple[LedgerServer, list[int]],
) -> None:
    server, epoch = ledger
    client = _client(server, epoch)
    for _ in range(3):
        client.post_idempotent(_args("C-3"), idempotency_key="key-3")
    assert _effects(server)["correction:C-3"] == 1
    with pytest.raises(ToolError, match="different request"):
        client.post_idempotent(_args("C-3", 5), idempotency_key="key-3")


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def demo(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One supervised demo run (seed 11, 2 kills + the pause); its JSON report."""
    prefix = f"t-demo-{uuid.uuid4().hex[:8]}"
    s = settings.model_copy(
        update={"topic_prefix": prefix, "redis_key_prefix": prefix, "partitions": 3}
    )
    ensure_topics(s).raise_for_drift()
    report = Path(tmp_path_factory.mktemp("demo")) / "report.json"
    env = dict(
        os.environ,
        RUNLOG_BOOTSTRAP_SERVERS=s.bootstrap_servers,
        RUNLOG_REDIS_URL=s.redis_url,
        RUNLOG_TOPIC_PREFIX=prefix,
        RUNLOG_REDIS_KEY_PREFIX=prefix,
        RUNLOG_PARTITIONS="3",
    )
    cmd = [sys.executable, "-m", "runlog.demo", "run", "--seed", str(SEED), "--kills"]
    cmd += [str(KILLS), "--timeout", "200", "--no-projections", "--report", str(report)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=260)
        assert report.exists(), f"no report; exit {proc.returncode}\n{proc.stdout[-4000:]}"
        data: dict[str, Any] = json.loads(report.read_text())
        data["_exit"], data["_stdout"] = proc.returncode, proc.stdout
        yield data
    finally:
        _cleanup(s)


@pytest.mark.timeout(300)
def test_demo_applies_every_effect_exactly_once_and_verifies(demo: dict[str, Any]) -> None:
    assert demo["_exit"] == 0, demo["_stdout"][-4000:]
    assert demo["ok"], demo["failures"]
    assert demo["run"]["status"] == "finished" and demo["run"]["outcome"] == "succeeded"
    assert {cid: c["applied"] for cid, c in demo["corrections"].items()} == {
        f"C-0{i}": 1 for i in range(1, 10)
    }
    assert {ref: t["filed"] for ref, t in demo["tickets"].items()} == {"EXC-1": 1, "EXC-2": 1}
    assert demo["verify"]["ok"], demo["verify"]["text"]
    # The seeded faults exercised each kind of evidence and both decisions of the person.
    outcomes = {r["outcome"] for u in demo["uncertain"] for r in u["reconciliations"]}
    assert {"match", "absent", "unavailable", "no_reconciler", "decided"} <= outcomes
    decided = {(d["kind"], d["approved"]) for d in demo["decisions"]}
    assert {("action", True), ("uncertain_call", True), ("uncertain_call", False)} <= decided
    assert demo["run"]["compactions"] >= 1
    assert all(r["gap_ms"] is not None for r in demo["resumptions"])


@pytest.mark.timeout(300)
def test_demo_kill_points_are_sigkills_of_separate_worker_processes(
    demo: dict[str, Any],
) -> None:
    attempts = demo["attempts"]
    killed = [a for a in attempts if a["killed"]]
    assert len(killed) == KILLS
    assert all(a["rc"] == -signal.SIGKILL for a in killed)
    pids = [a["pid"] for a in attempts]
    assert len(set(pids)) == len(pids), "every attempt is a new process"
    assert demo["supervisor_pid"] not in pids
    # The paused worker came back after a successor took over and was fenced.
    fenced = [p for p in demo["pauses"] if p["fenced"]]
    assert fenced and all(p["paused_exit"] == EXIT_FENCED for p in fenced)
    assert all(p["paused_pid"] != p["successor_pid"] for p in fenced)


# ------------------------------------------------------------- decisions via the inbox


def test_a_decision_queued_while_a_worker_held_the_run_settles_the_call_on_resume(
    test_settings: Settings,
) -> None:
    """Regression: a queued decision on an uncertain call was only read by an action wait."""
    import runlog

    notify, sent = times_out_first("notify_regulator", 1, "sent", risk="irreversible")
    run = runlog.open_run(tenant="acme", tools=[notify], settings=test_settings)
    with pytest.raises(runlog.Escalated) as esc:
        run.call_tool("notify_regulator", {"n": 1})
    approval_id = esc.value.approval_id
    assert approval_id is not None
    how = runlog.decide(
        run.run_id,
        approval_id,
        approved=True,
        decided_by="alice",
        note="not sent",
        tenant="acme",
        settings=test_settings,
    )
    assert how == "queued"  # the worker still holds the run
    run.close()
    again = runlog.open_run(run.run_id, tenant="acme", tools=[notify], settings=test_settings)
    with again:
        assert not again.state.open_calls, "the queued decision must settle the call"
        assert again.state.approvals[approval_id].approved is True
    assert len(sent) == 2
