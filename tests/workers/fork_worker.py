"""A worker process for the fork tests: make a fork, or run a run's calls; killed by tests.

    python tests/workers/fork_worker.py make --parent P --at-seq N --run-id F [--die D]
    python tests/workers/fork_worker.py calls --run-id R --calls '[{"n":1},...]' [--hold N]

``make --die before-ack`` SIGKILLs this process right after the RUN_FORKED record was handed
to the producer (before its acknowledgement), ``--die after-ack`` once it is acknowledged and
before the writer read it back: the two halves of the lineage write. ``calls --hold N``
applies the effect of ``charge {"n": N}`` in the world and then hangs (the test SIGKILLs it).
The world is a Redis list outside every worker: one entry per request the receiver took
(it does not deduplicate), so a test counts exactly what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.producers import _forks as forks  # noqa: E402

EXIT_ESCALATED = 5


def charge_tool(world: Any, key: str, *, hold: int | None = None) -> runlog.Tool:
    """``charge``: irreversible, a receiver that applies every request it gets (no dedupe);
    its lookup finds a request by idempotency key (the evidence recovery needs)."""

    def charge(args: dict[str, Any], *, idempotency_key: str) -> str:
        world.rpush(key, json.dumps({"key": idempotency_key, "n": args["n"]}))
        if hold is not None and args["n"] == hold:
            Path(os.environ["FORK_FLAG"]).write_text(idempotency_key)
            time.sleep(600)
        return f"charged {args['n']} ({idempotency_key})"

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        for raw in world.lrange(key, 0, -1):
            if json.loads(raw)["key"] == idempotency_key:
                return runlog.Match(f"charged {args['n']} ({idempotency_key})")
        return runlog.Absent("no such charge")

    return runlog.tool("charge", risk="irreversible", reconcile=lookup)(charge)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["make", "calls"])
    p.add_argument("--run-id", required=True)
    p.add_argument("--tenant", default="default")
    p.add_argument("--parent")
    p.add_argument("--at-seq", type=int)
    p.add_argument("--effects", default="inherit")
    p.add_argument("--die", choices=["before-ack", "after-ack"], default=None)
    p.add_argument("--calls", default="[]")
    p.add_argument("--hold", type=int, default=None)
    p.add_argument("--world", required=True)
    opts = p.parse_args()
    settings = Settings()
    if opts.what == "make":
        if opts.die == "before-ack":
            real_barrier = forks.Engine.barrier

            def barrier(self: Any) -> Any:
                time.sleep(0.02)  # the record may be on its way to the broker, or not yet
                os.kill(os.getpid(), signal.SIGKILL)
                return real_barrier(self)

            forks.Engine.barrier = barrier  # type: ignore[method-assign]
        elif opts.die == "after-ack":

            def read_back(self: Any, reader: Any, end: int) -> Any:
                os.kill(os.getpid(), signal.SIGKILL)

            forks.Engine.read_back = read_back  # type: ignore[method-assign]
        made = runlog.fork(
            opts.parent,
            tenant=opts.tenant,
            at_seq=opts.at_seq,
            new_run_id=opts.run_id,
            effects=opts.effects,
            forked_by="fork_worker",
            settings=settings,
        )
        print(json.dumps({"created": made.created, "run_id": made.run_id}))
        return 0
    world = redis_client(settings)
    tool = charge_tool(world, opts.world, hold=opts.hold)
    results = []
    try:
        with runlog.open_run(
            opts.run_id, tenant=opts.tenant, tools=[tool], settings=settings
        ) as run:
            for args in json.loads(opts.calls):
                results.append(run.call_tool("charge", args))
    except runlog.Escalated as exc:
        print(json.dumps({"escalated": exc.approval_id, "results": results}))
        return EXIT_ESCALATED
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
