"""A rebuild SIGKILLed at any point never leaves a half-rebuilt projection in service.

``runlog rebuild all`` runs as a real process and halts at a named point (after its
first batch of deletes, in the middle of the refold, just before it returns:
``workers/rebuild_worker.py``) until the test SIGKILLs it (or interrupts it, as ^C does).
Its marker then expires (or is removed as it unwinds) and the projection services, real
``runlog project`` processes, must neither resume on what it left nor stay stopped: they
complete the rebuild from offset zero, also when none was running as it died. Afterwards
every key of the three projections equals a rebuild from zero, and no finished run is ever
shown as ``new`` on the way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from projections_support import (
    dump,
    env_for,
    replayed_states,
    start_runner,
    stop,
    wait_assigned,
    wait_caught_up,
)
from workers.common import TESTS

from runlog._settings import Settings
from runlog.consumers import _projection_metrics as projection_metrics
from runlog.consumers import _queries as queries
from runlog.consumers._store import ProjectionKeys
from runlog.consumers.runner import ProjectionRunner, RebuildIncomplete
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator

pytestmark = pytest.mark.timeout(600)

WORKER = TESTS / "workers" / "rebuild_worker.py"


def _markers(client: redis.Redis, settings: Settings) -> dict[str, list[str]]:
    """Which projections have a rebuild's marker, and which are marked incomplete."""
    keys = [
        ProjectionKeys(settings.redis_key_prefix, n, settings.events_topic) for n in PROJECTIONS
    ]
    return {
        "running": [k.projection for k in keys if client.exists(k.rebuild_marker())],
        "incomplete": [k.projection for k in keys if client.exists(k.incomplete_marker())],
    }


def _kill_rebuild_at(settings: Settings, point: str, sig: int, tmp_path: Path) -> None:
    """Start ``runlog rebuild all``, and send it ``sig`` once it reached ``point``."""
    flag = tmp_path / f"{point}-{sig}.flag"
    log = tmp_path / f"rebuild-{point}-{sig}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=env_for(
                settings,
                RUNLOG_TEST_REBUILD_HALT_AT=point,
                RUNLOG_TEST_REBUILD_FLAG=str(flag),
            ),
            stdout=out,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the rebuild never reached {point}"
            time.sleep(0.05)
    finally:
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=120)  # an interrupted rebuild closes its clients: slow
        except subprocess.TimeoutExpired:
            proc.kill()  # never leave it behind
            proc.wait()
            raise
    assert code != 0, "the rebuild finished after all"


def _reference(client: redis.Redis, settings: Settings, tag: str) -> dict:
    ref = settings.model_copy(update={"redis_key_prefix": f"{settings.redis_key_prefix}-{tag}"})
    ProjectionRunner(ref, client, PROJECTIONS).catch_up(timeout_s=180)
    return dump(client, ref)


def _never_finished_as_new(
    client: redis.Redis, settings: Settings, finished: list[str], *, complete: bool
) -> None:
    """No finished run shows as ``new`` (what a fold on deleted keys makes of it); once
    the rebuild is ``complete``, every one shows as finished."""
    for rid in finished:
        view = queries.get_state(client, settings, rid)
        if view is None:
            # Not refolded yet: absent is honest, a refold in progress shows a prefix.
            assert not complete, f"{rid} is missing from the completed projection"
            continue
        st = view["state"]
        assert st["status"] != "new" and st["seq"] > 0, (rid, st["status"], st["seq"])
        if complete:
            assert st["status"] == "finished", (rid, st["status"], st["seq"])


def test_a_rebuild_killed_anywhere_is_completed_from_zero(
    test_settings: Settings, redis_client: redis.Redis, unique_group, tmp_path: Path
) -> None:
    gen = LoadGenerator(test_settings, seed=27)
    run_ids = gen.generate(runs=300, events_per_run=12)
    finished = [
        rid
        for rid, st in replayed_states(test_settings, run_ids).items()
        if st["status"] == "finished"
    ]
    assert len(finished) > 250
    sample = finished[::10]
    group = unique_group("rebuild-kill")
    log = str(tmp_path / "runner.log")
    proc = start_runner(test_settings, "all", group, log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, test_settings, timeout=120)
        points = (
            ("after-first-delete", signal.SIGKILL),
            ("mid-replay", signal.SIGKILL),
            ("before-end", signal.SIGKILL),
            ("mid-replay", signal.SIGINT),  # ^C: the rebuild unwinds, its marker goes at once
        )
        for i, (point, sig) in enumerate(points):
            restart = i == 1
            if restart:
                # No service runs when this rebuild dies: the next one to start finishes it.
                assert stop(proc) == 0, Path(log).read_text()[-3000:]
            _kill_rebuild_at(test_settings, point, sig, tmp_path)
            assert _markers(redis_client, test_settings)["incomplete"], (
                f"a rebuild killed at {point} left its projection unmarked"
            )
            gen.generate(runs=5, events_per_run=6)  # traffic while the rebuild is dead
            if restart:
                # A plain catch-up refuses a half-rebuilt projection rather than fold on it.
                with pytest.raises(RebuildIncomplete):
                    ProjectionRunner(test_settings, redis_client, ("state",)).catch_up(timeout_s=30)
                # An operator reading it is told what it is.
                shown = subprocess.run(
                    [sys.executable, "-m", "runlog.cli", "state", finished[0], "--tenant", "load"],
                    env=env_for(test_settings),
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                assert "the state projection is incomplete" in shown.stderr, shown.stderr
                metrics = projection_metrics.collect(
                    redis_client, test_settings, PROJECTIONS, lambda p: 0
                )
                assert metrics["projections"]["state"]["rebuild_incomplete"] is True
                proc = start_runner(test_settings, "all", group, log_path=log)
                wait_assigned(proc, log)
            deadline = time.monotonic() + 180
            while any(_markers(redis_client, test_settings).values()):
                assert proc.poll() is None, Path(log).read_text()[-3000:]
                assert time.monotonic() < deadline, (
                    f"after a kill at {point} the rebuild was never completed: "
                    f"{_markers(redis_client, test_settings)}"
                )
                _never_finished_as_new(redis_client, test_settings, sample, complete=False)
                time.sleep(0.2)
            wait_caught_up(redis_client, test_settings, timeout=120)
            _never_finished_as_new(redis_client, test_settings, finished, complete=True)
            got = dump(redis_client, test_settings)
            want = _reference(redis_client, test_settings, f"ref{i}")
            differ = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
            assert not differ, f"killed at {point}: {len(differ)} keys differ, e.g. {differ[:5]}"
            assert proc.poll() is None, Path(log).read_text()[-3000:]
            # The services themselves completed it (no rebuild was run for them).
            assert Path(log).read_text().count("completing it from offset zero") >= i + 1
    finally:
        code = stop(proc)
    assert code == 0, Path(log).read_text()[-3000:]
