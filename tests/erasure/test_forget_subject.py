"""``runlog forget`` finds a data subject's runs in the log and forgets them together, with
encryption on, on the real stack.

- ``forget --run A`` of a subject with another run B (in progress, held by a live owner) is
  refused, naming B, and changes nothing: B's content still reads, its owner goes on.
  ``--whole-subject`` forgets both: B is stopped (its owner fenced) and records its erasure.
- Projection services started without the key (encryption was off when they started) fold
  the sealed runs' structure, mark them ``sealed: no key``, count them and keep going; with
  them behind or stopped, ``forget --subject`` finds the runs in the events topic, says
  where it looked, and says which projection has not purged yet (exit 1), never "no run".
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from erasure.test_forget_sealed import TENANT, _env, _run
from fleet_support import Fleet, effects, wait_finished
from projections_support import env_for, stop, wait_assigned, wait_caught_up
from pydantic import SecretStr

import runlog
from runlog._settings import Settings
from runlog.errors import SubjectHasOtherRuns
from runlog.log import _keys as keys_mod
from runlog.log._keys import keys_for, new_kek
from runlog.log._replay import replay
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def sealed(test_settings: Settings) -> Iterator[Settings]:
    yield test_settings.model_copy(
        update={"encryption": "on", "kek": SecretStr(f"k1:{new_kek()}"), "keys_refresh_ms": 200}
    )
    keys_mod.close_shared()


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_forget_of_one_run_of_a_subject_with_a_run_in_progress_is_refused_naming_it(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    s = sealed
    subject = f"user-{uuid.uuid4().hex[:8]}"
    marker = f"SIB{uuid.uuid4().hex}"
    ended = _run(s, marker, subject)
    store = keys_for(s)
    assert store is not None
    held = store.key_ids(TENANT, subject)
    with runlog.open_run(tenant=TENANT, settings=s, subject=subject) as live:
        live.append(EventType.USER_MESSAGE, content=f"{marker}-live")

        with pytest.raises(SubjectHasOtherRuns) as refused:
            runlog.forget(run_id=ended, tenant=TENANT, reason="art. 17", by="dpo", settings=s)
        assert refused.value.others == [live.run_id] and refused.value.subject == subject
        done = _cli(
            _env(s),
            *("forget", "--run", ended, "--tenant", TENANT, "--reason", "x", "--by", "dpo"),
        )
        assert done.returncode == 1 and live.run_id in done.stderr, done.stderr
        # Nothing was done: the key is there, neither log records an erasure, the owner
        # goes on and its run reads in clear.
        assert store.key_ids(TENANT, subject) == held
        assert replay(s, redis_client, ended, tenant=TENANT).state.erased is None
        live.append(EventType.USER_MESSAGE, content="still mine")
        assert any(
            marker in m.content
            for m in replay(s, redis_client, live.run_id, tenant=TENANT).state.messages
        )

        report = runlog.forget(
            run_id=ended,
            whole_subject=True,
            tenant=TENANT,
            reason="art. 17",
            by="dpo",
            wait_s=1,
            settings=s,
        )
        by_run = {r.run_id: r for r in report.runs}
        assert sorted(by_run) == sorted([ended, live.run_id])
        assert by_run[live.run_id].terminated
        assert sorted(report.keys_shredded) == sorted(held)
        with pytest.raises(runlog.Fenced):
            live.append(EventType.USER_MESSAGE, content="after the forget")
    for rid in (ended, live.run_id):
        state = replay(s, redis_client, rid, tenant=TENANT).state
        assert state.erased is not None and state.erased.erased_by == "dpo"
    assert replay(s, redis_client, live.run_id, tenant=TENANT).state.outcome == "terminated"


@pytest.fixture
def keyless(
    sealed: Settings, unique_group: Any, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``runlog project all`` started before encryption was turned on: no key."""
    log = tmp_path / "keyless.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runlog.cli", "project", "all", "--group", unique_group("nk")],
            env=env_for(sealed),
            stdout=out,
            stderr=out,
        )
    try:
        wait_assigned(proc, str(log))
        yield proc, log
    finally:
        stop(proc)


