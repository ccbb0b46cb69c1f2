"""The soak: each fault the reliability goals name, injected at scale on the 3-node cluster.

    python tests/explorer/soak.py [--scale 1.0] [--kills N] [--races N] [--leader-kills N]
                                  [--redis-restarts N] [--hostile N] [--partitions N]
                                  [--lossy N] [--skews N]

Full counts (``--scale 1``, about two hours on two cores): 1,000 random SIGKILLs of
worker processes, 1,000 barrier races, 50 partition-leader kills on RF 3 / min ISR 2,
50 Redis restarts (half of them losing the data), 1,000,000 hostile records through the
projection services, then (as root) 1,000 partition episodes, 1,000 lossy or delayed
links and 200 workers on a skewed clock (tests/explorer/soak_network.py, about 7 s each).
``--scale 0.01`` runs a hundredth of each; an explicit count wins.
It prints a table: faults injected, acknowledged appends, effects, lost, doubled,
quarantined, crashes (unclear errors of a worker or runner) and the duration of each phase,
and exits 1 if anything was lost, doubled or crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent), str(HERE.parent / "faults")]

import explorer as ex_mod  # noqa: E402
from explorer import Checker, Explorer, Outcome, environment  # noqa: E402

from runlog import stack  # noqa: E402
from runlog.schemas._keys import new_run_id  # noqa: E402

FULL = {
    "kills": 1000,
    "races": 1000,
    "leader_kills": 50,
    "redis_restarts": 50,
    "hostile": 1_000_000,
    "partitions": 1000,
    "lossy": 1000,
    "skews": 200,
}

NETWORK_PHASES = (("partitions", "partition"), ("lossy", "lossy"), ("skews", "skew"))
"""The soak's network phases and the soak_network.py family each runs."""


@dataclass
class Row:
    phase: str
    faults: int = 0
    acks: int = 0
    effects: int = 0
    lost: int = 0
    doubled: int = 0
    quarantined: int = 0
    crashes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _classify(row: Row, problems: list[str]) -> None:
    for p in problems:
        if "happened" in p and "times" in p:
            row.doubled += 1
        elif "acked" in p or "forgotten" in p:
            row.lost += 1
        elif "exited" in p or "hung" in p:
            row.crashes += 1
            row.notes.append(p[:600])
        else:
            row.notes.append(p[:300])


def _outcome_row(row: Row, out: Outcome, problems: list[str]) -> None:
    row.acks = out.acks
    row.effects = out.effects
    row.quarantined = out.quarantined
    _classify(row, problems)


@contextlib.contextmanager
def _explorer(
    cfg: stack.StackConfig, ledger: Any, seed: int, steps: int
) -> Iterator[tuple[Explorer, Outcome, Checker]]:
    """A ready explorer on the cluster, its outcome and its checker; torn down after."""
    ex = Explorer(cfg, ledger, seed)
    ex.out = out = Outcome(seed, steps, [])
    ex.ready()
    try:
        yield ex, out, Checker(ex)
    finally:
        ex.teardown()
        ex_mod.cleanup(ex)


# --------------------------------------------------------------------------- phases


def phase_kills(cfg: stack.StackConfig, ledger: Any, n: int, seed: int) -> Row:
    """Worker processes on a few runs, each SIGKILLed at a random moment, then resumed."""
    row = Row("worker SIGKILL")
    t0 = time.monotonic()
    rng = random.Random(seed)
    active = 4
    problems: list[str] = []
    with _explorer(cfg, ledger, seed, n) as (ex, out, checker):
        ex.spawn_runner()
        for i in range(active):
            ex.runs.append(f"{ex.ns}-r{i}")
            ex.spawn_worker(ex.runs[-1], takeover=True)
        kills = 0
        slots = list(ex.runs)
        while kills < n:
            problems += checker.exits()
            for k, rid in enumerate(slots):
                mine = [w for w in ex.workers if w.run_id == rid]
                if any(w.proc.poll() is None for w in mine):
                    continue
                last = mine[-1].proc.returncode if mine else None
                if last == 0:  # finished: a new run takes the slot
                    rid = f"{ex.ns}-r{len(ex.runs)}"
                    ex.runs.append(rid)
                    slots[k] = rid
                elif last == 5:  # escalated: a person approves, as an operator would
                    ex.decide(rid, approve=True)
                ex.spawn_worker(rid, takeover=True)
            time.sleep(rng.uniform(0.3, 2.5))
            live = ex.alive(ex.workers)
            if not live:
                continue
            victim = rng.choice(live)
            with contextlib.suppress(ProcessLookupError):
                victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=10)
            if victim.proc.returncode == -signal.SIGKILL:
                kills += 1
                if kills % 25 == 0:
                    problems += checker.doubles()
                    print(f"  kills {kills}/{n} ({len(ex.runs)} runs)", flush=True)
        row.faults = kills
        problems += checker.at_end()
        _outcome_row(row, out, problems)
    row.seconds = time.monotonic() - t0
    return row


