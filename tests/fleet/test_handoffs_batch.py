"""Runs a draining worker hands over together are taken by the receiver as a dead
worker's are (``Worker._take_handoffs``): their free leases in one round trip
(``LeaseManager.acquire_free``, each with its handover note), then claimed in batches
(``producers._opening.Batch``); a run whose lease someone else took meanwhile is left to
the per-run open, which finds it held. Runs a drain announced as coming are read once while
their last steps run (``Worker._warm_coming``), and their claims replay from that pass read
on to what the drainer wrote last (``Prefetch.top_up``). Real Kafka and Redis; the worker is
driven by hand (no group)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.fleet._handoffs import announce, announce_coming, coming_key, handoffs_key
from runlog.fleet._lifecycle import Record
from runlog.fleet._registry import Agent
from runlog.fleet._worker import Worker
from runlog.log._fold import read_run
from runlog.producers._engine import Engine, RunDeps, valid_kept
from runlog.producers._handle import Run
from runlog.producers._lease import Lease
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import partition_for
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

RUNS = 16
STARTED = {"code_version": "v1", "input_json": "null"}


def _effects_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:handoff-effects"


def _payer(settings: Settings, client: redis.Redis) -> tuple[runlog.Tool, Agent]:
    """A tool whose receiver counts each key, and an agent making two calls of it."""

    @runlog.tool("pay", risk="safe")
    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        client.hincrby(_effects_key(settings), idempotency_key, 1)
        return f"paid {args['step']}"

    def payer(run: Run, order: object) -> str:
        run.call_tool("pay", {"step": 1})
        run.call_tool("pay", {"step": 2})
        return "paid"

    return pay, Agent("payer", payer, (pay,))


@pytest.fixture
def services(test_settings: Settings) -> Iterator[list[Services]]:
    """The drainer, the receiver, and someone else who takes a lease meanwhile."""
    made = [Services(test_settings, writer_id=name) for name in ("drainer", "receiver", "intruder")]
    try:
        yield made
    finally:
        for svc in made:
            svc.close()


def _first_steps(deps: RunDeps, pay: runlog.Tool) -> dict[str, Engine]:
    """``RUNS`` runs of the drainer, each past its first call."""
    runs: dict[str, Engine] = {}
    for _ in range(RUNS):
        run = open_run_with(deps, tenant="t1", tools=[pay], agent="payer", started_with=STARTED)
        Run(run).call_tool("pay", {"step": 1})
        runs[run.run_id] = run
    return runs


def _take(worker: Worker, settings: Settings, runs: list[str]) -> None:
    """What the receiver's listener pops (``_listen``), then its main loop's take."""
    client = worker.deps.redis
    raws = client.lrange(handoffs_key(settings), 0, -1)
    client.delete(handoffs_key(settings))
    assert len(raws) == len(runs)
    for raw in raws:
        worker.handoffs.put(raw)
    worker._take_handoffs()


def _finish(worker: Worker) -> dict[str, str]:
    """Launch what is ready; each dispatch's result kind, by run id."""
    worker._launch()
    kinds = {rid: fut.result(timeout=60).kind for rid, fut in list(worker.active.items())}
    worker.active.clear()
    return kinds


