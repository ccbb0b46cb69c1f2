"""runlog's topic declarations (``runlog._topics``) against the real broker: created
idempotently, drift reported, the ``runlog topics`` exit codes, refusals by name."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from runlog._settings import Settings
from runlog._topics import check_topics, ensure_topics, topic_specs
from runlog.cli import main
from runlog.errors import ConfigError


def test_topic_creation_is_idempotent(test_settings: Settings) -> None:
    # test_settings created both topics already.
    again = ensure_topics(test_settings)
    assert again.created == ()
    assert again.ok, again.describe()
    checked = check_topics(test_settings)
    assert checked.ok, checked.describe()
    events = checked[test_settings.events_topic]
    assert events.exists and events.spec.partitions == 3


def _wait_until_listed(admin: AdminClient, topic: str, *, partitions: int) -> None:
    """Wait until the broker's metadata lists ``topic`` with a leader for every partition.

    A create's future resolves when the controller has the topic; the broker that answers
    the metadata request may learn of it a moment later, and a check in that moment would
    truly (and correctly) report it missing.
    """
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        t = admin.list_topics(topic, timeout=10).topics.get(topic)
        if (
            t is not None
            and t.error is None
            and len(t.partitions) == partitions
            and all(p.leader >= 0 for p in t.partitions.values())
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"{topic} not listed with {partitions} led partitions after 30 s")


def test_drift_is_reported(settings: Settings, topic_prefix: str) -> None:
    s = settings.model_copy(update={"topic_prefix": topic_prefix, "partitions": 3})
    admin = AdminClient(s.kafka_common())
    wrong = NewTopic(
        s.events_topic,
        num_partitions=2,
        replication_factor=1,
        config={"retention.ms": "3600000", "cleanup.policy": "compact"},
    )
    admin.create_topics([wrong])[s.events_topic].result(timeout=30)
    try:
        _wait_until_listed(admin, s.events_topic, partitions=2)
        before = check_topics(s)
        assert not before.ok
        assert before.missing == (s.quarantine_topic, s.lifecycle_topic, s.keys_topic)
        drifted = {d.key: (d.expected, d.actual) for d in before.drift}
        assert drifted == {
            "partitions": ("3", "2"),
            "retention.ms": ("-1", "3600000"),
            "cleanup.policy": ("delete", "compact"),
        }
        with pytest.raises(ConfigError, match=r"retention\.ms"):
            before.raise_for_drift()

        # create makes the missing topic, leaves the drifted one alone, still reports it
        after = ensure_topics(s)
        assert after.created == (s.quarantine_topic, s.lifecycle_topic, s.keys_topic)
        assert after[s.quarantine_topic].ok and after[s.lifecycle_topic].ok
        assert after[s.keys_topic].ok
        assert {d.key for d in after.drift} == {"partitions", "retention.ms", "cleanup.policy"}
        assert check_topics(s)[s.events_topic].drift == after[s.events_topic].drift
    finally:
        admin.delete_topics(
            [s.events_topic, s.quarantine_topic, s.lifecycle_topic, s.keys_topic],
            operation_timeout=10,
        )


def test_topics_cli_exit_codes(
    settings: Settings, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNLOG_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("RUNLOG_TOPIC_PREFIX", topic_prefix)
    monkeypatch.setenv("RUNLOG_PARTITIONS", "2")
    s = Settings()
    try:
        assert main(["topics", "check"]) == 1  # missing
        assert main(["topics", "create"]) == 0
        assert main(["topics", "create"]) == 0
        assert main(["topics", "check"]) == 0
        monkeypatch.setenv("RUNLOG_PARTITIONS", "4")
        assert main(["topics", "check"]) == 1  # partition count drifted
        assert main(["topics", "create"]) == 1
    finally:
        AdminClient(s.kafka_common()).delete_topics(
            [s.events_topic, s.quarantine_topic], operation_timeout=10
        )


def test_min_isr_above_replication_factor_is_refused() -> None:
    s = Settings(replication_factor=1, min_insync_replicas=2)
    with pytest.raises(ConfigError, match=r"min\.insync\.replicas"):
        topic_specs(s)


def test_unreachable_broker_is_kafka_unavailable() -> None:
    from runlog.errors import KafkaUnavailable

    s = Settings(bootstrap_servers="127.0.0.1:1")
    with pytest.raises(KafkaUnavailable):
        check_topics(s, timeout=2)
