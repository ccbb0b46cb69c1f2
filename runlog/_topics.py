"""runlog's Kafka topics: declared once, created idempotently, checked for drift.

``ensure_topics(settings)`` creates what is missing and reports how existing topics differ
from the declaration; ``check_topics(settings)`` only reports. Neither ever alters an
existing topic: changing partitions or durability of a live log is an operator decision.
``ensure_topics(settings, acls=True)`` (what ``runlog topics create`` does against a SASL
or TLS cluster) also sets the least-privilege ACLs of runlog's roles (runlog._security).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runlog._security import AclSpec, ensure_acls
from runlog._settings import Settings
from runlog.errors import ConfigError, KafkaUnavailable

__all__ = [
    "Drift",
    "TopicReport",
    "TopicSpec",
    "TopicsReport",
    "check_topics",
    "ensure_topics",
    "topic_specs",
]

_log = logging.getLogger("runlog._topics")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    configs: Mapping[str, str]


@dataclass(frozen=True)
class Drift:
    """One way an existing topic differs from its declaration."""

    topic: str
    key: str
    """``partitions``, ``replication.factor`` or a topic config name."""
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.key} is {self.actual}, expected {self.expected}"


@dataclass(frozen=True)
class TopicReport:
    spec: TopicSpec
    exists: bool
    created: bool = False
    drift: tuple[Drift, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exists and not self.drift

    def describe(self) -> str:
        s = self.spec
        head = (
            f"{s.name}: partitions={s.partitions} rf={s.replication_factor} "
            f"min.insync.replicas={s.configs.get('min.insync.replicas', '?')}"
        )
        if not self.exists:
            return f"{head}  MISSING"
        if self.created:
            return f"{head}  created"
        if self.drift:
            return "\n".join([f"{head}  DRIFT", *(f"    {d}" for d in self.drift)])
        return f"{head}  ok"

    def to_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "name": s.name,
            "partitions": s.partitions,
            "replication_factor": s.replication_factor,
            "configs": dict(s.configs),
            "exists": self.exists,
            "created": self.created,
            "ok": self.ok,
            "drift": [
                {"key": d.key, "expected": d.expected, "actual": d.actual} for d in self.drift
            ],
        }


@dataclass(frozen=True)
class TopicsReport:
    topics: tuple[TopicReport, ...] = field(default_factory=tuple)
    acls: tuple[AclSpec, ...] = ()
    """The role ACLs set (``ensure_topics(..., acls=True)``); empty when none were asked for."""

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.topics)

    @property
    def drift(self) -> tuple[Drift, ...]:
        return tuple(d for t in self.topics for d in t.drift)

    @property
    def created(self) -> tuple[str, ...]:
        return tuple(t.spec.name for t in self.topics if t.created)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(t.spec.name for t in self.topics if not t.exists)

    def __getitem__(self, name: str) -> TopicReport:
        for t in self.topics:
            if t.spec.name == name:
                return t
        raise KeyError(name)

    def describe(self) -> str:
        lines = [t.describe() for t in self.topics]
        if self.acls:
            lines.append(f"ACLs ({len(self.acls)}, ALLOW, any host; nothing else is allowed):")
            lines.extend(f"  {a}" for a in self.acls)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """``runlog topics check --json``: stable keys."""
        return {
            "ok": self.ok,
            "topics": [t.to_dict() for t in self.topics],
            "missing": list(self.missing),
            "created": list(self.created),
            "acls": [str(a) for a in self.acls],
        }

    def raise_for_drift(self) -> None:
        if not self.ok:
            problems = [f"missing topic {m}" for m in self.missing] + [str(d) for d in self.drift]
            raise ConfigError("topic configuration drifted: " + "; ".join(problems))


def _durable_configs(settings: Settings) -> dict[str, str]:
    return {
        "retention.ms": "-1",
        "retention.bytes": "-1",
        "min.insync.replicas": str(settings.effective_min_insync_replicas),
        "unclean.leader.election.enable": "false",
        "cleanup.policy": "delete",
        "message.timestamp.type": "CreateTime",
    }


def topic_specs(settings: Settings) -> tuple[TopicSpec, ...]:
    """The topics runlog needs: the events log, the quarantine of undecodable records, and
    the fleet's run-lifecycle topic (compacted, co-partitioned with the events)."""
    if settings.effective_min_insync_replicas > settings.replication_factor:
        raise ConfigError(
            f"min.insync.replicas={settings.effective_min_insync_replicas} exceeds "
            f"replication factor {settings.replication_factor}: every append would fail"
        )
    configs = _durable_configs(settings)
    return (
        TopicSpec(settings.events_topic, settings.partitions, settings.replication_factor, configs),
        TopicSpec(
            settings.quarantine_topic, settings.partitions, settings.replication_factor, configs
        ),
        TopicSpec(
            settings.lifecycle_topic,
            settings.partitions,
            settings.replication_factor,
            {**configs, "cleanup.policy": "compact", "retention.bytes": "-1"},
        ),
        TopicSpec(settings.keys_topic, 1, settings.replication_factor, keys_configs(settings)),
    )


