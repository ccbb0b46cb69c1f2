"""Small things an operator meets on the way, each on the real stack where it needs one:
``runlog keys new-kek`` needs no argument, ``runlog uncertain --tenant`` shows one tenant's
calls, and an open that waits for a dead owner's lease says whose it is and until when."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from workers.common import worker_env

import runlog
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._keys import Keks, new_kek
from runlog.producers import _opening as opening

pytestmark = pytest.mark.timeout(120)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_new_kek_needs_no_argument_and_names_the_next_kek(settings: Settings) -> None:
    env = worker_env(settings)
    env.pop("RUNLOG_KEK", None)
    env.pop("RUNLOG_KEK_FILE", None)
    first = _cli(env, "keys", "new-kek")
    assert first.returncode == 0, first.stderr
    line = first.stdout.strip()
    assert Keks.parse(line, where="new-kek").current == "k1"
    # After k1 and k7 (an id of another form too), the next one is k8, and it is usable:
    # appended to RUNLOG_KEK it becomes the current KEK.
    env["RUNLOG_KEK"] = f"k1:{new_kek()},old:{new_kek()},k7:{new_kek()}"
    nxt = _cli(env, "keys", "new-kek")
    assert nxt.returncode == 0, nxt.stderr
    assert Keks.parse(env["RUNLOG_KEK"] + "," + nxt.stdout.strip(), where="t").current == "k8"
    named = _cli(env, "keys", "new-kek", "k2")
    assert named.stdout.startswith("k2:")
    bad = _cli(env, "keys", "new-kek", "a:b")
    assert bad.returncode == 2 and not bad.stdout


class Crash(BaseException):
    """Not an Exception: the owner dies between STARTED and any outcome."""


def _orphan_call(settings: Settings, tenant: str) -> str:
    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    tool = runlog.tool("refund", risk="irreversible")(dies)
    run = runlog.open_run(tenant=tenant, tools=[tool], settings=settings)
    with pytest.raises(Crash):
        run.call_tool("refund", {"order": tenant})
    run.lease.release()
    key = next(iter(run.state.open_calls))
    # A new owner without the tool: the call is uncertain in the log, and stays open.
    runlog.open_run(run.run_id, tenant=tenant, settings=settings).close()
    return key


def test_uncertain_accepts_tenant_and_lists_only_that_tenants_calls(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    ours, theirs = _orphan_call(test_settings, "acme"), _orphan_call(test_settings, "globex")
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    env = worker_env(test_settings)

    def listed(*args: str) -> set[str]:
        done = _cli(env, "uncertain", "--json", *args)
        assert done.returncode == 0, done.stderr
        return {c["idempotency_key"] for c in json.loads(done.stdout)["open"]}

    assert listed() == {ours, theirs}
    assert listed("--tenant", "acme") == {ours}
    assert listed("--tenant", "globex") == {theirs}
    assert listed("--tenant", "nobody") == set()
    text = _cli(env, "uncertain", "--tenant", "acme")
    assert text.returncode == 0 and ours in text.stdout and theirs not in text.stdout


HOLDER = """
import sys, time, runlog
run = runlog.open_run(sys.argv[1], tenant="acme")
print("held", flush=True)
time.sleep(600)
"""


def test_an_open_waiting_for_a_dead_owners_lease_says_whose_and_until_when(
    test_settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = test_settings.model_copy(update={"lease_ttl_ms": 4000})
    with runlog.open_run(tenant="acme", settings=s) as run:
        rid = run.run_id
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, rid],
        env=worker_env(s),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)  # the owner dies holding its lease
        holder.wait(10)
        killed_at = datetime.now(UTC)
        monkeypatch.setattr(opening, "LEASE_WAIT_REPORT_S", 1.0)
        caplog.set_level(logging.WARNING, logger="runlog.producers._opening")
        with runlog.open_run(rid, tenant="acme", settings=s, wait_s=30) as resumed:
            assert resumed.state.resumptions == 2  # the dead holder's, then this one
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
    waits = [
        r
        for r in caplog.records
        if r.name == "runlog.producers._opening"
        and isinstance(r.args, tuple)
        and r.args[0] == rid
        and "lease held by" in r.msg
    ]
    assert len(waits) >= 2, [r.getMessage() for r in caplog.records]  # at once, then again
    _, who, until, *_ = waits[0].args  # type: ignore[misc]
    assert f"pid {holder.pid}" in who and f"host {socket.gethostname()}" in who
    due = datetime.fromisoformat(until)
    # Until when: the dead owner's lease's end, within its TTL from the kill.
    assert killed_at <= due.replace(tzinfo=due.tzinfo or UTC)
    assert (due - killed_at).total_seconds() <= s.lease_ttl_ms / 1000 + 1
