"""Clock skew: worker processes whose real wall clock runs 30 s ahead of or behind this one.

Each worker runs in a network namespace of the nemesis (tests/faults/netns.py) under
libfaketime (``Nemesis.popen(..., skew_s=...)``, with the shim that makes librdkafka's
timed waits honour it): ``time.time``, ``datetime.now`` and so every timestamp runlog
takes (run ids' embedded time, events' ``occurred_at``, Kafka record timestamps, timers'
and approvals' ``due_at``) are the skewed clock's; the monotonic clock moves at the real
rate. What this process does (takeovers, decisions, the final open) uses the real clock.

Each episode checks the log (every acknowledged append valid, no event id twice, no two
owners), the final state (finished, nothing open) and the receiver's ledger (each effect
once, and a completed call), and what the skew threatens:

* the lease's local validity is a monotonic deadline: a skewed worker cut from Redis stops
  appending 0.8 TTL after its last renewal by the real clock, ahead or behind;
* a run id minted by a clock ahead, whose events a clock behind wrote (60 s apart, the
  reader's whole skew margin), is still read from its first event by a reader on this
  clock: the run is resumed, never started again;
* a durable timer recorded by one clock and reached again by a worker on another fires
  once (one TIMER_STARTED), and its ``due_at`` is the recording clock's;
* an approval's deadline is the requesting clock's, and its decision stands once;
* librdkafka's own timed waits (a poll's timeout) last their real length ahead or behind.

Reproduce: ``.venv/bin/python -m pytest tests/faults -k skew`` as root (seeds ``SEEDS``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultkit import Ack, FaultReport
from netns import Nemesis
from netns_worker import EXIT_CLEAR, EXIT_FENCED
from test_network_faults import Episode, _exit, _takeover

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import new_run_id, partition_for, run_id_time_ms, start_key
from runlog.schemas._vocabulary import EventType

SKEW_S = 30.0
SEEDS = {"ahead": 4205, "behind": 4206, "timer": 4207}
SLACK_S = 3.0
"""How far a skewed timestamp may stray from real time + skew (process start, scheduling)."""


def _mint(nemesis: Nemesis, node: str, skew_s: float) -> tuple[str, float]:
    """A run id minted by ``new_run_id`` in a process on the skewed clock; the real time."""
    code = "from runlog.schemas._keys import new_run_id; print(new_run_id())"
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    proc = nemesis.popen(
        node,
        [sys.executable, "-c", code],
        skew_s=skew_s,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out.strip(), time.time()


def _assert_skewed(run_id: str, minted_real: float, skew_s: float) -> None:
    """The id's embedded time is the skewed clock's: evidence the skew reached the process."""
    embedded = (run_id_time_ms(run_id) or 0) / 1000
    assert abs(embedded - (minted_real + skew_s)) < SLACK_S, (embedded, minted_real, skew_s)


@pytest.mark.parametrize("side", ["ahead", "behind"])
def test_skew_worker_cut_from_redis_stops_within_its_lease(
    healthy: Settings, nemesis: Nemesis, report: FaultReport, tmp_path: Path, side: str
) -> None:
    """A worker 30 s ahead or behind, cut from Redis inside a tool call, taken over here.

    Its lease's local validity is monotonic, so the skew changes nothing: it appends no
    valid event after the takeover and none later than 0.8 TTL after the cut by the real
    clock (its events' ``occurred_at`` minus the skew); the run whose id it minted is
    found and resumed here; the call is completed once.
    """
    t0 = time.monotonic()
    skew = SKEW_S if side == "ahead" else -SKEW_S
    ep = Episode(healthy, nemesis, "w1", SEEDS[side], tmp_path)
    nemesis.add_node("w1")
    ep.run_id, minted = _mint(nemesis, "w1", skew)
    _assert_skewed(ep.run_id, minted, skew)
    proc = ep.spawn(f"skew-{side}", skew_s=skew)
    ep.wait_held(proc)
    nemesis.cut("w1", "redis")
    cut_wall = time.time()
    report.faults[f"skew: worker {skew:+.0f}s cut from Redis, reaching Kafka"] += 1
    ep.release()

    services, run = _takeover(healthy, ep, f"taker-skew-{side}", wait_s=20)
    try:
        mine = [run.append(EventType.USER_MESSAGE, content=f"t{i}") for i in range(2)]
        nemesis.heal("w1", "redis")
        code, out = _exit(proc)
        assert code in (EXIT_FENCED, EXIT_CLEAR), out
        mine.append(run.finish("completed", "taken over"))
        for ev in mine:
            ep.journal.acks.append(
                Ack(ep.run_id, "taker", ev.seq, ev.epoch, ev.event_id, time.time(), time.time())
            )
    finally:
        run.close()
        services.close()
    ep.load_acks(f"skew-{side}", skew)

    _, records = ep.check(report, f"skew-{side}")
    theirs = [r for r in records if r.event.writer_id == f"skew-{side}"]
    assert theirs, "the skewed worker appended nothing"
    first = theirs[0].event.occurred_at.timestamp()
    assert abs(first - skew - minted) < 10 + SLACK_S, "its events are not on the skewed clock"
    ttl = healthy.lease_ttl_ms / 1000
    late = [
        f"seq {r.event.seq} at {r.event.occurred_at.isoformat()} (skew {skew:+.0f}s)"
        for r in theirs
        if r.event.occurred_at.timestamp() - skew > cut_wall + 0.8 * ttl + 0.5
    ]
    assert not late, late
    report.notes.append(
        f"skew-{side} seed {ep.seed}: id minted {skew:+.0f}s, held call {ep.hold_at}, "
        f"worker exit {code}, {len(theirs)} worker events, none past its validity"
    )
    report.durations[f"skew_{side}"] = time.monotonic() - t0


def test_skew_timer_and_deadline_across_clocks_60s_apart(
    healthy: Settings, nemesis: Nemesis, report: FaultReport, tmp_path: Path
) -> None:
    """A run minted 30 s ahead, written 30 s behind, killed, decided here, resumed ahead.

    The first worker (-30 s) records a durable timer and asks for an approval with a
    deadline, then is SIGKILLed inside a tool call. A neighbour run on its partition is
    written by a clock ahead, and Redis forgets the run's start offset. This process takes
    the run over (its reader must find the history from the id's time: id time and record
    timestamps are 60 s apart, the reader's whole margin; were its margin short, the
    fold's read from the partition's beginning would still find it) and decides the
    approval. A second worker (+30 s) resumes, re-executes the timer (due long ago by its
    clock: not recorded again) and finishes.
    """
    t0 = time.monotonic()
    rng = random.Random(SEEDS["timer"])
    sleep_s, deadline_s = rng.choice([0.5, 1.0]), rng.choice([120.0, 300.0])
    ep = Episode(healthy, nemesis, "w1", SEEDS["timer"], tmp_path)
    ep.hold_at = 4  # the tool call after the timer (message 1) and the approval (message 2)
    ep.target = ep.hold_at + rng.randint(2, 4)
    nemesis.add_node("w1")
    ep.run_id, minted = _mint(nemesis, "w1", SKEW_S)
    _assert_skewed(ep.run_id, minted, SKEW_S)
    extra = {"sleep_at": 1, "sleep_s": sleep_s, "approval_at": 2, "deadline_s": deadline_s}
    behind = ep.spawn("skew-behind", skew_s=-SKEW_S, **extra)
    ep.wait_held(behind)
    asked_real = time.time()
    os.killpg(behind.pid, signal.SIGKILL)
    behind.wait(timeout=10)
    report.faults["skew: worker -30s killed in a call, run minted +30s"] += 1
    ep.load_acks("skew-behind", -SKEW_S)
    # A neighbour on the run's partition, written after it by the clock ahead: its records'
    # timestamps are past the id's time, where a reader with less margin would start.
    count = healthy.partitions
    neighbour = next(
        rid
        for rid in iter(new_run_id, None)
        if partition_for(rid, count) == partition_for(ep.run_id, count)
    )
    (tmp_path / "neighbour").mkdir()
    side = Episode(healthy, nemesis, "w1", SEEDS["timer"], tmp_path / "neighbour")
    side.run_id, side.target = neighbour, 1
    code, out = _exit(side.spawn("neighbour", hold=False, skew_s=SKEW_S), timeout=60)
    assert code == 0, out

    services = Services(healthy, writer_id="decider")
    try:
        # Redis lost the run's start offset (restored from an older copy): the reader falls
        # back on the id's embedded time, minus its margin, to find the first event.
        assert services.redis.delete(start_key(healthy.redis_key_prefix, "default", ep.run_id))
        with open_run_with(
            services.run_deps(), ep.run_id, tools=[ep.ledger.tool()], wait_s=20, reason="decide"
        ) as run:
            (timer,) = run.state.timers
            (approval_id, approval) = next(iter(run.state.approvals.items()))
            assert approval.due_at is not None
            # Both are the recording clock's: 30 s behind this one.
            assert abs(timer.due_at.timestamp() - (asked_real - SKEW_S)) < 10 + SLACK_S
            due = approval.due_at.timestamp()
            assert abs(due - (asked_real - SKEW_S + deadline_s)) < 10 + SLACK_S
            run.decide(approval_id, approved=True, decided_by="skew-test")
            decided_seq = run.state.seq
    finally:
        services.close()

    ahead = ep.spawn("skew-ahead", hold=False, skew_s=SKEW_S, wait_s=20, **extra)
    code, out = _exit(ahead, timeout=60)
    assert code == 0, out
    ep.load_acks("skew-ahead", SKEW_S)

    state, records = ep.check(report, "skew-timer")
    started = [r for r in records if r.event.type is EventType.TIMER_STARTED]
    assert len(started) == 1, [r.event.seq for r in started]
    decided = [r for r in records if r.event.type is EventType.APPROVAL_DECIDED]
    assert len(decided) == 1 and decided[0].event.seq == decided_seq
    assert state.approvals[approval_id].approved is True
    report.notes.append(
        f"skew-timer seed {ep.seed}: minted +30s, written -30s, resumed +30s; "
        f"1 TIMER_STARTED (sleep {sleep_s}s), approval due {deadline_s:.0f}s by the -30s clock"
    )
    report.durations["skew_timer"] = time.monotonic() - t0


PROBE = """
import json, sys, time
from confluent_kafka import Consumer
c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": "rl-skew-probe"})
c.list_topics(timeout=10)
t0 = time.monotonic()
c.poll(1.0)
print(json.dumps({"poll_s": time.monotonic() - t0}))
c.close()
"""


@pytest.mark.parametrize("skew", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
def test_skew_librdkafka_waits_last_their_real_length(
    healthy: Settings, nemesis: Nemesis, skew: float
) -> None:
    """A 1 s poll of an idle consumer lasts 1 s on a skewed clock, not 31 s, not 0.

    Without the shim (netns.py, ``faketime_c11.c``) librdkafka's C11 timed waits keep the
    faked deadline on the real clock: at +30 s this poll takes 31 s, at -30 s it returns
    at once, and so do its reconnect backoffs and metadata retries.
    """
    nemesis.add_node("w1")
    proc = nemesis.popen(
        "w1",
        [sys.executable, "-c", PROBE, healthy.bootstrap_servers],
        skew_s=skew,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a 1 s poll at {skew:+.0f}s did not return in 20 s")
    assert proc.returncode == 0, out
    poll_s = json.loads(out.strip().splitlines()[-1])["poll_s"]
    assert 0.8 < poll_s < 3.0, f"a 1 s poll lasted {poll_s:.2f} s at {skew:+.0f}s"