def test_runs_handed_over_together_are_claimed_in_batches_and_a_held_one_is_opened_alone(
    test_settings: Settings, services: list[Services]
) -> None:
    settings = test_settings
    drainer, receiver, intruder = services
    client = receiver.redis
    pay, agent = _payer(settings, client)
    deps = drainer.run_deps()
    runs = _first_steps(deps, pay)
    # The drainer lets every run go at its step's boundary and announces them together.
    tokens = {rid: run.lease.token for rid, run in runs.items()}
    for run in runs.values():
        run.hand_over()
    announce(deps.redis, settings, [(rid, Record("open", "t1", "payer")) for rid in runs])
    # Meanwhile someone else (a live session) takes one of the free leases.
    held_rid = next(iter(runs))
    other = intruder.run_deps().leases.try_acquire("t1", held_rid, "intruder", 60_000)
    assert isinstance(other, Lease)

    worker = Worker(settings, receiver.run_deps(), {"payer": agent}, concurrency=64)
    try:
        _take(worker, settings, list(runs))
        assert set(worker.ready) == set(runs)
        # Every free lease taken in one go, with its handover note, and its run in a
        # batch; the held one has neither: its open finds it held.
        handed = set(runs) - {held_rid}
        assert set(worker.batches) == handed and not worker.claimed
        for rid in handed:
            lease = worker.batches[rid].leases()[rid]
            assert lease.handed_over_by == tokens[rid] and lease.check()
            assert lease.epoch == runs[rid].epoch + 1
        kinds = _finish(worker)
        assert kinds == {**dict.fromkeys(handed, "finished"), held_rid: "locked"}
        assert not worker.batches

        # The other holder lets its run go as a handover too; announced, it is taken the
        # same way.
        intruder.run_deps().leases.hand_over(other)
        announce(deps.redis, settings, [(held_rid, Record("open", "t1", "payer"))])
        _take(worker, settings, [held_rid])
        assert set(worker.batches) == {held_rid}
        assert worker.batches[held_rid].leases()[held_rid].handed_over_by == other.token
        assert _finish(worker) == {held_rid: "finished"}

        mine = worker.deps.writer_id
        first_claims: dict[int, list[int]] = {}
        reader = receiver.run_deps().reader_factory()
        try:
            for rid in runs:
                got = read_run(reader, client, settings, "t1", rid, keep=True)
                valid = valid_kept(got.folded)
                resumed = [e for e in valid if e.type is EventType.RUN_RESUMED]
                # Claimed once, by the receiver, naming who handed the run over.
                assert [e.writer_id for e in resumed] == [mine]
                by = other.token if rid == held_rid else tokens[rid]
                assert f"(handed over by {by})" in resumed[0].payload.reason
                assert valid[-1].type is EventType.RUN_FINISHED
                assert valid[-1].payload.outcome == "succeeded"
                if rid == held_rid:
                    continue
                p = partition_for(rid, settings.partitions)
                for rec in reader.read(rid, partition=p, start=0, end=None):
                    if rec.event.type is EventType.RUN_RESUMED:
                        first_claims.setdefault(p, []).append(rec.offset)
                        break
        finally:
            reader.close()
        # The batch's claims went out together: adjacent offsets in each partition.
        for offsets in first_claims.values():
            assert max(offsets) - min(offsets) + 1 == len(offsets)
        # Every effect once: the first calls by the drainer, the second ones here.
        counts = {k.decode(): int(v) for k, v in client.hgetall(_effects_key(settings)).items()}
        assert len(counts) == 2 * RUNS and set(counts.values()) == {1}
    finally:
        for batch in set(worker.batches.values()):
            for rid in batch.leases():
                batch.drop(rid)
        for lease in worker.claimed.values():
            lease.release()
        worker.pool.shutdown(wait=True)


