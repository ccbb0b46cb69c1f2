"""Opening runs one after another reuses the log readers of the process.

A reader is a Kafka consumer: a new one per ``open_run`` cost a connection and a metadata
request on every open (most of an idle fleet's time from ``runlog.start`` to the run's
first event). Each open borrows one from the pool of its services and gives it back.
"""

from __future__ import annotations

from typing import Any

import pytest

import runlog.log._reader as reader_module
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.log._reader import LogReader
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import new_run_id


def test_sequential_opens_share_one_reader(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    real = reader_module.Consumer

    def counting(conf: dict[str, Any]) -> Any:
        made.append(conf)
        return real(conf)

    monkeypatch.setattr(reader_module, "Consumer", counting)
    services = Services(test_settings)
    try:
        deps = services.run_deps()
        for _ in range(5):
            rid = new_run_id()
            run = open_run_with(deps, rid, tenant="t1")
            run.close()
            reader = deps.reader_factory()
            assert isinstance(reader, LogReader)
            assert reader.partition_of(rid) >= 0
            reader.close()
        assert len(made) <= 2, f"{len(made)} consumers for 5 opens"
    finally:
        services.close()


def test_a_reader_from_the_pool_reads_what_a_new_one_reads(test_settings: Settings) -> None:
    services = Services(test_settings)
    try:
        deps = services.run_deps()
        rids = []
        for _ in range(3):
            run = open_run_with(deps, new_run_id(), tenant="t1")
            run.finish("succeeded", "done")
            rids.append(run.run_id)
            run.close()
        for rid in rids:  # each read assigns its own partition and offset
            pooled = deps.reader_factory()
            try:
                got = [
                    r.event.seq
                    for r in pooled.read(rid, partition=pooled.partition_of(rid), start=0)
                ]
            finally:
                pooled.close()
            with LogReader(test_settings) as fresh:
                want = [
                    r.event.seq for r in fresh.read(rid, partition=fresh.partition_of(rid), start=0)
                ]
            assert got == want == [1, 2]
    finally:
        services.close()
