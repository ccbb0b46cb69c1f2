"""The demo end to end, exactly as ``make demo`` runs it, and a decision's inbox.

The end-to-end test runs ``runlog demo`` (three ``runlog worker`` processes it SIGKILLs and
SIGSTOPs/SIGCONTs at random, no supervisor) against the test stack on the test's own
topics and Redis prefix, and reads its JSON report: every run finished, each effect once on
the non-idempotent ledger (a paused worker's late requests included), every run verifies,
and the kills and pauses were real signals to worker processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from fleet_support import fleet_env
from workers.common import times_out_first

from runlog._settings import Settings

RUNS = 8
KILLS = 2
PAUSES = 2


@pytest.fixture(scope="module")
def demo(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One demo (8 runs, 2 kills) on the test stack; its JSON report, exit and output."""
    from runlog._topics import delete_topics, ensure_topics

    prefix = f"t-demo-{uuid.uuid4().hex[:8]}"
    s = settings.model_copy(
        update={
            "topic_prefix": prefix,
            "redis_key_prefix": prefix,
            "partitions": 3,
            "lease_ttl_ms": 3000,
        }
    )
    ensure_topics(s).raise_for_drift()
    report = Path(tmp_path_factory.mktemp("demo")) / "report.json"
    cmd = [sys.executable, "-m", "runlog.cli", "demo", "--runs", str(RUNS), "--kills"]
    cmd += [str(KILLS), "--pauses", str(PAUSES), "--report", str(report)]
    try:
        proc = subprocess.run(cmd, env=fleet_env(s), capture_output=True, text=True, timeout=240)
    finally:
        delete_topics(s, [s.events_topic, s.quarantine_topic, s.lifecycle_topic])
    assert report.exists(), f"no report; exit {proc.returncode}\n{proc.stdout[-4000:]}"
    data: dict[str, Any] = json.loads(report.read_text())
    data["_exit"], data["_stdout"] = proc.returncode, proc.stdout + proc.stderr[-3000:]
    return data


@pytest.mark.timeout(300)
def test_the_demo_finishes_every_run_by_itself_each_effect_once(demo: dict[str, Any]) -> None:
    assert demo["_exit"] == 0, demo["_stdout"][-4000:]
    assert demo["ok"], demo["failures"]
    assert [(r["status"], r["outcome"]) for r in demo["runs"]] == [("finished", "succeeded")] * RUNS
    # Three lines and a fee per order, each applied once by the ledger that does not dedupe.
    assert demo["effects"] == {"expected": 4 * RUNS, "applied": 4 * RUNS, "each_once": True}
    assert set(demo["counts"].values()) == {1}
    assert all(set(r["effects"].values()) == {1} and len(r["effects"]) == 4 for r in demo["runs"])
    assert demo["verified"] == RUNS
    assert "OK: every run finished by itself, each effect once" in demo["_stdout"]


@pytest.mark.timeout(300)
def test_the_demo_kills_are_sigkills_of_worker_processes(demo: dict[str, Any]) -> None:
    assert len(demo["killed"]) == KILLS
    assert all(k["rc"] == -signal.SIGKILL for k in demo["killed"])
    assert len({k["pid"] for k in demo["killed"]}) == KILLS


@pytest.mark.timeout(300)
def test_the_demo_pauses_workers_and_their_late_requests_never_double_an_effect(
    demo: dict[str, Any],
) -> None:
    assert len(demo["paused"]) == PAUSES
    assert "SIGSTOP" in demo["_stdout"] and "SIGCONT" in demo["_stdout"]
    # Each pause froze a worker inside a call (its STARTED in the log, no completion yet).
    assert {p["run_id"] for p in demo["paused"]} <= {r["run_id"] for r in demo["runs"]}
    # Whatever a frozen worker had in flight landed after the takeover: refused, never applied.
    assert set(demo["counts"].values()) == {1}


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