def phase_races(settings_src: Any, n: int) -> Row:
    """Two processes released together by a barrier to open, append to and finish a run."""
    from workers import race
    from workers.common import assert_log_sound, read_log

    import runlog
    from runlog._bootstrap import Services
    from runlog._topics import ensure_topics
    from runlog.schemas._vocabulary import EventType

    row = Row("barrier race")
    t0 = time.monotonic()
    s = settings_src
    ensure_topics(s).raise_for_drift()
    trials = [(new_run_id(), "free") for _ in range(n)]
    for rid, _ in trials:
        with runlog.open_run(rid, settings=s) as run:
            run.append(EventType.USER_MESSAGE, content="race me")
    Services.shared(s).close()
    outcomes: dict[str, dict[int, str]] = {}
    with race.contenders(s, trials) as contest:
        for k in range(2 * n):
            rid, index, outcome, _epoch = contest.results.get(timeout=race.RESULT_TIMEOUT_S)
            outcomes.setdefault(rid, {})[index] = outcome
            if k % 200 == 0:
                print(f"  races {k // 2}/{n}", flush=True)
    row.faults = n
    for rid, _ in trials:
        got = outcomes.get(rid, {})
        winners = [i for i, o in got.items() if o == "won"]
        losers = [o for o in got.values() if o != "won"]
        if len(winners) != 1 or any(o not in ("RunLocked", "Fenced") for o in losers):
            row.doubled += 1
            row.notes.append(f"{rid}: {got}")
        try:
            events = [r.event for r in read_log(s, rid)]
            assert_log_sound(events)
            row.acks += sum(1 for _ in events)
        except AssertionError as exc:
            row.lost += 1
            row.notes.append(f"{rid}: {exc}")
    row.crashes = sum(1 for p in contest.procs if p.exitcode not in (0, None))
    row.seconds = time.monotonic() - t0
    return row


