"""A closed writer's Kafka producer is freed, not kept (and reconnecting) until the
process exits.

A delivery callback ends the serving thread's ``flush`` by raising (``_Served``); the
exception's traceback holds the ``flush`` frame and with it the producer, and the
exception stays referenced where Python's collector cannot reach (the producer's C
handle, it appears). Every writer that had served a barrier outlived its ``close``, and
at the end of a test session its producers kept dialling brokers already stopped
(``FAIL|rdkafka`` lines).
"""

from __future__ import annotations

import gc

from confluent_kafka import Producer

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._opening import open_run_with
from runlog.schemas._vocabulary import EventType


def _producers() -> int:
    gc.collect()
    return sum(isinstance(o, Producer) for o in gc.get_objects())


def _appends(settings: Settings) -> None:
    services = Services(settings, writer_id="release")
    try:
        with open_run_with(services.run_deps(), None) as run:
            for i in range(10):  # durable appends: each barrier served in its own thread
                run.append(EventType.MEMORY_WRITTEN, key="k", value=str(i))
            for i in range(10):  # pipelined, then one barrier for them all
                run.emit(EventType.MEMORY_WRITTEN, key="p", value=str(i))
            run.barrier()
            run.finish("succeeded", "done")
    finally:
        services.close()


def test_a_closed_writer_lets_its_producer_go(test_settings: Settings) -> None:
    before = _producers()
    _appends(test_settings)
    assert _producers() == before
