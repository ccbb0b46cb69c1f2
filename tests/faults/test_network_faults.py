"""Network partitions: a worker process in its own network namespace, cut from Redis or
from Kafka while it reaches the other (tests/faults/netns.py, the nemesis).

Each episode is fixed by its seed (which tool call the fault lands in, how many messages
the run has). The worker holds inside that call's effect (after the receiver recorded it)
while the nemesis cuts the link, so the call's COMPLETED is appended across the fault:
the case where a side effect happened and the writer cannot say so. Afterwards the log,
the final state and the receiver's ledger are checked: every append the worker was told
is durable is valid, no event id twice, no two owners, each effect once and recorded as a
completed call, no call left open.

Reproduce one: ``.venv/bin/python -m pytest tests/faults -k partition`` as root (the seeds
are the ``SEEDS`` below; ``RUNLOG_FAULTS_KEEP=1`` keeps the cluster between runs).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from faultkit import Ack, FaultReport, Journal, read_log, verify_effects, verify_run
from netns import Nemesis
from netns_worker import EXIT_CLEAR, EXIT_FENCED, FileLedger

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import RunLocked
from runlog.producers._opening import open_run_with
from runlog.projections._run_state import RunState
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

WORKER = Path(__file__).with_name("netns_worker.py")
SETTING_KEYS = (
    "bootstrap_servers",
    "redis_url",
    "topic_prefix",
    "redis_key_prefix",
    "partitions",
    "replication_factor",
    "lease_ttl_ms",
    "liveness_ttl_ms",
)
DELIVERY_TIMEOUT_MS = 4000
"""The worker's: a cut-off append's outcome is unknown after 4 s, not the default 30 s."""


@dataclass
class Episode:
    """One worker process in a namespace on one run, and what it was told."""

    settings: Settings
    nemesis: Nemesis
    node: str
    seed: int
    tmp: Path
    run_id: str = ""
    hold_at: int = 0
    target: int = 0

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.run_id = new_run_id()
        self.hold_at = rng.choice([0, 4, 8])
        self.target = self.hold_at + rng.randint(3, 6)
        self.ledger = FileLedger(self.tmp / "effects.log")
        self.acks = self.tmp / "acks.jsonl"
        self.hold = self.tmp / "hold"
        self.hold.mkdir()
        self.journal = Journal()
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(
        self, name: str, *, hold: bool = True, skew_s: float | None = None, **extra: Any
    ) -> Any:
        spec = {
            "settings": {k: getattr(self.settings, k) for k in SETTING_KEYS}
            | {"delivery_timeout_ms": DELIVERY_TIMEOUT_MS}
            | extra.pop("settings_extra", {}),
            "run_id": self.run_id,
            "writer_id": name,
            "acks": str(self.acks),
            "effects": str(self.ledger.path),
            "target": self.target,
            "hold_at": self.hold_at if hold else None,
            "hold_dir": str(self.hold) if hold else None,
            **extra,
        }
        env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
        proc = self.nemesis.popen(
            self.node,
            [sys.executable, str(WORKER), json.dumps(spec)],
            skew_s=skew_s,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.procs.append(proc)
        return proc

    def wait_held(self, proc: subprocess.Popen[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not (self.hold / "held").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the worker never reached its held call"
            time.sleep(0.02)

    def release(self) -> None:
        (self.hold / "release").touch()

    def held_key(self) -> str:
        return (self.hold / "held").read_text()

    def load_acks(self, worker: str, skew_s: float = 0.0) -> None:
        """The worker's acknowledgements, at real time (its wall clock less ``skew_s``)."""
        lines = self.acks.read_text().splitlines() if self.acks.exists() else []
        for ln in lines:
            a = json.loads(ln)
            wall = a["wall"] - skew_s
            self.journal.acks.append(
                Ack(self.run_id, worker, a["seq"], a["epoch"], a["event_id"], wall, wall)
            )
        self.acks.unlink(missing_ok=True)

    def check(self, report: FaultReport, name: str) -> tuple[RunState, list[Any]]:
        """Final open from the root namespace, then log, state and effects checked."""
        services = Services(self.settings, writer_id=f"final-{name}")
        try:
            with open_run_with(services.run_deps(), self.run_id, tools=[self.ledger.tool()]) as r:
                state = r.state
        finally:
            services.close()
        records = read_log(self.settings, self.run_id)
        check = verify_run(self.settings, self.run_id, self.journal, records)
        effects = verify_effects(self.ledger, [state])  # type: ignore[arg-type]
        report.add_checks([check])
        report.violations.extend(f"{name}: {e}" for e in effects)
        assert not check.lost, check.lost
        assert not check.violations, check.violations
        assert not effects, effects
        assert state.status == "finished", state.status
        if (self.hold / "held").exists():
            assert self.held_key() in state.completed_calls
            assert self.ledger.counts()[self.held_key()] == 1
        return state, records