def _supervised(
    cfg: stack.StackConfig, name: str, n: int, inject: Any, *, contenders: int, tmp: Path
) -> Row:
    """Threads drive runs (faultkit's workload) while ``inject`` runs ``n`` faults."""
    from faultkit import Workload, final_open, verify_effects, verify_run

    from runlog._topics import ensure_topics

    row = Row(name)
    t0 = time.monotonic()
    prefix = f"soak-{name.split()[0].lower()}-{new_run_id()[-6:]}"
    s = ex_mod.cluster_settings(cfg, prefix)
    ensure_topics(s).raise_for_drift()
    work = Workload.start(s, 4, tmp / f"{prefix}.effects")
    journal, ledger = work.journal, work.ledger
    stop = threading.Event()
    done = Counter[str]()

    broke: list[str] = []

    def injector() -> None:
        try:
            for i in range(n):
                inject(s, i)
                done["faults"] += 1
                if i % 5 == 0:
                    print(f"  {name} {i + 1}/{n}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported in the row, not lost in a thread
            broke.append(f"the injector stopped after {done['faults']} faults: {exc!r}"[:400])
        finally:
            stop.set()

    th = threading.Thread(target=injector, daemon=True)
    th.start()
    finished = work.supervise(
        target=10**9, deadline_s=7200, pace_s=0.02, contenders=contenders, stop=stop
    )
    th.join()
    states = [final_open(s, rid, ledger) for rid in work.run_ids]
    checks = [verify_run(s, rid, journal) for rid in work.run_ids]
    effects = verify_effects(ledger, states)
    row.faults = done["faults"]
    row.acks = sum(c.acked for c in checks)
    row.effects = sum(ledger.counts().values())
    row.lost = sum(len(c.lost) for c in checks)
    row.doubled = sum(1 for e in effects if "times" in e) + sum(
        1 for c in checks for v in c.violations if "double" in v or "regression" in v
    )
    row.crashes = len(journal.unclear)
    row.notes += [e for e in effects if "times" not in e][:5] + journal.unclear[:5]
    row.notes += [f"{r} did not finish" for r, ok in finished.items() if not ok]
    row.notes.append(f"writers stopped by {dict(journal.stops)}")
    row.notes += broke
    row.seconds = time.monotonic() - t0
    return row


def phase_leader_kills(cfg: stack.StackConfig, n: int, tmp: Path) -> Row:
    from faultkit import partition_leaders, wait_full_isr

    def inject(s: Any, i: int) -> None:
        time.sleep(1.0)  # let the writers get going between kills
        leaders = partition_leaders(s)
        leader = leaders[i % len(leaders)][0]
        stack.kill_node(cfg, leader, sig=signal.SIGKILL)
        time.sleep(1.0)
        stack.start_node(cfg, leader)
        wait_full_isr(s)

    return _supervised(cfg, "leader kill -9", n, inject, contenders=1, tmp=tmp)


def phase_redis(cfg: stack.StackConfig, n: int, tmp: Path) -> Row:
    def inject(s: Any, i: int) -> None:
        time.sleep(1.0)
        stack.kill_redis(cfg, sig=signal.SIGKILL)
        time.sleep(0.3)
        for attempt in range(5):
            try:
                stack.start_redis(cfg, empty=i % 2 == 1 and attempt == 0)
                return
            except Exception:  # noqa: BLE001 - e.g. its port briefly held: try again
                if stack.redis_pid(cfg) is not None:
                    return
                time.sleep(1)
        stack.start_redis(cfg)

    return _supervised(cfg, "Redis restart", n, inject, contenders=2, tmp=tmp)


def phase_hostile(cfg: stack.StackConfig, ledger: Any, n: int, seed: int) -> Row:
    """Hostile records (garbage, bad keys, stale zombie events) through projection runners,
    with real runs beside them; the projections must equal a rebuild and verify pass."""
    from confluent_kafka import Producer

    from runlog.schemas._codec import encode, new_event_id
    from runlog.schemas._keys import partition_for

    row = Row("hostile records")
    t0 = time.monotonic()
    rng = random.Random(seed)
    with _explorer(cfg, ledger, seed, 0) as (ex, out, checker):
        ex.spawn_runner()
        for i in range(3):
            ex.runs.append(f"{ex.ns}-r{i}")
            ex.spawn_worker(ex.runs[-1])
        time.sleep(3.5)
        for w in ex.workers:  # killed mid-run, so a takeover moves the run to epoch 2
            w.proc.kill()
            w.proc.wait(timeout=30)
        for rid in ex.runs:
            p = ex.spawn_worker(rid, takeover=True)
            assert p is not None
            p.proc.wait(timeout=120)
        # A zombie writes with an epoch older than the run's: every reader fences it.
        zombies = []
        for rid in ex.runs:
            valid = [e for e, ok in ex_mod.verdicts(ex.read(rid)) if ok]
            if valid and valid[-1].epoch >= 2:
                zombies.append((rid, valid[-1]))
        producer = Producer({**ex.s.kafka_common(), "linger.ms": 50, "batch.size": 1_000_000})
        topic = ex.s.events_topic
        ghosts: list[tuple[int, int]] = []
        sent = 0
        while sent < n:
            kind = sent % 5
            part = sent % ex_mod.PARTITIONS
            if kind == 0:
                key: Any = f"{ex.ns}-ghost{rng.randrange(50)}"
                producer.produce(
                    topic,
                    rng.randbytes(24),
                    key,
                    partition=part,
                    on_delivery=lambda err, msg: (
                        err or ghosts.append((msg.partition(), msg.offset()))
                    ),
                )
            elif kind == 1:
                producer.produce(topic, b"\xc3\x01" + rng.randbytes(16), None, partition=part)
            elif kind == 2:
                producer.produce(topic, b"\x00", b"\xff\xfe", partition=part)
            elif kind == 3:
                producer.produce(topic, b"{}", "bad key*", partition=part)
            elif not zombies:
                producer.produce(topic, b"\x00", "bad key*", partition=part)
            else:
                rid, last = zombies[sent % len(zombies)]
                ev = last.model_copy(
                    update={
                        "event_id": new_event_id(),
                        "seq": last.seq + 1 + sent,
                        "epoch": last.epoch - 1,
                        "writer_id": "zombie",
                    }
                )
                producer.produce(
                    topic, encode(ev), rid, partition=partition_for(rid, ex_mod.PARTITIONS)
                )
            sent += 1
            if sent % 10_000 == 0:
                producer.poll(0)
            if sent % 100_000 == 0:
                producer.flush(120)
                print(f"  hostile {sent}/{n}", flush=True)
        producer.flush(300)
        ex.ghosts = ghosts
        row.faults = sent
        problems = checker.at_end()
        _outcome_row(row, out, problems)
    row.seconds = time.monotonic() - t0
    return row


# --------------------------------------------------------------------------- table


def phase_network(cfg: stack.StackConfig, family: str, n: int, seed: int, tmp: Path) -> Row:
    """``n`` episodes of a network family (tests/explorer/soak_network.py), seeds from
    ``seed``: a worker in a namespace, its link cut, lossy, slowed or its clock skewed."""
    import soak_network

    verdicts, seconds = soak_network.run_phase(
        cfg, family, n, seed, tmp, progress=lambda m: print(m, flush=True)
    )
    row = Row(f"network: {family}", seconds=seconds)
    row.faults = len(verdicts)
    row.acks = sum(v.acks for v in verdicts)
    row.effects = sum(v.effects for v in verdicts)
    row.lost = sum(len(v.lost) for v in verdicts)
    row.doubled = sum(len(v.doubled) for v in verdicts)
    row.crashes = sum(1 for v in verdicts if v.other or v.stuck)
    kinds = Counter(
        " ".join(v.fault.split()[: 1 if v.fault.startswith("delay") else 2]) for v in verdicts
    )
    hit = sum(v.hit for v in verdicts)
    row.notes.append(
        f"seeds {seed}-{seed + n - 1}; the fault reached traffic in {hit} of {n} episodes; "
        f"{sum(v.generations for v in verdicts)} worker processes; {dict(kinds)}"
    )
    for v in verdicts:
        if not v.clean:
            problems = v.lost + v.doubled + v.other + (["stuck"] if v.stuck else [])
            row.notes.append(f"seed {v.seed} ({v.fault}): {problems[:3]}"[:500])
    return row


def table(rows: list[Row], total_s: float, command: str) -> str:
    head = (
        "| phase | faults injected | acknowledged appends | effects | lost | doubled "
        "| quarantined | crashes | duration |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.faults:,} | {r.acks:,} | {r.effects:,} | {r.lost} | "
            f"{r.doubled} | {r.quarantined:,} | {r.crashes} | {r.seconds:.0f} s |"
        )
    lines.append(
        f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {total_s / 60:.1f} min: "
        f"`{command}`"
    )
    for r in rows:
        for note in r.notes:
            lines.append(f"- {r.phase}: {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soak")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    for name in FULL:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--json", default="", help="also write the rows here")
    opts = ap.parse_args(argv)
    counts = {
        k: getattr(opts, k) if getattr(opts, k) is not None else max(1, round(v * opts.scale))
        for k, v in FULL.items()
    }
    command = "make soak " + " ".join(f"{k.upper()}={v}" for k, v in counts.items())
    print(f"soak: {counts}", flush=True)
    t0 = time.monotonic()
    rows: list[Row] = []
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    with environment() as (cfg, ledger):
        base = ex_mod.cluster_settings(cfg, f"soak-race-{new_run_id()[-6:]}")
        phases = [
            ("kills", lambda: phase_kills(cfg, ledger, counts["kills"], opts.seed)),
            ("races", lambda: phase_races(base, counts["races"])),
            ("leader_kills", lambda: phase_leader_kills(cfg, counts["leader_kills"], tmp)),
            ("redis_restarts", lambda: phase_redis(cfg, counts["redis_restarts"], tmp)),
            ("hostile", lambda: phase_hostile(cfg, ledger, counts["hostile"], opts.seed)),
            *(
                (name, lambda f=family, k=name: phase_network(cfg, f, counts[k], opts.seed, tmp))
                for name, family in NETWORK_PHASES
            ),
        ]
        for name, fn in phases:
            if counts[name] <= 0:
                continue
            print(f"phase {name}...", flush=True)
            try:
                rows.append(fn())
            except Exception as exc:  # noqa: BLE001 - a phase that broke is a row, not a stop
                rows.append(Row(name, crashes=1, notes=[f"{type(exc).__name__}: {exc}"[:500]]))
            print(table(rows[-1:], 0, command).splitlines()[2], flush=True)
    text = table(rows, time.monotonic() - t0, command)
    print(text)
    if opts.json:
        Path(opts.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    bad = any(r.lost or r.doubled or r.crashes for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
