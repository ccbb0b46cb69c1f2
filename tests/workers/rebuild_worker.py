"""``runlog rebuild all`` that halts at a named point and waits there to be killed.

The test SIGKILLs it once it wrote its flag file, so each point is hit deterministically:

- ``after-first-delete``: the first batch of deletes is done, the rest of the keys remain;
- ``mid-replay``: the refold committed a few batches of the log, not the rest;
- ``before-end``: the refold reached the watermarks, the rebuild has not returned yet.

The rebuild marker's TTL is 2 s here (30 in production), so the live runners find it
expired soon after the kill. Everything else is the real command.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from runlog.consumers.runner import _batch as batch
from runlog.consumers.runner import _fencing as fencing
from runlog.consumers.runner import _loop as runner
from runlog.consumers.runner import _rebuilding as rebuilding

POINT = os.environ["RUNLOG_TEST_REBUILD_HALT_AT"]
FLAG = Path(os.environ["RUNLOG_TEST_REBUILD_FLAG"])
fencing.REBUILD_MARKER_TTL_S = 2
runner.CATCH_UP_BATCH = 200  # many refold transactions, so one can be the middle
# ^C as at a terminal: a parent started in the background (a CI job under `&`) passes
# SIGINT on ignored, and Python then keeps it ignored, so the test's ^C would never land.
signal.signal(signal.SIGINT, signal.default_int_handler)


def halt() -> None:
    FLAG.write_text(POINT)
    time.sleep(3600)  # the marker keeps being renewed until the kill


if POINT == "after-first-delete":
    real_delete = rebuilding._delete

    def _delete(client: Any, keys: list[Any]) -> int:
        real_delete(client, keys)
        halt()
        raise AssertionError("not reached")

    rebuilding._delete = _delete
elif POINT == "mid-replay":
    real_commit = batch.BatchApplier._commit
    commits = [0]

    def _commit(self: batch.BatchApplier, *args: Any, **kwargs: Any) -> None:
        real_commit(self, *args, **kwargs)
        commits[0] += 1
        if commits[0] == 4:
            halt()

    batch.BatchApplier._commit = _commit  # type: ignore[method-assign]
elif POINT == "before-end":
    real_catch_up = runner.ProjectionRunner.catch_up

    def catch_up(self: runner.ProjectionRunner, *args: Any, **kwargs: Any) -> dict[int, int]:
        real_catch_up(self, *args, **kwargs)
        halt()
        raise AssertionError("not reached")

    runner.ProjectionRunner.catch_up = catch_up  # type: ignore[method-assign]
else:
    raise SystemExit(f"unknown halt point {POINT!r}")

if __name__ == "__main__":
    from runlog.cli import main

    sys.exit(main(["rebuild", "all"]))
