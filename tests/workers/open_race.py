"""Contenders for one requested run that nobody started yet, each opening it as a fleet
worker does: its own process, its own clients, and a log tail that holds every partition
from its beginning (so each learns "no record of this run" from its tail, not a read).

Started with ``spawn``; released together by a barrier, twice per trial: once before the
open and once after it, so both have opened before either acts. Each contender then makes
one irreversible call (its effect goes to a ledger, keyed by the idempotency key) and
finishes. Trial kinds: ``free`` (the lease decides: one opens, the other is locked out) and
``takeover`` (both break the lease, as a worker that believes the owner died does: the log
decides who owns the run).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

RESULT_TIMEOUT_S = 60


def contender(
    index: int, settings_dump: dict[str, Any], trials: list[tuple[str, str]], barrier: Any, out: Any
) -> None:
    import json

    import runlog
    from runlog._bootstrap import Services
    from runlog._settings import Settings
    from runlog.log._clients import redis_client
    from runlog.producers._opening import open_run_with
    from workers.common import Ledger

    settings = Settings(**settings_dump)
    services = Services(settings)
    deps = services.run_deps()
    assert deps.tail is not None
    for p in range(settings.partitions):
        deps.tail.follow_whole(p)
    client = redis_client(settings)
    for rid, kind in trials:
        ledger = Ledger(client, f"{settings.redis_key_prefix}:{rid}")

        @runlog.tool(risk="irreversible")
        def effect(args: dict[str, Any], *, idempotency_key: str, ledger: Ledger = ledger) -> str:
            ledger.apply(idempotency_key, json.dumps(args, sort_keys=True))
            return f"done by {args['by']}"

        run = None
        outcome, epoch = "won", None
        try:
            barrier.wait(RESULT_TIMEOUT_S)
            try:
                run = open_run_with(
                    deps, rid, wait_s=0, takeover=kind == "takeover", tools=[effect]
                )
                epoch = run.epoch
            finally:
                barrier.wait(RESULT_TIMEOUT_S)  # both have opened (or failed to) before acting
            run.call_tool("effect", {"by": "either"})
            run.finish("succeeded", f"contender-{index}")
        except runlog.RunLocked:
            outcome = "RunLocked"
        except runlog.Fenced:
            outcome = "Fenced"
        except runlog.RunlogError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            if run is not None:
                run.close()
        out.put((rid, index, outcome, epoch))
    time.sleep(0.1)
    services.close()
    client.close()


@contextlib.contextmanager
def contenders(settings: Any, trials: list[tuple[str, str]]) -> Iterator[tuple[Any, list[Any]]]:
    """Two contenders started on ``trials``: ``(results queue, processes)``."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    dump = settings.model_dump()
    procs = [
        ctx.Process(target=contender, args=(i, dump, trials, barrier, results)) for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        yield results, procs
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
