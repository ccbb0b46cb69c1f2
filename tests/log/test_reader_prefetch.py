"""Opening many runs of one partition from one pass over it (``Prefetch``): what a worker
does when it adopts a dead worker's runs.

The pass serves every run's replay (one read of the partition, not one per run), and a
replay from it is the run as the log held it at the pass: a record appended after the
pass (an ex-owner's last step) is still read back by the claim before anything is acted
on, so the new owner's state and epoch are those of an open without the pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from workers.common import assert_log_sound, read_log

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._reader import LogReader, Prefetch
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import new_run_id, partition_for
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def svc(fast: Settings) -> Iterator[Services]:
    services = Services(fast)
    try:
        yield services
    finally:
        services.close()


def _same_partition(settings: Settings, n: int) -> tuple[int, list[str]]:
    first = new_run_id()
    part = partition_for(first, settings.partitions)
    rids = [first]
    while len(rids) < n:
        rid = new_run_id()
        if partition_for(rid, settings.partitions) == part:
            rids.append(rid)
    return part, rids


def _counting(deps: RunDeps, passes: list[set[str]]) -> RunDeps:
    """``deps`` whose readers note every pass over a partition (``read_keys``)."""

    def factory() -> LogReader:
        reader = deps.reader_factory()
        real = LogReader.read_keys

        def read_keys(run_ids: set[str], **kw: Any) -> Any:
            passes.append(set(run_ids))
            return real(reader, run_ids, **kw)

        reader.read_keys = read_keys  # type: ignore[method-assign]
        return reader

    return dataclasses.replace(deps, reader_factory=factory)


def test_runs_of_one_partition_are_replayed_from_one_pass(fast: Settings, svc: Services) -> None:
    part, rids = _same_partition(fast, 4)
    for i, rid in enumerate(rids):
        for _ in range(i + 1):  # epochs and lengths differ from run to run
            with runlog.open_run(rid, tenant="t1", settings=fast) as run:
                run.append(EventType.USER_MESSAGE, content=f"{rid} before")
    expected = {rid: assert_log_sound([r.event for r in read_log(fast, rid)]) for rid in rids}
    passes: list[set[str]] = []
    deps = _counting(svc.run_deps(), passes)
    shared = Prefetch(part, dict.fromkeys(rids, "t1"))
    for rid in rids:
        run = open_run_with(deps, rid, tenant="t1", prefetch=shared)
        try:
            assert run.epoch > expected[rid].epoch
            assert run.state.seq == expected[rid].seq + 1  # its claim, on the whole run
            assert [m.content for m in run.state.messages] == [
                m.content for m in expected[rid].messages
            ]
        finally:
            run.close()
    assert passes == [set(rids)], f"reads of the partition: {passes}"


def test_a_record_appended_after_the_pass_is_read_back_before_the_claim_counts(
    fast: Settings, svc: Services
) -> None:
    part, rids = _same_partition(fast, 2)
    for rid in rids:
        with runlog.open_run(rid, tenant="t1", settings=fast) as run:
            run.append(EventType.USER_MESSAGE, content="before")
    shared = Prefetch(part, dict.fromkeys(rids, "t1"))
    deps = svc.run_deps()
    assert shared.load(fast, deps.redis, deps.reader_factory)
    # The owner goes on after the pass: its last step lands above what the pass read.
    with runlog.open_run(rids[0], tenant="t1", settings=fast) as run:
        run.append(EventType.USER_MESSAGE, content="after the pass")
        owner_epoch = run.epoch
    run = open_run_with(deps, rids[0], tenant="t1", prefetch=shared)
    try:
        assert [m.content for m in run.state.messages] == ["before", "after the pass"]
        assert run.epoch > owner_epoch
        run.append(EventType.USER_MESSAGE, content="new owner")
    finally:
        run.close()
    events = [r.event for r in read_log(fast, rids[0])]
    state = assert_log_sound(events)
    assert [m.content for m in state.messages] == ["before", "after the pass", "new owner"]
    assert state.epoch == run.epoch
