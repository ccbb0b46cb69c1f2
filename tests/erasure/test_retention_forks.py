"""The retention job follows a run into its forks, as ``forget`` does: a fork begins with
its parent's state (what the user said included), so when the policy covers the parent,
the fork is forgotten with it (stopped first if in progress). Real stack, real runner."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from erasure.test_forget import TENANT, make_run
from projections_support import start_runner, stop, wait_assigned, wait_caught_up
from scan_support import redis_bytes

import runlog
import runlog._api
from runlog._settings import Settings
from runlog.consumers._verify import verify_run

pytestmark = pytest.mark.timeout(300)


def test_retention_forgets_the_forks_of_a_covered_run(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Any, tmp_path: Path
) -> None:
    s = test_settings
    gone, kept = f"GONE{uuid.uuid4().hex}", f"KEPT{uuid.uuid4().hex}"
    old = make_run(s, gone)
    child = runlog.fork(old, at_seq=2, tenant=TENANT, forked_by="ops", settings=s).run_id
    time.sleep(0.05)
    mid = datetime.now(UTC)
    time.sleep(0.05)
    new = make_run(s, kept)
    log = str(tmp_path / "runner.log")
    proc = start_runner(s, "all", unique_group("retfork"), log_path=log)
    try:
        wait_assigned(proc, log)
        wait_caught_up(redis_client, s)
        assert gone.encode() in redis_bytes(s)  # the fork's copy of the parent's content too
        at = mid + timedelta(hours=1)  # the cutoff is ``mid``: only ``old`` ended before it
        (dry,) = runlog._api.apply_retention(
            tenant=TENANT, finished_older_than="1h", now=at, dry_run=True, settings=s
        )
        assert dry.runs == [old, child] and dry.report is None
        (job,) = runlog._api.apply_retention(
            tenant=TENANT, finished_older_than="1h", now=at, settings=s
        )
        assert job.runs == [old, child]
        assert job.report is not None and job.report.projections_purged is True
        assert [r.run_id for r in job.report.runs] == [old, child]
        assert job.report.runs[1].terminated  # nobody had opened the fork: stopped first
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]
    scan = redis_bytes(s)
    assert gone.encode() not in scan and kept.encode() in scan
    for rid in (old, child):
        assert verify_run(s, redis_client, rid, tenant=TENANT).verdict == "erased"
    assert verify_run(s, redis_client, new, tenant=TENANT).verdict == "ok"
