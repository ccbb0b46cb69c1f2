"""A worker whose loop mixes safe and irreversible calls, killed at a numbered point.

    python tests/workers/mixed_worker.py --run-id R --kill-at K [--aio] [--points FILE]

The points are every place a crash can fall between two facts: before each produce,
after each acknowledgement (before the ownership check), and after each effect. With
``--kill-at K`` the worker SIGKILLs itself at point K; with 0 it runs to the end and
writes how many points it passed to ``--points``. The same loop runs on the sync API or,
with ``--aio``, on ``runlog.aio``. Effects go to the Redis ledger (tests/workers/common).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from runlog.producers._engine import Engine  # noqa: E402
from runlog.producers._writer import EventWriter  # noqa: E402
from workers.common import Ledger  # noqa: E402

ROUNDS = 2


class Points:
    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at
        self.passed = 0

    def mark(self) -> None:
        self.passed += 1
        if self.passed == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def instrument(points: Points) -> None:
    submit, owned = EventWriter.submit, Engine.still_owned

    def counted_submit(self: EventWriter, *args: Any, **kw: Any) -> None:
        points.mark()
        submit(self, *args, **kw)

    def counted_owned(self: Engine, *args: Any, **kw: Any) -> None:
        points.mark()
        owned(self, *args, **kw)

    EventWriter.submit = counted_submit  # type: ignore[method-assign]
    Engine.still_owned = counted_owned  # type: ignore[method-assign]


def make_tools(ledger: Ledger, points: Points, *, aio: bool) -> list[runlog.Tool]:
    def lookup_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        points.mark()
        return f"page {args['i']}"

    def pay_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
        points.mark()
        return f"paid {args['i']}"

    def pay_check(args: dict[str, Any], *, idempotency_key: str) -> Any:
        if ledger.found(idempotency_key) is None:
            return runlog.Absent("no such payment")
        return runlog.Match(f"paid {args['i']}")

    if aio:  # the same tools as coroutines: runlog.aio awaits them in the loop
        sync_lookup, sync_pay, sync_check = lookup_fn, pay_fn, pay_check

        async def lookup(args: dict[str, Any], *, idempotency_key: str) -> str:
            return sync_lookup(args, idempotency_key=idempotency_key)

        async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
            return sync_pay(args, idempotency_key=idempotency_key)

        async def check(args: dict[str, Any], *, idempotency_key: str) -> Any:
            return sync_check(args, idempotency_key=idempotency_key)

        return [
            runlog.tool("lookup")(lookup),
            runlog.tool("pay", risk="irreversible", reconcile=check, receiver="fenced")(pay),
        ]
    return [
        runlog.tool("lookup")(lookup_fn),
        runlog.tool("pay", risk="irreversible", reconcile=pay_check, receiver="fenced")(pay_fn),
    ]


def run_sync(run_id: str, tools: list[runlog.Tool], settings: Settings | None = None) -> None:
    with runlog.open_run(run_id, tools=tools, takeover=True, settings=settings) as run:
        for i in range(ROUNDS):
            run.call_tool("lookup", {"i": i})
            run.call_tool("pay", {"i": i})
        run.finish("succeeded")


async def run_aio(run_id: str, tools: list[runlog.Tool], settings: Settings | None = None) -> None:
    async with runlog.aio.open_run(run_id, tools=tools, takeover=True, settings=settings) as run:
        for i in range(ROUNDS):
            await run.call_tool("lookup", {"i": i})
            await run.call_tool("pay", {"i": i})
        await run.finish("succeeded")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--aio", action="store_true")
    ap.add_argument("--points", default="")
    opts = ap.parse_args()
    settings = Settings()
    points = Points(opts.kill_at)
    ledger = Ledger(redis_client(settings), settings.redis_key_prefix)
    tools = make_tools(ledger, points, aio=opts.aio)
    instrument(points)
    if opts.aio:
        asyncio.run(run_aio(opts.run_id, tools))
    else:
        run_sync(opts.run_id, tools)
    if opts.points:
        Path(opts.points).write_text(str(points.passed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
