"""An open that waits for a dead owner's lease says whose it is and until when (the
owner's pid and host, the lease's end), at once and again while it waits."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from workers.common import worker_env

import runlog
from runlog._settings import Settings
from runlog.producers import _opening as opening

pytestmark = pytest.mark.timeout(120)

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