def test_runs_announced_coming_are_read_once_before_and_claimed_past_their_last_steps(
    test_settings: Settings, services: list[Services]
) -> None:
    settings = test_settings
    drainer, receiver, _ = services
    client = receiver.redis
    pay, agent = _payer(settings, client)
    deps = drainer.run_deps()
    runs = _first_steps(deps, pay)
    # The drain begins: its runs are announced as coming while their steps run.
    coming: dict[int, dict[str, str]] = {}
    for rid in runs:
        coming.setdefault(partition_for(rid, settings.partitions), {})[rid] = "t1"
    announce_coming(deps.redis, settings, coming)

    worker = Worker(settings, receiver.run_deps(), {"payer": agent}, concurrency=64)
    try:
        raws = client.lrange(coming_key(settings), 0, -1)
        client.delete(coming_key(settings))
        assert len(raws) == len(coming)  # one entry per partition
        for raw in raws:
            worker.coming.put(raw)
        worker._warm_coming()
        assert set(worker.warm) == set(coming)
        rdeps = worker.deps
        passes = {p: warm for p, (warm, _) in worker.warm.items()}
        for warm in passes.values():  # read in the pool now; waited for here
            assert warm.load(settings, rdeps.redis, rdeps.reader_factory)
        ends = {p: warm.end for p, warm in passes.items()}

        # Each run's last step, written after the pass was read, then the handover.
        for run in runs.values():
            Run(run).call_tool("pay", {"step": 2})
            run.hand_over()
        announce(deps.redis, settings, [(rid, Record("open", "t1", "payer")) for rid in runs])
        _take(worker, settings, list(runs))
        assert set(worker.batches) == set(runs)
        for rid, batch in worker.batches.items():
            # The batch replays from the pass read before, not from one of its own.
            assert batch.prefetch is passes[partition_for(rid, settings.partitions)]
        kinds = _finish(worker)
        assert kinds == dict.fromkeys(runs, "finished")
        for p, warm in passes.items():
            assert warm.end > ends[p]  # read on to what the drainer wrote last

        mine = worker.deps.writer_id
        reader = receiver.run_deps().reader_factory()
        try:
            for rid in runs:
                p = partition_for(rid, settings.partitions)
                claims = [
                    rec.event
                    for rec in reader.read(rid, partition=p, start=0, end=None)
                    if rec.event.type is EventType.RUN_RESUMED
                ]
                # One claim each, the first one made: none lost its race to the drainer's
                # last step, which a pass that was not read on would have missed.
                assert [e.writer_id for e in claims] == [mine]
                got = read_run(reader, client, settings, "t1", rid, keep=True)
                valid = valid_kept(got.folded)
                assert valid[-1].type is EventType.RUN_FINISHED
                assert valid[-1].payload.outcome == "succeeded"
        finally:
            reader.close()
        # Every effect once, both by the drainer.
        counts = {k.decode(): int(v) for k, v in client.hgetall(_effects_key(settings)).items()}
        assert len(counts) == 2 * RUNS and set(counts.values()) == {1}
    finally:
        for batch in set(worker.batches.values()):
            for rid in batch.leases():
                batch.drop(rid)
        worker.pool.shutdown(wait=True)
        worker._batch_pool.shutdown(wait=True)


def test_an_announcement_of_runs_coming_reads_back_and_a_bad_one_is_refused(
    test_settings: Settings, services: list[Services]
) -> None:
    from runlog.fleet._handoffs import parse_coming

    client = services[1].redis
    announce_coming(client, test_settings, {2: {"r-a": "t1", "r-b": "t2"}, 0: {}})
    raws = client.lrange(coming_key(test_settings), 0, -1)
    assert [parse_coming(raw) for raw in raws] == [(2, {"r-a": "t1", "r-b": "t2"})]
    for bad in (b"no separator", b"1\0no tab", b"x\0r\tt"):
        with pytest.raises(ValueError):
            parse_coming(bad)
    # A worker given a bad one reports it and goes on with the good ones.
    worker = Worker(test_settings, services[1].run_deps(), {}, concurrency=4)
    try:
        worker.coming.put(b"no separator")
        worker.coming.put(raws[0])
        worker._warm_coming()
        assert set(worker.warm) == {2} and set(worker.warm[2][0].runs) == {"r-a", "r-b"}
        # Neither run has a start index: the pass fails, and runs of that partition taken
        # later get a pass of their own, not this failed one (which leaves each to read
        # alone).
        warm = worker.warm[2][0]
        deps = worker.deps
        assert not warm.load(test_settings, deps.redis, deps.reader_factory) and warm.failed
        rid = next(r for r in (f"r-{i}" for i in range(1000)) if partition_for(r, 3) == 2)
        assert test_settings.partitions == 3
        warm.runs[rid] = "t1"  # covered by the failed pass
        worker._prefetch({rid: "t1"})
        assert worker.prefetch[rid] is not warm and not worker.prefetch[rid].failed
    finally:
        worker.pool.shutdown(wait=True)
        worker._batch_pool.shutdown(wait=True)
