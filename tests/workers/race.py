"""Contenders for one run, released together by a multiprocessing barrier.

Started with the ``spawn`` method (never fork a process that runs librdkafka threads), so
each contender builds its own clients. Each trial: wait at the barrier, ``open_run`` the
shared run id without waiting for a live owner, append, finish; report what happened.

Trial kinds:

* ``free``: nobody holds the run; both contenders try to take it, and neither appends
  before both have tried.
* ``expired``: contender 0 already owns the run and its lease vanishes (the test deletes
  it, as an expiry during a pause would) just before the barrier; at release, the old
  owner appends while the other takes over.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runlog._settings import Settings

RESULT_TIMEOUT_S = 60


def contender(
    index: int,
    settings_dump: dict[str, Any],
    trials: list[tuple[str, str]],
    barrier: Any,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    import runlog
    from runlog._settings import Settings
    from runlog.schemas._vocabulary import EventType

    settings = Settings(**settings_dump)
    name = f"contender-{index}"
    for rid, kind in trials:
        run = None
        outcome, epoch = "won", None
        try:
            if kind == "expired" and index == 0:
                run = runlog.open_run(rid, settings=settings, wait_s=5)
                ready.put(run.epoch)
                go.get(timeout=RESULT_TIMEOUT_S)
            barrier.wait(RESULT_TIMEOUT_S)
            if run is None:
                try:
                    run = runlog.open_run(rid, settings=settings, wait_s=0)
                finally:
                    if kind == "free":
                        # Both have tried before either appends: on a loaded machine one
                        # contender could otherwise finish the run before the other starts,
                        # and the "race" would be a friendly sequence.
                        barrier.wait(RESULT_TIMEOUT_S)
            epoch = run.epoch
            run.append(EventType.USER_MESSAGE, content=f"from {name}")
            run.append(EventType.MEMORY_WRITTEN, key="writer", value=name)
            run.finish("succeeded", name)
        except runlog.RunLocked:
            outcome = "RunLocked"
        except runlog.Fenced:
            outcome = "Fenced"
        except runlog.RunlogError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            if run is not None:
                run.close()
        results.put((rid, index, outcome, epoch))


def context() -> Any:
    return mp.get_context("spawn")


@dataclass
class Contest:
    """Two running contenders: ``ready`` and ``go`` pace an expired trial, ``results`` gets
    ``(run_id, index, outcome, epoch)`` per contender and trial."""

    ready: Any
    go: Any
    results: Any
    procs: list[Any]


@contextlib.contextmanager
def contenders(settings: Settings, trials: list[tuple[str, str]]) -> Iterator[Contest]:
    """Two contenders started on ``trials``, joined (killed if stuck) when the block ends."""
    ctx = context()
    barrier, ready, go, results = ctx.Barrier(2), ctx.Queue(), ctx.Queue(), ctx.Queue()
    dump = settings.model_dump()
    procs = [
        ctx.Process(target=contender, args=(i, dump, trials, barrier, ready, go, results))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        yield Contest(ready, go, results, procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
