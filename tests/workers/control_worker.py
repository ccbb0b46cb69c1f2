"""A worker the cancel/terminate tests start, hold, stop (SIGSTOP) and resume.

    python tests/workers/control_worker.py --dir D --name N --run-id R --steps 3 \
        --hold-at 1 --hold {between,in-tool} [--cleanup]

It makes ``--steps`` irreversible ``charge`` calls on the ledger in Redis (outside this
process, keyed by idempotency key; the reconciler looks it up). At step ``--hold-at`` it
writes a flag and waits for ``go``: ``between`` before the call, ``in-tool`` inside the
tool before its effect. On ``runlog.Cancelled`` it writes the ``cancelled`` flag and, with
``--cleanup``, makes one more call (the agent's clean-up), then lets closing end the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.schemas._canonical import canonical_json  # noqa: E402
from workers.common import STOPPED_BY, Flags, Ledger, run_worker  # noqa: E402

EXIT_CANCELLED = 9
TABLE = (*STOPPED_BY, (runlog.Cancelled, "Cancelled", EXIT_CANCELLED))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--tenant", default="acme")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--hold", choices=["between", "in-tool"], default="between")
    ap.add_argument("--cleanup", action="store_true")
    opts = ap.parse_args()
    settings = Settings()
    flags = Flags(opts.dir, opts.name)
    client = redis_client(settings)
    ledger = Ledger(client, settings.redis_key_prefix)
    holding = {"step": -1}

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        found = ledger.found(idempotency_key)
        if found is None:
            return runlog.Absent(f"ledger has no entry {idempotency_key}")
        return runlog.Match(f"charged {args['amount']}")

    @runlog.tool("charge", risk="irreversible", reconcile=lookup, receiver="fenced")
    def charge(args: dict[str, Any], *, idempotency_key: str) -> str:
        if opts.hold == "in-tool" and holding["step"] == opts.hold_at:
            flags.set("in-tool", idempotency_key)
            flags.hold()
        ledger.apply(idempotency_key, canonical_json(args))
        flags.set(f"effect-{args['amount']}", idempotency_key)
        return f"charged {args['amount']}"

    def scenario(run: runlog.Run) -> None:
        try:
            for i in range(opts.steps):
                holding["step"] = i
                if opts.hold == "between" and i == opts.hold_at:
                    flags.set("between", json.dumps({"epoch": run.epoch, "seq": run.state.seq}))
                    flags.hold()
                run.call_tool("charge", {"acct": "A", "amount": i})
            run.finish("succeeded", f"{opts.steps} charges")
        except runlog.Cancelled as exc:
            flags.set("cancelled", json.dumps({"by": exc.requested_by, "reason": exc.reason}))
            if opts.cleanup:
                holding["step"] = -1
                run.call_tool("charge", {"acct": "A", "amount": "cleanup"})
            raise

    code = run_worker(
        settings,
        flags,
        lambda: runlog.open_run(opts.run_id, tenant=opts.tenant, tools=[charge]),
        scenario,
        TABLE,
    )
    client.close()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
