"""Many runs' safe steps in one process, by the collector's setting: what a full collection
over a large heap costs a worker.

``python -m tools.benchmarks.gc_fanout [--frameworks] [--gc default|freeze|worker]``, on
scratch topics of the stack the ``RUNLOG_*`` settings name (deleted afterwards): opens
``--runs`` runs with ``runlog.aio`` in one event loop, then each makes ``--calls`` safe
calls at once, and prints steps/s, process CPU per step and the collections made, by
generation, with the seconds they took.

* ``--frameworks``: first import what agents bring along (LangGraph, DBOS, Pydantic AI,
  the OpenAI Agents SDK: those installed), so the collector tracks their objects too;
* ``--gc default``: Python's thresholds; ``freeze``: ``gc.freeze()`` after the imports;
  ``worker``: the thresholds ``runlog worker`` and ``runlog project`` set (``streaming_gc``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import time
from typing import Any

FRAMEWORKS = ("langgraph.graph", "langgraph.checkpoint.sqlite", "dbos", "pydantic_ai", "agents")
RESULT = "r" * 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", action="store_true", help="import agent frameworks first")
    p.add_argument("--gc", choices=("default", "freeze", "worker"), default="default")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args()
    if a.frameworks:
        for name in FRAMEWORKS:
            try:
                importlib.import_module(name)
            except ImportError:
                print(f"not installed: {name}")

    import runlog
    from runlog._bootstrap import Services
    from runlog._settings import Settings
    from runlog.consumers.runner import streaming_gc
    from runlog.log._clients import async_redis_client
    from runlog.producers._async_run import open_async
    from tools.benchmarks.common import TENANT, Scratch

    if a.gc == "freeze":
        gc.freeze()
    elif a.gc == "worker":
        streaming_gc()
    tracked = len(gc.get_objects())
    collections: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections[info["generation"]].append(time.perf_counter() - started[0])

    scratch = Scratch.create(Settings())
    services = Services(scratch.settings)

    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        return RESULT

    async def run_all() -> tuple[float, float]:
        tool = runlog.tool("pay", risk="safe")(pay)
        aredis = async_redis_client(scratch.settings)
        deps = services.run_deps()
        runs = await asyncio.gather(
            *(
                open_async(deps, aredis, None, tenant=TENANT, tools=[tool], recover=False)
                for _ in range(a.runs)
            )
        )

        async def work(run: Any) -> None:
            for i in range(a.calls):
                await run.call_tool("pay", {"i": i})

        gc.callbacks.append(timed)
        w0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(work(r) for r in runs))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        gc.callbacks.remove(timed)
        await asyncio.gather(*(r.close() for r in runs))
        await aredis.aclose()
        return wall, cpu

    try:
        wall, cpu = asyncio.run(run_all())
    finally:
        services.close()
        scratch.cleanup()
    steps = a.runs * a.calls
    made = ", ".join(f"gen{g} {len(ts)} ({sum(ts):.3f} s)" for g, ts in collections.items() if ts)
    print(
        f"gc={a.gc} frameworks={a.frameworks} tracked={tracked}: {steps / wall:,.0f} steps/s, "
        f"{cpu / steps * 1000:.3f} ms CPU/step; collections: {made or 'none'}"
    )


if __name__ == "__main__":
    main()
