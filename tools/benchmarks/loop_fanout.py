"""Many runs in one event loop: durable steps per second and process CPU per step.

``python -m tools.benchmarks.loop_fanout [--runs R] [--calls N] [--rounds K]``, on scratch
topics of the stack the ``RUNLOG_*`` settings name (deleted afterwards). ``R`` runs opened
in one event loop (``runlog.aio``) each make ``N`` calls of an ``async def`` tool returning
300 bytes, all at once (section 8's ``fanout`` shape); rounds of ``safe`` and
``irreversible`` calls alternate, so a noisy machine weighs on each alike. Prints the
medians over the rounds of steps/s (first call to last outcome) and process CPU per step
(us), and their spread (``--json``: as JSON too). Uses only what older versions of runlog
have too, so the same file run by another tree's interpreter compares two versions in one
sitting (alternate them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

RESULT = "r" * 300


def measure(*, runs: int, calls: int, rounds: int) -> dict[str, Any]:
    import runlog
    from runlog._bootstrap import Services
    from runlog._settings import Settings
    from runlog.log._clients import async_redis_client
    from runlog.producers._async_run import open_async
    from tools.benchmarks.common import TENANT, Scratch

    scratch = Scratch.create(Settings())
    svc = Services(scratch.settings)
    deps, settings = svc.run_deps(), scratch.settings

    async def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        return RESULT

    async def once(risk: str) -> tuple[float, float]:
        tool = runlog.tool("pay", risk=risk)(pay)  # type: ignore[arg-type]
        aredis = async_redis_client(settings)
        opened = await asyncio.gather(
            *(
                open_async(deps, aredis, None, tenant=TENANT, tools=[tool], recover=False)
                for _ in range(runs)
            )
        )

        async def work(run: Any) -> None:
            for i in range(calls):
                await run.call_tool("pay", {"i": i})

        w0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(work(r) for r in opened))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        await asyncio.gather(*(r.close() for r in opened))
        await aredis.aclose()
        return runs * calls / wall, cpu / (runs * calls) * 1e6

    got: dict[str, list[tuple[float, float]]] = {"safe": [], "irreversible": []}
    try:
        asyncio.run(once("safe"))  # warm-up: connections, schema lookups
        for _ in range(rounds):
            for risk, rows in got.items():
                rows.append(asyncio.run(once(risk)))
    finally:
        svc.close()
        scratch.cleanup()
    return {
        risk: {
            "steps_per_s": statistics.median(s for s, _ in rows),
            "steps_per_s_range": [min(s for s, _ in rows), max(s for s, _ in rows)],
            "cpu_us_per_step": statistics.median(c for _, c in rows),
            "cpu_us_range": [min(c for _, c in rows), max(c for _, c in rows)],
        }
        for risk, rows in got.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="runs in the loop at once")
    p.add_argument("--calls", type=int, default=20, help="calls per run")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each risk, alternating")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    a = p.parse_args()
    out = measure(runs=a.runs, calls=a.calls, rounds=a.rounds)
    print(
        " ".join(
            f"{risk} {v['steps_per_s']:,.0f} steps/s [{v['steps_per_s_range'][0]:,.0f}-"
            f"{v['steps_per_s_range'][1]:,.0f}] {v['cpu_us_per_step']:.0f} us CPU "
            f"[{v['cpu_us_range'][0]:.0f}-{v['cpu_us_range'][1]:.0f}];"
            for risk, v in out.items()
        )
    )
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