def keys_configs(settings: Settings) -> dict[str, str]:
    """The wrapped data keys' topic: as durable as the events (same RF and ISR, no unclean
    election), compacted so a shredded key's record leaves the disk for good. One
    partition: a process reads it whole (one record per live key) and ordering per key id
    is all that matters. Compaction keeps only a key's last record and never touches the
    open segment, so ``segment.ms`` rolls it, ``max.compaction.lag.ms`` bounds how long a
    closed dirty segment waits, ``min.compaction.lag.ms=0`` lets a tombstone's predecessor
    go at once, ``min.cleanable.dirty.ratio`` is low since the topic is small and every
    shred must be cleaned, and ``delete.retention.ms`` keeps the tombstone long enough for
    readers catching up to learn of the shred (docs/concepts/encryption.md)."""
    return {
        **_durable_configs(settings),
        "cleanup.policy": "compact",
        "min.compaction.lag.ms": "0",
        "max.compaction.lag.ms": str(settings.keys_max_compaction_lag_ms),
        "segment.ms": str(settings.keys_segment_ms),
        "delete.retention.ms": str(settings.keys_delete_retention_ms),
        "min.cleanable.dirty.ratio": "0.01",
    }


# --------------------------------------------------------------------------- Kafka plumbing


def _admin(settings: Settings) -> Any:
    from confluent_kafka.admin import AdminClient

    # librdkafka's log lines go to Python logging: errors show, informational noise does not.
    try:
        return AdminClient(settings.kafka_common(), logger=_log)
    except Exception as exc:  # e.g. an unreadable RUNLOG_SSL_CA_LOCATION
        raise ConfigError(f"cannot create a Kafka admin client: {exc}") from exc


def _wrap(exc: BaseException, what: str, settings: Settings) -> Exception:
    """A runlog error for a confluent_kafka failure (callers ``raise ... from exc``)."""
    from confluent_kafka import KafkaError, KafkaException

    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(err, KafkaError):
        code = err.code()
        config_codes = {
            KafkaError.INVALID_CONFIG,
            KafkaError.INVALID_REPLICATION_FACTOR,
            KafkaError.INVALID_PARTITIONS,
            KafkaError.POLICY_VIOLATION,
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            KafkaError.CLUSTER_AUTHORIZATION_FAILED,
            KafkaError.TOPIC_EXCEPTION,
            KafkaError.INVALID_REQUEST,
        }
        if code in config_codes:
            return ConfigError(f"{what}: {err.str()} ({err.name()})")
        return KafkaUnavailable(f"{what} at {settings.bootstrap_servers}: {err.str()}")
    return KafkaUnavailable(f"{what} at {settings.bootstrap_servers}: {exc}")


def _metadata(admin: Any, settings: Settings, timeout: float) -> Any:
    try:
        return admin.list_topics(timeout=timeout)
    except Exception as exc:
        raise _wrap(exc, "listing topics", settings) from exc


