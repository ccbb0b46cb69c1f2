"""One run's durable step against the broker's floor, wall and CPU per step.

``python -m tools.benchmarks.safe_step [--steps N] [--chunks K] [--irreversible M]``, on
scratch topics of the stack the ``RUNLOG_*`` settings name (deleted afterwards). In one
process and one run, chunks of three loops alternate, so a noisy machine weighs on each
alike:

* ``floor``: N produce + flush round trips of one 400-byte record (runlog's producer
  settings, ``linger.ms=0``): the broker's floor;
* ``safe``: N ``Run.call_tool`` of a safe tool returning 300 bytes (STARTED and COMPLETED
  pipelined, the run's cancel check before each call);
* ``irreversible``: M calls of an irreversible one (two barriers, STARTED confirmed first).

Prints the medians over the chunks of wall (ms) and process CPU (us) per step, and the
ratios safe / floor and irreversible / safe (``--json``: as JSON too). Uses only what
older versions of runlog have too, so the same file run by another tree's interpreter
compares two versions in one sitting (alternate them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

RESULT = "r" * 300
RECORD = b"x" * 400


def _timed(loop: Callable[[int], None], n: int) -> tuple[float, float]:
    """``(wall ms, process CPU us)`` per step of ``loop(n)``."""
    w0, c0 = time.perf_counter(), time.process_time()
    loop(n)
    return (time.perf_counter() - w0) / n * 1e3, (time.process_time() - c0) / n * 1e6


def measure(*, steps: int, chunks: int, irreversible: int) -> dict[str, Any]:
    from confluent_kafka import Producer

    import runlog
    from runlog._bootstrap import Services
    from runlog._settings import Settings
    from runlog.producers._opening import open_run_with
    from runlog.producers._writer import producer_config
    from tools.benchmarks.common import TENANT, Scratch

    scratch = Scratch.create(Settings())
    s = scratch.settings
    svc = Services(s)
    got: dict[str, list[tuple[float, float]]] = {"floor": [], "safe": [], "irreversible": []}
    try:
        producer = Producer(producer_config(s, {"linger.ms": "0"}))
        key = uuid.uuid4().hex.encode()

        def floor(n: int) -> None:
            for _ in range(n):
                producer.produce(s.events_topic, value=RECORD, key=key)
                producer.flush(30)

        tools = [
            runlog.tool("lookup", risk="safe")(lambda args, *, idempotency_key: RESULT),
            runlog.tool("pay", risk="irreversible")(lambda args, *, idempotency_key: RESULT),
        ]
        with open_run_with(svc.run_deps(), None, tenant=TENANT, tools=tools, recover=False) as run:
            # The calls go through the handle users hold (``runlog.Run``), whichever version
            # runs this: an older ``open_run_with`` returns one, a newer one its engine.
            handle = run if isinstance(run, runlog.Run) else runlog.Run(run)

            def calls(name: str) -> Callable[[int], None]:
                def loop(n: int) -> None:
                    for i in range(n):
                        handle.call_tool(name, {"i": i, "u": uuid.uuid4().hex})

                return loop

            safe, pay = calls("lookup"), calls("pay")
            floor(100)  # warm-up
            safe(100)
            pay(20 if irreversible else 0)
            for _ in range(chunks):
                got["floor"].append(_timed(floor, steps))
                run.barrier()
                got["safe"].append(_timed(safe, steps))
                run.barrier()  # the pipelined appends made durable outside the timing
                if irreversible:
                    got["irreversible"].append(_timed(pay, irreversible))
    finally:
        svc.close()
        scratch.cleanup()
    out: dict[str, Any] = {
        name: {
            "wall_ms": statistics.median(w for w, _ in rows),
            "cpu_us": statistics.median(c for _, c in rows),
        }
        for name, rows in got.items()
        if rows
    }
    out["safe_over_floor"] = out["safe"]["wall_ms"] / out["floor"]["wall_ms"]
    if irreversible:
        out["irreversible_over_safe"] = out["irreversible"]["wall_ms"] / out["safe"]["wall_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500, help="floor and safe steps per chunk")
    p.add_argument("--chunks", type=int, default=5, help="chunks of each loop, alternating")
    p.add_argument("--irreversible", type=int, default=100, help="irreversible steps per chunk")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    a = p.parse_args()
    out = measure(steps=a.steps, chunks=a.chunks, irreversible=a.irreversible)
    line = " ".join(
        f"{k} {v['wall_ms']:.3f} ms {v['cpu_us']:.0f} us CPU;"
        for k, v in out.items()
        if isinstance(v, dict)
    )
    line += f" safe/floor {out['safe_over_floor']:.2f}"
    if "irreversible_over_safe" in out:
        line += f" irreversible/safe {out['irreversible_over_safe']:.2f}"
    print(line)
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
