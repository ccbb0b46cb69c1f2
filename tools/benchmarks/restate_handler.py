"""The Restate peer's SDK process: ``python -m tools.benchmarks.restate_handler PORT``.

One Restate service, ``SERVICE``, whose handler ``steps(n)`` makes ``n`` durable
steps, each a ``ctx.run`` of a tool returning 300 random bytes: the step of
``runlog_safe``, recorded as Restate records it (the journal entry, acknowledged by the
server, before the handler goes on). Served over HTTP/2 by Hypercorn in this one process,
so its CPU is this process's (``restate_peer`` reads it from ``/proc``). Imported only in
that process: it needs the ``peers`` extra (``restate-sdk``, ``hypercorn``).
"""

from __future__ import annotations

import asyncio
import os
import sys

import restate
from hypercorn.asyncio import serve
from hypercorn.config import Config
from restate.serde import BytesSerde

from tools.benchmarks.restate_peer import HANDLER, SERVICE

service = restate.Service(SERVICE)
_AS_BYTES = restate.RunOptions(serde=BytesSerde())


def tool() -> bytes:
    return os.urandom(300)


@service.handler(HANDLER)  # type: ignore[untyped-decorator, unused-ignore]  # Any without the extra
async def steps(ctx: restate.Context, n: int) -> int:
    for i in range(n):
        await ctx.run_typed(f"tool-{i}", tool, _AS_BYTES)
    return n


app = restate.app(services=[service])


def main(argv: list[str]) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{int(argv[0])}"]
    # As the SDK's own test harness serves it: every invocation is one HTTP/2 stream of
    # one connection from the server, so the default cap of 100 streams would queue runs.
    config.h2_max_concurrent_streams = 2**31 - 1
    config.keep_alive_max_requests = 2**31 - 1
    config.keep_alive_timeout = 2**31 - 1
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    asyncio.run(serve(app, config, mode="asgi"))  # type: ignore[arg-type, unused-ignore]


if __name__ == "__main__":
    main(sys.argv[1:])
