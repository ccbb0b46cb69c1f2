"""A draining worker announces the runs it hands over (``fleet.handoffs``), and a live
worker that serves their agent takes them at once, whether or not it owns their
partitions yet; a worker that is itself draining passes what it pops on to the others.
Real Redis; the workers are not started (no group), their announcement list is real."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.fleet._handoffs import announce, handoffs_key
from runlog.fleet._lifecycle import Record
from runlog.fleet._registry import Agent
from runlog.fleet._worker import Worker
from runlog.schemas import _codec as codec


def _noop(run: object, order: object) -> None:
    return None


@pytest.fixture
def services(test_settings: Settings) -> Iterator[list[Services]]:
    """Two processes' services (each worker has its own draining flag)."""
    made = [Services(test_settings), Services(test_settings)]
    try:
        yield made
    finally:
        for svc in made:
            svc.close()


def _workers(settings: Settings, services: list[Services]) -> list[Worker]:
    agents = {"payer": Agent("payer", _noop)}
    return [
        Worker(settings, svc.run_deps(), agents, worker_id=f"w{i}")
        for i, svc in enumerate(services)
    ]


def _listening(w: Worker) -> threading.Thread:
    w._listening.set()
    thread = threading.Thread(target=w._listen, daemon=True)
    thread.start()
    return thread


def _taken(w: Worker, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while w.handoffs.empty():
        assert time.monotonic() < deadline, "nothing popped"
        time.sleep(0.01)
    w._take_handoffs()


def test_a_live_worker_takes_a_handed_over_run_and_a_sleep_of_a_drained_partition(
    test_settings: Settings, services: list[Services]
) -> None:
    drainer, taker = _workers(test_settings, services)
    _listening(taker)
    try:
        due = codec.now_utc() + timedelta(seconds=3)
        announce(
            drainer.deps.redis,
            test_settings,
            [
                ("r-handed", Record("open", "t1", "payer")),
                ("r-asleep", Record("waiting_until", "t1", "payer", due_at=due)),
                ("r-other", Record("open", "t1", "not-served-here")),
            ],
        )
        _taken(taker)
        while len(taker.ready) + len(taker.heap) < 2:
            _taken(taker)
    finally:
        taker._listening.clear()
    assert list(taker.ready) == ["r-handed"]  # dispatched now, its partition not its own
    assert [rid for _, _, rid in taker.heap] == ["r-asleep"]  # woken at its due time
    assert taker.adopted["r-asleep"].record is not None
    assert taker.adopted["r-asleep"].record.due_at == due
    assert "r-other" not in taker.adopted


def test_a_draining_worker_passes_what_it_pops_to_the_others(
    test_settings: Settings, services: list[Services]
) -> None:
    drainer, other = _workers(test_settings, services)
    listener = _listening(drainer)
    time.sleep(0.2)  # its BLPOP waits
    drainer.deps.draining.set()
    try:
        announce(drainer.deps.redis, test_settings, [("r-handed", Record("open", "t1", "payer"))])
        listener.join(10)
        assert not listener.is_alive(), "a draining worker's listener goes"
        assert drainer.deps.redis.llen(handoffs_key(test_settings)) == 1  # passed on
        _listening(other)
        _taken(other)
    finally:
        drainer._listening.clear()
        other._listening.clear()
    assert drainer.handoffs.empty()
    assert list(other.ready) == ["r-handed"]
