"""``runlog bench lag``: projection lag under a steady load, and drain rate by run length.

Three processes, so the load and the measurement do not share the runner's core:

* the runner: ``ProjectionRunner`` over every projection (``runlog project all``), a
  consumer-group member on a scratch topic;
* the load: ``tools.loadgen`` appending ``rate`` events/s spread over ``runs`` runs
  until each holds about ``events_per_run`` events; it records each record's
  (partition, offset, acknowledgement time);
* this one: samples every projection's stored position per partition every millisecond.

An event is visible once every projection's position in its partition reaches its offset
(positions commit in the same transaction as the effects). Its lag is the time from its
acknowledgement to then; both processes read CLOCK_MONOTONIC, which is system-wide.

The drain rate is one catch-up of every projection over a backlog of the same number of
events written as runs of different lengths: its cost per event must not grow with run
length.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.consumers._store import ProjectionKeys
from runlog.consumers.stores import PROJECTIONS
from runlog.log._clients import redis_client
from tools.benchmarks.common import percentile, worker_env
from tools.benchmarks.drain import drain_rate, fresh_settings
from tools.benchmarks.lag import Sampler

DRAIN_LENGTHS = (100, 1_000, 10_000)
BUCKET_S = 0.5
SAMPLE_S = 0.005


def _load(argv: list[str]) -> int:
    """Subprocess: ``load RATE RUNS SECONDS OUT``; appends and records acknowledgements."""
    from tools.loadgen import LoadGenerator  # the load process only

    rate, runs, seconds, out = float(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    acks: list[tuple[int, int, float]] = []
    gen = LoadGenerator(Settings(), on_ack=lambda p, o: acks.append((p, o, time.monotonic())))
    gen.steady(rate, seconds, runs=runs)
    Path(out).write_text("\n".join(f"{p} {o} {t}" for p, o, t in acks))
    return 0


def steady(
    base: Settings, *, rate: float, runs: int, events_per_run: int, timeout_s: float = 120
) -> dict[str, Any]:
    """Lag of every projection at a steady ``rate``; see the module docstring."""
    settings = fresh_settings(base)
    ensure_topics(settings)
    client = redis_client(settings)
    parts = range(settings.partitions)
    keys = [
        ProjectionKeys(settings.redis_key_prefix, n, settings.events_topic) for n in PROJECTIONS
    ]
    # One sampler over every (projection, partition): index i * partitions + p.
    pos_keys = [k.pos(p) for k in keys for p in parts]
    # 5 ms, not the latency benchmark's 1 ms: it shares the two cores with the runner.
    sampler = Sampler(client, pos_keys, SAMPLE_S)
    runner = subprocess.Popen(
        [sys.executable, "-m", "tools.benchmarks.worker", "project", ",".join(PROJECTIONS)],
        env=worker_env(settings),
        stdout=subprocess.PIPE,
        text=True,
    )
    seconds = runs * events_per_run / rate
    try:
        time.sleep(3)  # the runner joins its group (nothing to read yet)
        sampler.start()
        with tempfile.NamedTemporaryFile(suffix=".acks", delete=False) as f:
            acks_path = f.name
        load = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.benchmarks.steady_lag",
                "load",
                str(rate),
                str(runs),
                str(seconds),
                acks_path,
            ],
            env=worker_env(settings),
            check=True,
            timeout=seconds + 120,
        )
        assert load.returncode == 0
        acks = [
            (int(p), int(o), float(t))
            for p, o, t in (line.split() for line in Path(acks_path).read_text().splitlines())
        ]
        Path(acks_path).unlink()
        npart = settings.partitions

        def seen(p: int, o: int) -> float | None:
            ts = [sampler.visible_at(i * npart + p, o) for i in range(len(keys))]
            return None if any(t is None for t in ts) else max(t for t in ts if t is not None)

        last: dict[int, int] = {}
        for p, o, _ in acks:
            last[p] = max(o, last.get(p, -1))
        deadline = time.monotonic() + timeout_s
        caught_up = True
        while any(seen(p, o) is None for p, o in last.items()):
            if time.monotonic() > deadline:
                # Reported, not raised: the figures of a runner that falls behind are
                # the ones worth seeing (an unseen event's lag is at least this long).
                caught_up = False
                break
            time.sleep(0.2)
        gave_up = time.monotonic()
    finally:
        sampler.stop.set()
        if sampler.is_alive():
            sampler.join(timeout=5)
        runner.send_signal(signal.SIGTERM)
        runner.communicate(timeout=60)
        client.close()
    t0 = min(t for _, _, t in acks)
    lags = [(t - t0, max(0.0, (seen(p, o) or gave_up) - t)) for p, o, t in acks]
    buckets: dict[int, list[float]] = {}
    for at, lag in lags:
        buckets.setdefault(int(at / BUCKET_S), []).append(lag)
    return {
        "rate": rate,
        "runs": runs,
        "events_per_run": events_per_run,
        "events": len(acks),
        "caught_up": caught_up,
        "unseen": sum(1 for p, o, _ in acks if seen(p, o) is None),
        "sent_per_s": len(acks) / max(1e-9, max(t for _, _, t in acks) - t0),
        "p50_ms": percentile([x for _, x in lags], 50) * 1000,
        "p99_ms": percentile([x for _, x in lags], 99) * 1000,
        "max_ms": max(x for _, x in lags) * 1000,
        "over_time": [
            {"t_s": b * BUCKET_S, "p99_ms": percentile(v, 99) * 1000, "events": len(v)}
            for b, v in sorted(buckets.items())
        ],
    }


def drains(base: Settings, total: int, lengths: tuple[int, ...]) -> dict[int, float]:
    """Drain rate of every projection at each run length, ``total`` events each."""
    return {m: drain_rate(base, max(1, total // m), m, PROJECTIONS) for m in lengths}


def plot(res: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    files = []
    st = res["steady"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([b["t_s"] for b in st["over_time"]], [b["p99_ms"] for b in st["over_time"]])
    ax.set_xlabel("time since the load started (s)")
    ax.set_ylabel(f"lag p99 per {BUCKET_S}s (ms)")
    ax.set_title(
        f"projection lag, {st['rate']:.0f} events/s over {st['runs']} runs "
        f"(to {st['events_per_run']} events each)"
    )
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "lag_over_time.png", dpi=100)
    plt.close(fig)
    files.append(str(out / "lag_over_time.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = sorted(int(k) for k in res["drain"])
    ax.plot(xs, [res["drain"][str(x)] for x in xs], marker="o")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("events per run")
    ax.set_ylabel("drain rate, all projections (events/s)")
    ax.set_title(f"drain rate against run length ({res['drain_total']} events each)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "drain_by_run_length.png", dpi=100)
    plt.close(fig)
    files.append(str(out / "drain_by_run_length.png"))
    return files


def run(
    base: Settings,
    *,
    rate: float,
    runs: int,
    events_per_run: int,
    drain_total: int,
    out: Path | None,
) -> dict[str, Any]:
    res: dict[str, Any] = {
        "steady": steady(base, rate=rate, runs=runs, events_per_run=events_per_run)
    }
    lengths = tuple(sorted({*DRAIN_LENGTHS, events_per_run}))
    res["drain_total"] = drain_total
    res["drain"] = {str(k): v for k, v in drains(base, drain_total, lengths).items()}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        try:
            res["plots"] = plot(res, out)
        except ImportError:
            res["plots"] = []
        (out / "lag.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        sys.exit(_load(sys.argv[2:]))
    sys.exit(2)
