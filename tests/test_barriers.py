"""The barrier rule under SIGKILL at every point of a loop of safe and irreversible calls.

Safe calls are pipelined (no wait), irreversible ones wait for their STARTED to be
confirmed before the effect and for their outcome before returning. Killing the worker at
each point in turn (before every produce, after every acknowledgement, after every effect)
and resuming it from the top must leave: every irreversible effect applied exactly once,
every call completed, the log sound and the run finished. The same loop runs on the sync
API and on ``runlog.aio``.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from workers.common import ROOT, Ledger, assert_log_sound, read_log, worker_env

from runlog.settings import Settings

WORKER = ROOT / "tests" / "workers" / "mixed_worker.py"
ROUNDS = 2


def _worker(
    settings: Settings, run_id: str, *, kill_at: int, aio: bool, points: Path | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(WORKER), "--run-id", run_id, "--kill-at", str(kill_at)]
    if aio:
        cmd.append("--aio")
    if points is not None:
        cmd += ["--points", str(points)]
    return subprocess.run(
        cmd, env=worker_env(settings), capture_output=True, text=True, timeout=120
    )


def _check(settings: Settings, ledger: Ledger, run_id: str, where: str) -> None:
    events = [rec.event for rec in read_log(settings, run_id)]
    state = assert_log_sound(events)
    assert state.status == "finished", f"{where}: run not finished ({state.status})"
    assert not state.open_calls, f"{where}: calls left open {sorted(state.open_calls)}"
    pays = {k for k in state.completed_calls if ledger.found(k) and "pay" in _name(events, k)}
    assert len(pays) == ROUNDS, f"{where}: irreversible calls completed: {sorted(pays)}"
    for key in pays:
        assert ledger.count(key) == 1, (
            f"{where}: irreversible effect {key} applied {ledger.count(key)} times"
        )
    looked = [k for k in state.completed_calls if "lookup" in _name(events, k)]
    assert len(looked) == ROUNDS, f"{where}: safe calls completed: {looked}"
    for key in looked:
        assert ledger.count(key) >= 1, f"{where}: safe effect {key} never happened"


def _name(events: list, key: str) -> str:
    for ev in events:
        if getattr(ev.payload, "idempotency_key", None) == key and hasattr(ev.payload, "name"):
            return str(ev.payload.name)
    return ""


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_sigkill_at_every_point_of_a_mixed_loop(
    fast: Settings, ledger: Ledger, tmp_path: Path, aio: bool
) -> None:
    counted = tmp_path / "points"
    clean = f"mixed-{uuid.uuid4().hex[:8]}"
    done = _worker(fast, clean, kill_at=0, aio=aio, points=counted)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(fast, ledger, clean, "uninterrupted")
    total = int(counted.read_text())
    # open (RUN_STARTED), per round a safe call (2 produces + 1 effect) and an
    # irreversible one (2 produces, 2 acknowledgements, 1 effect), finish (1 + 1)
    assert total >= 2 + ROUNDS * 8 + 2, total
    for k in range(1, total + 1):
        run_id = f"mixed-{k}-{uuid.uuid4().hex[:8]}"
        killed = _worker(fast, run_id, kill_at=k, aio=aio)
        assert killed.returncode == -9, (
            f"point {k}: exit {killed.returncode}\n{killed.stderr[-3000:]}"
        )
        resumed = _worker(fast, run_id, kill_at=0, aio=aio)
        assert resumed.returncode == 0, f"point {k}: resume failed\n{resumed.stderr[-3000:]}"
        _check(fast, ledger, run_id, f"killed at point {k} of {total}")
