"""Section 3's in-memory replay stages, timed in CPU seconds of this process.

``python -m tools.benchmarks.replay_cpu [EVENTS] [REPEATS]``: the same three stages as
``runlog bench`` (``avro``: fastavro alone with the writer schema; ``decode``:
``codec.decode``; ``fold``: decode + ``run_state.apply``) over the same synthetic run, but
timed with ``time.process_time``, which a loaded shared machine disturbs far less than
the wall clock. Prints each stage's rate and the fold's rate as a share of Avro's.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable

import fastavro

from runlog.projections._run_state import RunState, apply
from runlog.schemas import _codec as codec
from tools.benchmarks.common import encode_all, make_events


def measure(events: int, repeats: int) -> dict[str, list[float]]:
    values = [r.value for r in encode_all(make_events("bench-replay-cpu", events))]

    def avro() -> None:
        for v in values:
            ws = codec.writer_schema_of(v)
            fastavro.schemaless_reader(io.BytesIO(v[codec.HEADER_LEN :]), ws.parsed)

    def decode() -> None:
        for v in values:
            codec.decode(v)

    def fold() -> None:
        state = RunState()
        for v in values:
            apply(state, codec.decode(v))
        if state.seq != events:
            raise RuntimeError(f"fold reached seq {state.seq} of {events}: workload invalid")

    stages: dict[str, Callable[[], None]] = {"avro": avro, "decode": decode, "fold": fold}
    out: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(repeats):
        for name, stage in stages.items():
            started = time.process_time()
            stage()
            out[name].append(time.process_time() - started)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    events = int(args[0]) if args else 20_000
    repeats = int(args[1]) if len(args) > 1 else 7
    res = measure(events, repeats)
    for name, times in res.items():
        print(f"{name:<7} {events / statistics.median(times):>9.0f} events/cpu-s")
    shares = sorted(a / f for a, f in zip(res["avro"], res["fold"], strict=True))
    print(
        f"fold rate / avro rate: median {statistics.median(shares):.2f} "
        f"[{shares[0]:.2f}-{shares[-1]:.2f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