def _describe(
    admin: Any, settings: Settings, spec: TopicSpec, md: Any, timeout: float
) -> TopicReport:
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ConfigResource,
        ResourceType,
    )

    topic_md = md.topics.get(spec.name)
    if topic_md is None or topic_md.error is not None:
        return TopicReport(spec, exists=False)
    drift: list[Drift] = []
    partitions = len(topic_md.partitions)
    if partitions != spec.partitions:
        drift.append(Drift(spec.name, "partitions", str(spec.partitions), str(partitions)))
    rfs = sorted({len(p.replicas) for p in topic_md.partitions.values()})
    if rfs and rfs != [spec.replication_factor]:
        actual = "/".join(str(r) for r in rfs)
        drift.append(Drift(spec.name, "replication.factor", str(spec.replication_factor), actual))
    resource = ConfigResource(ResourceType.TOPIC, spec.name)
    try:
        futures = admin.describe_configs([resource], request_timeout=timeout)
        entries = next(iter(futures.values())).result(timeout=timeout)
    except Exception as exc:
        raise _wrap(exc, f"describing topic {spec.name}", settings) from exc
    for key, expected in spec.configs.items():
        entry = entries.get(key)
        value: str | None = entry.value if entry is not None else None
        if value != expected:
            drift.append(Drift(spec.name, key, expected, str(value)))
    return TopicReport(spec, exists=True, drift=tuple(drift))


def check_topics(settings: Settings, *, timeout: float = 30.0) -> TopicsReport:
    """Describe runlog's topics and report missing ones and drifted settings. Changes nothing."""
    specs = topic_specs(settings)
    admin = _admin(settings)
    md = _metadata(admin, settings, timeout)
    return TopicsReport(tuple(_describe(admin, settings, s, md, timeout) for s in specs))


def ensure_topics(
    settings: Settings,
    *,
    timeout: float = 30.0,
    acls: bool = False,
    principals: Mapping[str, str] | None = None,
) -> TopicsReport:
    """Create missing topics (idempotent) and report drift of the ones that already existed.

    Returns once created topics have a leader for every partition. With ``acls``, also
    create the roles' ACLs on them (idempotent; needs a super user): ``principals`` maps
    a role to its principal (default ``User:runlog-<role>``).
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    specs = topic_specs(settings)
    admin = _admin(settings)
    md = _metadata(admin, settings, timeout)
    reports: dict[str, TopicReport] = {}
    to_create = [s for s in specs if s.name not in md.topics]
    if to_create:
        new = [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=s.replication_factor,
                config=dict(s.configs),
            )
            for s in to_create
        ]
        try:
            futures = admin.create_topics(new, request_timeout=timeout, operation_timeout=timeout)
        except Exception as exc:
            raise _wrap(exc, "creating topics", settings) from exc
        for spec in to_create:
            try:
                futures[spec.name].result(timeout=timeout)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # created concurrently: describe it like any existing topic
                raise _wrap(exc, f"creating topic {spec.name}", settings) from exc
            except Exception as exc:
                raise _wrap(exc, f"creating topic {spec.name}", settings) from exc
            reports[spec.name] = TopicReport(spec, exists=True, created=True)
        _wait_for_leaders(admin, settings, [s for s in to_create if s.name in reports], timeout)
        md = _metadata(admin, settings, timeout)
    out = [
        reports[s.name] if s.name in reports else _describe(admin, settings, s, md, timeout)
        for s in specs
    ]
    granted = ensure_acls(admin, settings, principals, timeout=timeout) if acls else ()
    return TopicsReport(tuple(out), acls=granted)


def _wait_for_leaders(
    admin: Any, settings: Settings, specs: list[TopicSpec], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while specs:
        md = _metadata(admin, settings, timeout)
        pending = []
        for s in specs:
            t = md.topics.get(s.name)
            if (
                t is None
                or t.error is not None
                or len(t.partitions) < s.partitions
                or any(p.leader < 0 for p in t.partitions.values())
            ):
                pending.append(s)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise KafkaUnavailable(f"created topics have no leader after {timeout:.0f}s: {names}")
        specs = pending
        time.sleep(0.1)


def delete_topics(settings: Settings, names: list[str], *, timeout: float = 30.0) -> list[str]:
    """Delete ``names`` and wait for the broker's answer; the names it did not delete, each
    with its reason (a topic that does not exist counts as deleted).

    Waiting matters: ``AdminClient.delete_topics`` only queues the request, and a client
    dropped at once may never send it (scratch topics were left behind that way)."""
    from confluent_kafka import KafkaError, KafkaException

    if not names:
        return []
    admin = _admin(settings)
    failed: list[str] = []
    try:
        futures = admin.delete_topics(names, operation_timeout=timeout, request_timeout=timeout)
    except KafkaException as exc:
        return [f"{name}: {exc}" for name in names]
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout + 5)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            failed.append(f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a timeout or a closed client: reported
            failed.append(f"{name}: {exc!r}")
    return failed
