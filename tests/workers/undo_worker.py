"""A decider's process for the "undo and retry" crash tests: it answers an approval with
"undo and retry" holding the run's tools, and SIGKILLs itself at a point of that answer.

    python tests/workers/undo_worker.py --run-id R --approval-id AP --prefix P --kill-at K

``--kill-at``: ``inverse`` (once the inverse's completion is durable in the log, before the
retry starts) or ``retry`` (inside the retry's tool, once its effect was made, before its
completion). The receiver is the Redis ledger of the test (``Ledger``), outside the process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.producers import _calls as calls  # noqa: E402
from runlog.schemas._canonical import canonical_json  # noqa: E402
from workers.common import Ledger  # noqa: E402


class Bookings:
    """A booking service that books what it is asked (one ledger entry per key, and
    deduplicates nothing) and whose cancel takes the booking of the original key back."""

    def __init__(self, ledger: Ledger, kill_in_retry: bool) -> None:
        self.ledger, self.kill_in_retry = ledger, kill_in_retry

    def book(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        self.ledger.apply(idempotency_key, canonical_json(args))
        if self.kill_in_retry:
            os.kill(os.getpid(), signal.SIGKILL)  # the effect is made; its answer is lost
        return f"booked {args['room']}"

    def lookup(self, args: dict[str, Any], *, idempotency_key: str) -> Any:
        found = self.ledger.found(idempotency_key)
        if found is None:
            return runlog.Absent("no booking")
        if found != canonical_json(args):
            return runlog.Conflict(found)
        return runlog.Match(f"booked {args['room']}")

    def cancel(self, args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        r = self.ledger.redis
        r.hincrby(self.ledger.counts, original_key, -1)
        r.hdel(self.ledger.args, original_key)
        return f"cancelled {original_key}"

    def tools(self) -> list[runlog.Tool]:
        book = runlog.tool(
            "book",
            risk="reversible",
            reconcile=self.lookup,
            compensate=self.cancel,
            receiver="fenced",
        )
        return [book(self.book)]


def kill_once_undone() -> None:
    """SIGKILL this process as soon as the inverse is recorded completed (its COMPLETED is
    durable: the inverse is irreversible, so its outcome is appended at a barrier)."""
    undo = calls._compensate

    def then_die(run: Any, call: Any) -> Generator[Any, Any, str | None]:
        out = yield from undo(run, call)
        if out is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    calls._compensate = then_die  # type: ignore[assignment]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-id", required=True)
    p.add_argument("--approval-id", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--kill-at", choices=("inverse", "retry"), required=True)
    opts = p.parse_args()
    settings = Settings()
    ledger = Ledger(redis_client(settings), opts.prefix)
    if opts.kill_at == "inverse":
        kill_once_undone()
    svc = Bookings(ledger, kill_in_retry=opts.kill_at == "retry")
    runlog.decide(
        opts.run_id,
        opts.approval_id,
        approved=True,
        undo_and_retry=True,
        decided_by="ops",
        note="undo it and book again",
        tools=svc.tools(),
        settings=settings,
    )
    return 0  # not reached: the process is killed at its point


if __name__ == "__main__":
    sys.exit(main())