def test_forget_finds_the_runs_in_the_log_when_the_projections_have_no_key_or_stopped(
    sealed: Settings,
    redis_client: redis.Redis,
    keyless: tuple[subprocess.Popen[bytes], Path],
) -> None:
    s = sealed
    proc, log = keyless
    subject = f"user-{uuid.uuid4().hex[:8]}"
    marker = f"NK{uuid.uuid4().hex}"
    first, second = _run(s, marker, subject), _run(s, marker, subject)
    wait_caught_up(redis_client, s)
    # The keyless service folded both sealed runs and goes on: it marks and counts them.
    assert proc.poll() is None, log.read_text()[-2000:]
    status = _cli(env_for(s), "project", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["projections"]["state"]["sealed_runs"] >= 2
    status = _cli(env_for(s), "project", "status")
    assert status.returncode == 0 and "sealed: no key 2 run(s)" in status.stdout, status.stdout
    shown = _cli(env_for(s), "state", first, "--tenant", TENANT, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["sealed"] == "no key"
    assert marker not in shown.stdout

    # The service stops; the subject gets a third run the index never sees.
    assert stop(proc) == 0, log.read_text()[-2000:]
    third = _run(s, marker, subject)

    done = _cli(
        _env(s),
        *("forget", "--subject", subject, "--tenant", TENANT, "--reason", "art. 17"),
        *("--by", "dpo", "--wait", "2", "--json"),
    )
    report = json.loads(done.stdout)
    assert sorted(r["run_id"] for r in report["runs"]) == sorted([first, second, third])
    assert report["keys_shredded"]
    assert "events topic" in report["checked"], report["checked"]
    # The stopped service has not purged its copies: said, and not a success.
    assert report["projections_purged"] is False and "state" in report["projections_behind"]
    assert done.returncode == 1
    for rid in (first, second, third):
        assert replay(s, redis_client, rid, tenant=TENANT).state.erased is not None

    # Restarted (still without the key), it folds the erasures: forget again completes.
    again = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runlog.cli",
            "project",
            "all",
            "--group",
            "nk-again-" + s.topic_prefix,
        ],
        env=env_for(s),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        done = _cli(
            _env(s),
            *("forget", "--subject", subject, "--tenant", TENANT, "--reason", "art. 17"),
            *("--by", "dpo", "--wait", "60"),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "already erased" in done.stdout and "looked in" in done.stdout
    finally:
        assert stop(again) == 0


def test_forget_of_a_subject_with_a_run_in_progress_on_a_live_worker(
    sealed: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A ``runlog worker`` is paying, step by step, in a run of the subject (another run of
    it ended): ``forget --subject`` terminates the live run (its worker is fenced at its next
    append and calls the tool no more), erases both, and the worker goes on serving."""
    s = sealed
    assert s.kek is not None
    subject = f"user-{uuid.uuid4().hex[:8]}"
    fleet = Fleet(s, tmp_path, RUNLOG_ENCRYPTION="on", RUNLOG_KEK=s.kek.get_secret_value())
    try:
        name = fleet.spawn()
        ended = runlog.start(
            "payer", {"to": "a", "steps": 1}, tenant=TENANT, settings=s, subject=subject
        )
        wait_finished(s, [ended], 60, fleet)
        live = runlog.start(
            "payer", {"to": "b", "steps": 400}, tenant=TENANT, settings=s, subject=subject
        )
        deadline = time.monotonic() + 60
        while len(replay(s, redis_client, live, tenant=TENANT).state.completed_calls) < 3:
            assert time.monotonic() < deadline, fleet.tail(name)
            time.sleep(0.1)

        report = runlog.forget(
            subject=subject, tenant=TENANT, reason="art. 17", by="dpo", wait_s=1, settings=s
        )
        by_run = {r.run_id: r for r in report.runs}
        assert sorted(by_run) == sorted([ended, live]) and by_run[live].terminated
        paid = effects(redis_client, s)
        time.sleep(1.0)  # twenty steps' worth: a worker still acting would have paid again
        assert effects(redis_client, s) == paid
        state = replay(s, redis_client, live, tenant=TENANT).state
        assert state.outcome == "terminated" and state.erased is not None
        other = runlog.start("payer", {"to": "c", "steps": 1}, tenant=TENANT, settings=s)
        (st,) = wait_finished(s, [other], 60, fleet).values()
        assert st.outcome == "succeeded" and fleet.procs[name].poll() is None
    finally:
        fleet.stop_all()


def test_forget_of_a_run_follows_its_fork_in_the_log_when_no_index_lists_it(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    """No projection service runs, so the run index knows neither the run nor its fork: the
    fork (it shares the run's subject) is found in the log and forgotten with it, not
    named as another run of the subject that blocks the forget."""
    s = sealed
    with runlog.open_run(tenant=TENANT, settings=s) as run:
        run.append(EventType.USER_MESSAGE, content="hello")
        at = run.state.seq
        run.finish("succeeded")
    child = runlog.fork(run.run_id, at_seq=at, tenant=TENANT, forked_by="t", settings=s).run_id
    report = runlog.forget(
        run_id=run.run_id, tenant=TENANT, reason="art. 17", by="dpo", wait_s=1, settings=s
    )
    assert sorted(r.run_id for r in report.runs) == sorted([run.run_id, child])
    assert "events topic" in report.checked
    for rid in (run.run_id, child):
        assert replay(s, redis_client, rid, tenant=TENANT).state.erased is not None


def test_a_run_already_erased_does_not_block_forgetting_a_later_run_of_its_subject(
    sealed: Settings, redis_client: redis.Redis
) -> None:
    s = sealed
    subject = f"user-{uuid.uuid4().hex[:8]}"
    old = _run(s, f"OLD{uuid.uuid4().hex}", subject)
    runlog.forget(subject=subject, tenant=TENANT, reason="art. 17", by="dpo", wait_s=1, settings=s)
    new = _run(s, f"NEW{uuid.uuid4().hex}", subject)
    report = runlog.forget(
        run_id=new, tenant=TENANT, reason="art. 17", by="dpo", wait_s=1, settings=s
    )
    assert [r.run_id for r in report.runs] == [new]
    assert replay(s, redis_client, new, tenant=TENANT).state.erased is not None
    assert replay(s, redis_client, old, tenant=TENANT).state.erased is not None


def test_a_projection_service_with_encryption_on_and_no_key_store_says_so_and_serves(
    sealed: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> None:
    s = sealed
    log = tmp_path / "nokek.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runlog.cli", "project", "all", "--group", unique_group("ek")],
            env=env_for(s, RUNLOG_ENCRYPTION="on"),
            stdout=out,
            stderr=out,
        )
    try:
        wait_assigned(proc, str(log))
        assert "no key store" in log.read_text(), log.read_text()[-2000:]
        rid = _run(s, f"EK{uuid.uuid4().hex}", f"user-{uuid.uuid4().hex[:8]}")
        wait_caught_up(redis_client, s)
        assert proc.poll() is None, log.read_text()[-2000:]
        shown = _cli(env_for(s), "state", rid, "--tenant", TENANT)
        assert shown.returncode == 0 and "sealed     no key" in shown.stdout, shown.stdout
    finally:
        assert stop(proc) == 0, log.read_text()[-2000:]
