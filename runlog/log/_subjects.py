"""A data subject's runs, found in the events topic itself.

The run index (``consumers._index``) answers fast, but only as far as the state projection
folded: a projection service that is behind or stopped has not indexed the newest runs. A
caller that must not miss a run (``forget``: a run it misses keeps its content readable
under a key it is about to destroy, unstopped and unmarked) asks the log when it cannot
show that the index is current. The scan reads every partition from its first record to
its end as of now and decodes only the records whose ``runlog.type`` header names a run's
first event; the subject is structure (never sealed), so it needs no key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, TopicPartition

from runlog._settings import Settings
from runlog.errors import KafkaUnavailable, SchemaError
from runlog.log._kafka import high_watermark, partitions_of, reader_config
from runlog.log._registry import ids_for
from runlog.schemas._codec import H_TYPE, decode
from runlog.schemas._models import data_subject
from runlog.schemas._sealing import NO_KEY_OPENER
from runlog.schemas._vocabulary import STARTS

_STARTS = frozenset(t.value.encode() for t in STARTS)

SCAN_IDLE_S = 30.0
"""How long the scan waits for a partition that returns nothing before its end: longer
means the broker is not answering (``KafkaUnavailable``), never a shorter answer."""


@dataclass
class SubjectScan:
    """What a scan of the events topic found for the subjects of one tenant."""

    subjects: dict[str, list[str]] = field(default_factory=dict)
    """Each data subject's runs (a run that names none is its own subject)."""
    forks: dict[str, list[str]] = field(default_factory=dict)
    """Every fork of the tenant the scan met, by parent: a fork carries its parent's
    content, and the run index that knows the lineage is as stale as it is for subjects."""
    records: int = 0
    """Records read (all of them: the scan reads each partition to its end)."""
    partitions: int = 0


def scan_subjects(settings: Settings, tenant: str) -> SubjectScan:
    """The runs of ``tenant`` by data subject (the run itself when its first event names
    none), read from every partition of the events topic: one read answers for every
    subject (the retention job asks about many)."""
    consumer = Consumer(reader_config(settings))
    ids = ids_for(settings)
    out = SubjectScan()
    seen: set[str] = set()
    try:
        topic = settings.events_topic
        parts = sorted(partitions_of(consumer, topic))
        out.partitions = len(parts)
        for p in parts:
            high = high_watermark(consumer, topic, p)
            if high <= 0:
                continue
            consumer.assign([TopicPartition(topic, p, 0)])
            pos, idle = 0, 0.0
            while pos < high:
                msgs = consumer.consume(500, timeout=1.0)
                if not msgs:
                    idle += 1.0
                    if idle >= SCAN_IDLE_S:
                        raise KafkaUnavailable(
                            f"reading {topic}[{p}] for the runs of tenant {tenant}: nothing at "
                            f"offset {pos} of {high} for {SCAN_IDLE_S:.0f}s"
                        )
                    continue
                idle = 0.0
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            raise KafkaUnavailable(f"reading {topic}[{p}]: {err}")
                        continue
                    pos = (msg.offset() or 0) + 1
                    out.records += 1
                    kind = dict(msg.headers() or []).get(H_TYPE)
                    if kind not in _STARTS:
                        continue
                    try:
                        # Content stays sealed: the subject is structure.
                        ev = decode(msg.value() or b"", ids, NO_KEY_OPENER)
                    except SchemaError:
                        continue  # quarantined by the projections; not a run's first event
                    if ev.run_id in seen:
                        continue  # the run's own tenant is its first start's
                    seen.add(ev.run_id)
                    if ev.tenant != tenant:
                        continue
                    subject = data_subject(ev.run_id, ev.payload)
                    out.subjects.setdefault(subject, []).append(ev.run_id)
                    parent = getattr(ev.payload, "parent_run_id", None)
                    if parent is not None:
                        out.forks.setdefault(parent, []).append(ev.run_id)
            consumer.unassign()
    finally:
        consumer.close()
    return out
