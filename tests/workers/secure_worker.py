"""A worker process for the secure-stack tests: runs as whatever RUNLOG_* says, then waits.

    python tests/workers/secure_worker.py --run-id R --ready FILE --effects FILE

It opens (or resumes) run R, appends a message, calls the ``note`` tool once (its effect:
one line in ``--effects``, outside the process), appends another message, writes
``--ready`` (JSON: epoch, seq) and sleeps until the test kills it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.schemas._vocabulary import EventType  # noqa: E402


def note_tool(effects: Path) -> runlog.Tool:
    def note(args: dict[str, Any], *, idempotency_key: str) -> str:
        with effects.open("a") as fh:
            fh.write(f"{idempotency_key} {json.dumps(args, sort_keys=True)}\n")
        return f"noted {args}"

    return runlog.tool("note", risk="safe")(note)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--effects", required=True)
    opts = ap.parse_args()
    settings = Settings()
    run = runlog.open_run(
        opts.run_id, tools=[note_tool(Path(opts.effects))], settings=settings, agent="secure"
    )
    run.append(EventType.USER_MESSAGE, content="hello over TLS and SCRAM")
    run.call_tool("note", {"n": 1})
    run.append(EventType.USER_MESSAGE, content="about to be killed")
    tmp = Path(opts.ready + ".tmp")
    tmp.write_text(json.dumps({"epoch": run.epoch, "seq": run.state.seq}))
    tmp.rename(opts.ready)
    time.sleep(300)  # the test sends SIGKILL long before this ends
    return 1


if __name__ == "__main__":
    sys.exit(main())
