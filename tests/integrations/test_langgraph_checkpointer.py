"""runlog's LangGraph checkpointer on the real stack: LangGraph's published conformance suite,
and the two-writer race that suite does not have (one thread, two savers: one wins)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import BASE_CAPABILITIES
from workers.common import read_log

from runlog._settings import Settings
from runlog.errors import Fenced
from runlog.integrations.langgraph import RunlogSaver
from runlog.schemas._vocabulary import EventType


def test_conformance_suite_passes(test_settings: Settings) -> None:
    settings = test_settings

    @checkpointer_test(name="RunlogSaver")
    async def runlog_saver() -> AsyncIterator[RunlogSaver]:
        async with RunlogSaver(settings=settings) as saver:
            yield saver

    report = asyncio.run(validate(runlog_saver))
    failed = {cap: res.failures for cap, res in report.results.items() if res.passed is False}
    assert not failed, failed
    for cap in BASE_CAPABILITIES:
        res = report.results[cap.value]
        assert res.passed and res.tests_passed > 0 and not res.tests_failed, (cap, res)


def _config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def test_two_writers_one_thread_exactly_one_wins(test_settings: Settings) -> None:
    settings = test_settings
    thread_id = f"lg-{uuid.uuid4().hex}"
    savers = [RunlogSaver(settings=settings) for _ in range(2)]
    barrier = threading.Barrier(len(savers))
    outcome: dict[int, str] = {}

    def write(i: int) -> None:
        cp = empty_checkpoint()
        barrier.wait()
        try:
            savers[i].put(_config(thread_id), cp, {"source": "input", "step": i}, {})
            outcome[i] = cp["id"]
        except Fenced:
            outcome[i] = "fenced"

    workers = [threading.Thread(target=write, args=(i,)) for i in range(len(savers))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    try:
        assert sorted(v == "fenced" for v in outcome.values()) == [False, True], outcome
        (winner,) = (i for i, v in outcome.items() if v != "fenced")
        loser = 1 - winner
        # The loser stays refused: a second put on the thread raises again.
        with pytest.raises(Fenced):
            savers[loser].put(_config(thread_id), empty_checkpoint(), {"step": 9}, {})
    finally:
        for s in savers:
            s.close()
    # A fresh reader sees exactly the winner's checkpoint, from the log.
    with RunlogSaver(settings=settings) as reader:
        ids = [t.checkpoint["id"] for t in reader.list(_config(thread_id))]
    assert ids == [outcome[winner]]


def test_stale_writer_is_fenced_after_a_takeover(test_settings: Settings) -> None:
    settings = test_settings
    thread_id = f"lg-{uuid.uuid4().hex}"
    old = RunlogSaver(settings=settings)
    first = empty_checkpoint()
    old.put(_config(thread_id), first, {"step": 0}, {})
    # A supervisor believes the old owner dead and hands the thread to a new one.
    new = RunlogSaver(settings=settings, takeover=True)
    try:
        second = empty_checkpoint()
        new.put(_config(thread_id), second, {"step": 1}, {})
        with pytest.raises(Fenced):
            old.put(_config(thread_id), empty_checkpoint(), {"step": 2}, {})
        with RunlogSaver(settings=settings) as reader:
            ids = [t.checkpoint["id"] for t in reader.list(_config(thread_id))]
        assert sorted(ids) == sorted([first["id"], second["id"]])
    finally:
        new.close()
        old.close()


def test_delete_thread_is_honoured_by_every_reader(test_settings: Settings) -> None:
    settings = test_settings
    thread_id = f"lg-{uuid.uuid4().hex}"
    with RunlogSaver(settings=settings) as writer:
        writer.put(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
        writer.delete_thread(thread_id)
        assert writer.get_tuple(_config(thread_id)) is None
    with RunlogSaver(settings=settings) as reader:
        assert reader.get_tuple(_config(thread_id)) is None
        assert list(reader.list(_config(thread_id))) == []


def test_a_checkpoint_records_only_the_channels_it_changed(test_settings: Settings) -> None:
    """A large channel written once is recorded once: later checkpoints that change another
    channel stay small (a thread's records grow with its steps, not its history), and every
    checkpoint still reads back whole."""
    settings = test_settings
    thread_id = f"lg-{uuid.uuid4().hex}"
    big = "d" * 300_000
    config: Any = _config(thread_id)
    with RunlogSaver(settings=settings) as writer:
        for step in range(4):
            cp = empty_checkpoint()
            cp["channel_values"] = {"docs": big, "counter": step}
            cp["channel_versions"] = {"docs": 1, "counter": step + 1}
            new = {"counter": step + 1} | ({"docs": 1} if step == 0 else {})
            config = writer.put(config, cp, {"step": step}, new)
    records = [
        r.event.payload
        for r in read_log(settings, thread_id)
        if r.event.type is EventType.MEMORY_WRITTEN
    ]
    sizes = [len(p.value) for p in records]
    assert sizes[0] > 300_000 and all(s < 10_000 for s in sizes[1:]), sizes
    with RunlogSaver(settings=settings) as reader:
        tup = reader.get_tuple(_config(thread_id))
    assert tup is not None
    assert tup.checkpoint["channel_values"] == {"docs": big, "counter": 3}
