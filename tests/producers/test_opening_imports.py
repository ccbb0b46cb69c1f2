"""Opening a run loads the writer and log access only, on the real stack.

A worker process pays for what it imports: the console renderer (``rich``) and the
projection services (runners, stores, queries) are for the CLI and the services, never
for a worker that opens a run, appends, finishes and resumes from a snapshot.
"""

from __future__ import annotations

import json
import subprocess
import sys

from workers.common import ROOT, worker_env

from runlog._settings import Settings

OPEN_AND_RESUME = """
import json, sys
import runlog

run = runlog.open_run()
run.append("user_message", {"content": "hello"})
run_id = run.run_id
run.close()
again = runlog.open_run(run_id)   # resumes: replay from the snapshot cache and the tail
again.finish("succeeded")
print(json.dumps({
    "seq": again.state.seq,
    "rich": "rich" in sys.modules,
    "services": sorted(m for m in sys.modules if m.startswith("runlog.consumers")),
}))
"""


def test_opening_a_run_imports_neither_rich_nor_a_projection_service(
    test_settings: Settings,
) -> None:
    env = worker_env(test_settings, RUNLOG_SNAPSHOT_INTERVAL="1")
    out = subprocess.run(
        [sys.executable, "-c", OPEN_AND_RESUME],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seq"] >= 4, got  # started, message, resumed, finished: the run really ran
    assert not got["rich"], "opening a run imported rich"
    assert got["services"] == [], f"opening a run imported {got['services']}"
