"""A dead worker's runs are claimed in batches (``producers._opening.Batch``): their
RUN_RESUMED sent together, acknowledged by one flush, each confirmed by reading the log
back; a claim a stale writer's append beat is made again on the per-run path. Real Kafka
and Redis; the worker is driven by hand (no group)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import Fenced
from runlog.fleet._registry import Agent
from runlog.fleet._worker import Worker, held_key
from runlog.log._fold import read_run
from runlog.producers._approvals import decisions_key
from runlog.producers._async_run import AsyncRun
from runlog.producers._control import request_cancel
from runlog.producers._engine import Engine, valid_kept
from runlog.producers._handle import Run
from runlog.producers._lease import METRICS
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import live_key, partition_for
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

RUNS = 24
STARTED = {"code_version": "v1", "input_json": "null"}
"""What a start by the agent registry records (the run is the agent's)."""


def _effects_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:batch-effects"


def _payer(
    settings: Settings, client: redis.Redis, *, is_async: bool = False
) -> tuple[runlog.Tool, Agent]:
    """A tool whose receiver counts each key (outside every run), and an agent making two
    calls of it: re-executed after a takeover, the first returns its recorded result."""

    @runlog.tool("pay", risk="safe")
    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        client.hincrby(_effects_key(settings), idempotency_key, 1)
        return f"paid {args['step']}"

    def payer(run: Run, order: object) -> str:
        run.call_tool("pay", {"step": 1})
        run.call_tool("pay", {"step": 2})
        return "paid"

    async def payer_async(run: AsyncRun, order: object) -> str:
        await run.call_tool("pay", {"step": 1})
        await run.call_tool("pay", {"step": 2})
        return "paid"

    return pay, Agent("payer", payer_async if is_async else payer, (pay,))


@pytest.fixture
def dead(test_settings: Settings) -> Iterator[Services]:
    """The process that dies (its own producer and session)."""
    svc = Services(test_settings, writer_id="dead-worker")
    yield svc
    svc.close()


@pytest.fixture
def services(test_settings: Settings) -> Iterator[Services]:
    svc = Services(test_settings, writer_id="heir-worker")
    yield svc
    svc.close()


def _log(settings: Settings, services: Services, rid: str) -> tuple[list[Any], list[Any]]:
    """Every record of the run, and its valid events, as every reader folds them."""
    reader = services.run_deps().reader_factory()
    try:
        got = read_run(reader, services.redis, settings, "t1", rid, keep=True)
    finally:
        reader.close()
    return [rec.event for rec in got.folded.kept], valid_kept(got.folded)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_dead_workers_runs_are_claimed_in_batches_and_a_lost_claim_is_made_again(
    test_settings: Settings, dead: Services, services: Services, is_async: bool
) -> None:
    """A sync agent's dispatch takes its run from the batch in its thread, an async one's
    awaits the batch in the event loop."""
    settings = test_settings
    client = services.redis
    pay, agent = _payer(settings, client, is_async=is_async)
    # The dead worker: each run started and its first call made, then the process dies
    # holding every lease (its session's key goes; its runs are in its held set).
    deps = dead.run_deps()
    runs: dict[str, Engine] = {}
    for _ in range(RUNS):
        run = open_run_with(deps, tenant="t1", tools=[pay], agent="payer", started_with=STARTED)
        Run(run).call_tool("pay", {"step": 1})
        runs[run.run_id] = run
    stale_rid, cancelled_rid = list(runs)[:2]
    stale = runs[stale_rid]
    # A person cancels a run while the dead worker holds it: queued in its inbox, which
    # the batch reads with its claims; the run must end cancelled, its second call never
    # made.
    queued = request_cancel(
        services.run_deps(), cancelled_rid, tenant="t1", reason="stop", by="alice", wait_s=0
    )
    assert queued == "queued"
    sid = deps.leases.session_id()
    client.hset(held_key(settings, sid), mapping={r: "t1\tpayer" for r in runs})
    client.delete(live_key(settings.redis_key_prefix, sid))

    worker = Worker(settings, services.run_deps(), {"payer": agent}, concurrency=64)
    try:
        worker._adopt()
        assert set(worker.ready) == set(runs)
        # Every run that will have a slot at once is in a batch, its lease taken (one
        # epoch up); none is opened yet.
        assert set(worker.batches) == set(runs) and not worker.claimed
        for rid in runs:
            lease = worker.batches[rid].leases()[rid]
            assert lease.epoch == runs[rid].epoch + 1 and lease.check()
        # The pass over the stale run's partition is read now; then the paused ex-owner,
        # which had confirmed its lease just before it lost it, appends: its record lands
        # after the pass and before the batch's claim (valid: it came first), and it is
        # refused at its barrier (the lease is the worker's).
        worker.prefetch[stale_rid].load(settings, client, worker.deps.reader_factory)
        stale_ev = stale.emit_confirmed(EventType.MEMORY_WRITTEN, {"key": "k", "value": "v"})
        with pytest.raises(Fenced):
            stale.barrier()
        lost_before = METRICS["claims_lost"]

        worker._launch()
        assert set(worker.active) == set(runs)
        kinds = {rid: fut.result(timeout=60).kind for rid, fut in list(worker.active.items())}
        assert set(kinds.values()) == {"finished"} and not worker.batches
        assert METRICS["claims_lost"] - lost_before == 1  # the stale run's, alone

        mine = worker.deps.writer_id
        first_claims: dict[int, list[int]] = {}
        for rid in runs:
            records, valid = _log(settings, services, rid)
            resumed = [e for e in records if e.type is EventType.RUN_RESUMED]
            valid_resumed = [e for e in valid if e.type is EventType.RUN_RESUMED]
            assert [e.writer_id for e in valid_resumed] == [mine]  # claimed once, by us
            assert valid[-1].type is EventType.RUN_FINISHED
            outcome = "cancelled" if rid == cancelled_rid else "succeeded"
            assert valid[-1].payload.outcome == outcome
            if rid == stale_rid:
                # The batch's claim lost to the stale append and was made again above it.
                assert len(resumed) == 2 and resumed[0] not in valid
                assert resumed[1].payload.expected_prev_seq == stale_ev.seq
                assert stale_ev.event_id in {e.event_id for e in valid}
            else:
                assert resumed == valid_resumed
        # The first claims of each batch went out together: one produce batch per
        # partition's batch, their offsets adjacent (the agents' appends came after).
        reader = services.run_deps().reader_factory()
        try:
            for rid in runs:
                p = partition_for(rid, settings.partitions)
                for rec in reader.read(rid, partition=p, start=0, end=None):
                    if rec.event.type is EventType.RUN_RESUMED and rec.event.writer_id == mine:
                        first_claims.setdefault(p, []).append(rec.offset)
                        break
        finally:
            reader.close()
        for offsets in first_claims.values():
            assert max(offsets) - min(offsets) + 1 == len(offsets)
        # Every effect once: the first calls were made by the dead worker and returned
        # their recorded results here; the second ones were made here, once each (but
        # the cancelled run's).
        counts = {k.decode(): int(v) for k, v in client.hgetall(_effects_key(settings)).items()}
        assert len(counts) == 2 * RUNS - 1 and set(counts.values()) == {1}
        assert not client.exists(decisions_key(worker.deps, "t1", cancelled_rid))
    finally:
        worker._listening.clear()
        for batch in set(worker.batches.values()):
            for rid in batch.leases():
                batch.drop(rid)
        worker.pool.shutdown(wait=True)
        if worker.loop is not None:
            worker.loop.call_soon_threadsafe(worker.loop.stop)


def test_a_batch_run_whose_dispatch_never_comes_is_let_go(
    test_settings: Settings, dead: Services, services: Services
) -> None:
    """A run of a batch that is dropped (its dispatch does not come: a drain, a record
    gone) holds no lease afterwards, whether the batch had opened or not."""
    settings = test_settings
    client = services.redis
    deps = dead.run_deps()
    rids = []
    for _ in range(4):
        run = open_run_with(deps, tenant="t1", agent="payer", started_with=STARTED)
        rids.append(run.run_id)
    sid = deps.leases.session_id()
    client.hset(held_key(settings, sid), mapping={r: "t1\tpayer" for r in rids})
    client.delete(live_key(settings.redis_key_prefix, sid))
    _, agent = _payer(settings, client)
    worker = Worker(settings, services.run_deps(), {"payer": agent}, concurrency=64)
    worker._adopt()
    batches = {id(b): b for b in worker.batches.values()}
    leases = {rid: worker.batches[rid].leases()[rid] for rid in rids}
    early, *rest = rids
    worker.batches[early].drop(early)  # before the batch opens: let go at once
    assert not leases[early].check()
    for b in batches.values():
        b.open()
    taken = worker.batches[rest[0]].take(rest[0])
    assert taken is not None and taken.state.status == "running"
    assert taken.state.epoch == leases[rest[0]].epoch
    taken.close()
    for rid in rest[1:]:
        worker.batches[rid].drop(rid)  # opened: its engine closed, its lease let go
    assert not any(lease.check() for lease in leases.values())
    assert worker.batches[early].take(early) is None  # dropped: the per-run path opens it