def _takeover(settings: Settings, ep: Episode, name: str, wait_s: float) -> tuple[Services, Any]:
    services = Services(settings, writer_id=name)
    run = open_run_with(
        services.run_deps(), ep.run_id, tools=[ep.ledger.tool()], wait_s=wait_s, reason=name
    )
    return services, run


def _exit(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


SEEDS = {"redis": 4201, "kafka_both": 4202, "kafka_replies": 4203, "loss": 4204}


def test_partition_worker_cut_from_redis_loses_its_lease(
    healthy: Settings, nemesis: Nemesis, report: FaultReport, tmp_path: Path
) -> None:
    """Cut from Redis, still reaching Kafka: renewals fail, another owner takes over.

    The worker must not append a valid event after the takeover, nor produce one after
    its lease's local validity (0.8 TTL from the cut; its last renewal came before), and
    the call it was in is settled once, by the new owner's reconciliation or its own
    COMPLETED if that landed before the takeover.
    """
    t0 = time.monotonic()
    settings = healthy
    ep = Episode(settings, nemesis, "w1", SEEDS["redis"], tmp_path)
    nemesis.add_node("w1")
    proc = ep.spawn("netns-redis-cut")
    ep.wait_held(proc)
    nemesis.cut("w1", "redis")
    cut_wall = time.time()
    report.faults["partition: worker cut from Redis (both ways), reaching Kafka"] += 1
    ep.release()

    services, run = _takeover(settings, ep, "taker-redis", wait_s=20)
    try:
        taken_at = time.time()
        ttl = settings.lease_ttl_ms / 1000
        assert taken_at - cut_wall > 0.5 * min(ttl, settings.liveness_ttl_ms / 1000 or ttl)
        mine = [run.append(EventType.USER_MESSAGE, content=f"t{i}") for i in range(3)]
        nemesis.heal("w1", "redis")
        code, out = _exit(proc)
        assert code in (EXIT_FENCED, EXIT_CLEAR), out
        mine += [run.append(EventType.USER_MESSAGE, content=f"u{i}") for i in range(2)]
        mine.append(run.finish("completed", "taken over"))
        for ev in mine:
            ep.journal.acks.append(
                Ack(ep.run_id, "taker", ev.seq, ev.epoch, ev.event_id, time.time(), time.time())
            )
        epoch = run.epoch
    finally:
        run.close()
        services.close()
    ep.load_acks("netns-redis-cut")

    state, records = ep.check(report, "partition-redis")
    slack = 0.5
    late = [
        f"seq {r.event.seq} at {r.event.occurred_at.isoformat()}"
        for r in records
        if r.event.writer_id == "netns-redis-cut"
        and r.event.occurred_at.timestamp() > cut_wall + 0.8 * ttl + slack
    ]
    resumed = next(
        i
        for i, r in enumerate(records)
        if r.event.type is EventType.RUN_RESUMED and r.event.epoch == epoch
    )
    after = [r for r in records[resumed:] if r.event.writer_id == "netns-redis-cut"]
    report.stale_writes += len(after)
    report.notes.append(
        f"partition-redis seed {ep.seed}: held call {ep.hold_at}, worker exit {code} "
        f"({out.strip().splitlines()[-1] if out.strip() else ''}), "
        f"{len(after)} worker events after the takeover (fenced), {len(late)} past its validity"
    )
    assert not late, late
    assert state.fenced_writes >= len(after)
    report.durations["partition_redis"] = time.monotonic() - t0


@pytest.mark.parametrize(
    ("seed_name", "direction", "resume"),
    [("kafka_both", "both", "elsewhere"), ("kafka_replies", "in", "after_heal")],
)
def test_partition_worker_cut_from_kafka_outcome_unknown(
    healthy: Settings,
    nemesis: Nemesis,
    report: FaultReport,
    tmp_path: Path,
    seed_name: str,
    direction: str,
    resume: str,
) -> None:
    """Cut from Kafka (both ways, or only the brokers' replies), still reaching Redis.

    The COMPLETED of the call in progress times out: its outcome is unknown, the worker
    stops with a clear error (never a success, never a failure that would retry the
    call). Its lease was renewed meanwhile (no one may take the run while it lives).
    The run then resumes in the root namespace, or in the same namespace after the heal;
    the call is completed once: by reconciliation if its COMPLETED never landed, or from
    the log if it did (replies dropped: the broker wrote it, the worker never heard).
    """
    t0 = time.monotonic()
    settings = healthy
    ep = Episode(settings, nemesis, "w1", SEEDS[seed_name], tmp_path)
    nemesis.add_node("w1")
    proc = ep.spawn(f"netns-{seed_name}")
    ep.wait_held(proc)
    nemesis.cut("w1", "kafka", direction)
    report.faults[f"partition: worker cut from Kafka ({direction}), reaching Redis"] += 1
    ep.release()

    # While the worker waits for its delivery, its lease lives: the run is not free.
    probe = Services(settings, writer_id="probe")
    try:
        with pytest.raises(RunLocked):
            open_run_with(probe.run_deps(), ep.run_id, wait_s=0)
    finally:
        probe.close()
    code, out = _exit(proc, timeout=DELIVERY_TIMEOUT_MS / 1000 + 30)
    assert code == EXIT_CLEAR and "AppendOutcomeUnknown" in out, out
    ep.load_acks(f"netns-{seed_name}")

    if resume == "elsewhere":
        services, run = _takeover(settings, ep, "taker-kafka", wait_s=20)
        try:
            ev = run.finish("completed", "resumed elsewhere")
            ep.journal.acks.append(
                Ack(ep.run_id, "taker", ev.seq, ev.epoch, ev.event_id, time.time(), time.time())
            )
        finally:
            run.close()
            services.close()
        nemesis.heal("w1")
    else:
        nemesis.heal("w1")
        again = ep.spawn(f"netns-{seed_name}-2", hold=False)
        code2, out2 = _exit(again, timeout=60)
        assert code2 == 0, out2
        ep.load_acks(f"netns-{seed_name}-2")

    _state, records = ep.check(report, f"partition-kafka-{direction}")
    key = ep.held_key()
    completions = [
        r.event.payload
        for r in records
        if r.event.type is EventType.TOOL_CALL_COMPLETED
        and getattr(r.event.payload, "idempotency_key", None) == key
    ]
    sources = [getattr(p, "source", "?") for p in completions]
    report.notes.append(
        f"partition-kafka ({direction}) seed {ep.seed}: held call {ep.hold_at}, "
        f"completions of it in the log {sources}, resumed {resume}"
    )
    # Both ways: the COMPLETED never reached a broker, the new owner's lookup settled it.
    # Replies dropped: the broker wrote it though the worker heard nothing.
    expected = "reconciliation" if direction == "both" else "live"
    assert expected in sources, sources
    report.durations[f"partition_kafka_{direction}"] = time.monotonic() - t0


def test_loss_and_flapping_links_keep_one_owner_and_effects_once(
    healthy: Settings, nemesis: Nemesis, report: FaultReport, tmp_path: Path
) -> None:
    """20-40 % of the packets to Kafka and Redis dropped for 3 s, then the link to Redis
    flapping for at least 3 s (cut 1 s, healed 0.5 s) and until a flap has dropped a packet.

    Timeouts fire while requests may still land. A worker that stops (a clear error) is
    replaced in the same namespace, as a supervisor would; the run must finish with every
    acknowledged append valid, no event twice, each effect once and recorded.
    """
    t0 = time.monotonic()
    settings = healthy
    ep = Episode(settings, nemesis, "w1", SEEDS["loss"], tmp_path)
    ep.target = 36  # >= 10.8 s of paced steps: a live worker spans both phases
    nemesis.add_node("w1")
    rng = random.Random(ep.seed)
    loss = rng.choice([20, 30, 40])
    nemesis.drop("w1", "kafka", loss)
    nemesis.drop("w1", "redis", loss)
    report.faults[f"loss: {loss}% of packets to Kafka and Redis dropped"] += 1
    phase_end = time.monotonic() + 3
    flapping = None
    deadline = time.monotonic() + 90
    generation, codes, lossy = 0, [], 0
    while time.monotonic() < deadline:
        generation += 1
        name = f"netns-loss-g{generation}"
        proc = ep.spawn(name, hold=False, pace_s=0.3)
        while proc.poll() is None:
            if flapping is None and time.monotonic() > phase_end:
                lossy = nemesis.dropped("w1")
                nemesis.heal("w1")
                flapping = nemesis.flap("w1", "redis", down_s=1.0, up_s=0.5)
                report.faults["flap: worker's link to Redis cut 1 s, healed 0.5 s"] += 1
                phase_end = time.monotonic() + 3
            elif (
                flapping is not None
                and not flapping.is_set()
                and time.monotonic() > phase_end
                and nemesis.dropped("w1") > lossy
            ):
                # The flaps end once they have dropped a packet: a worker that was
                # starting up through both cuts would otherwise see none of them.
                flapping.set()
            time.sleep(0.05)
        out = proc.communicate()[0]
        codes.append(proc.returncode)
        ep.load_acks(name)
        assert proc.returncode in (0, EXIT_CLEAR, EXIT_FENCED), out
        if proc.returncode == 0:
            break
    if flapping is not None:
        flapping.set()
    time.sleep(0.1)
    nemesis.heal("w1")
    assert codes and codes[-1] == 0, f"the run did not finish: exits {codes}"
    assert flapping is not None and lossy > 0, "the loss phase dropped nothing"
    assert nemesis.dropped("w1") > lossy, "the flapping link dropped nothing"
    state, _ = ep.check(report, "loss-flap")
    report.notes.append(
        f"loss {loss}% then flap, seed {ep.seed}: {generation} worker processes "
        f"(exits {codes}), {lossy} packets dropped by the loss, "
        f"{nemesis.dropped('w1') - lossy} by the flaps, {len(state.completed_calls)} effects, "
        f"fenced_writes={state.fenced_writes}"
    )
    report.durations["loss_flap"] = time.monotonic() - t0
