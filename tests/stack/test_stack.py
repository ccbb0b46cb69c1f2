"""The local stack and the topic declarations, against the real broker and Redis."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest
from ci_support import IN_CI
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from runlog import stack
from runlog._settings import Settings
from runlog._topics import check_topics, ensure_topics, topic_specs
from runlog.cli import main
from runlog.errors import ConfigError, StackError
from runlog.stack import _registry as stack_registry


@pytest.fixture
def embedded(stack_source: str, settings: Settings) -> stack.StackConfig:
    """The embedded stack's config; these tests are about runlog.stack itself."""
    if stack_source != "embedded":
        if IN_CI:
            pytest.fail(f"CI must run the embedded stack, got {stack_source!r}")
        pytest.skip(f"tests of runlog.stack need the embedded stack (using {stack_source!r})")
    return stack.StackConfig.from_env()


def _our_kafka_processes(cfg: stack.StackConfig) -> list[int]:
    marker = str(cfg.nodes()[0].server_properties).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kafka.Kafka" in cmdline and marker in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.stack
def test_up_twice_is_still_one_stack(embedded: stack.StackConfig) -> None:
    first = stack.up(embedded)
    second = stack.up(embedded)
    assert first.running and second.running
    assert [s.pid for s in first.services] == [s.pid for s in second.services]
    assert all(s.pid for s in second.services if s.managed)
    assert _our_kafka_processes(embedded) == [second.services[0].pid]

    st = stack.status(embedded)
    assert st.running
    assert st.bootstrap_servers == f"127.0.0.1:{embedded.kafka_port}"
    kafka = st.services[0]
    assert kafka.log_file is not None and kafka.log_file.is_file()
    assert kafka.data_dir is not None and (kafka.data_dir / "meta.properties").is_file()
    described = st.describe()
    assert "running" in described and str(embedded.state_dir) in described


@pytest.mark.stack
def test_status_and_env_commands(
    embedded: stack.StackConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stack", "status"]) == 0
    assert f"127.0.0.1:{embedded.kafka_port}" in capsys.readouterr().out

    assert main(["stack", "env"]) == 0
    exported = {}
    for line in capsys.readouterr().out.splitlines():
        word, assignment = line.split(" ", 1)
        assert word == "export"
        key, value = assignment.split("=", 1)
        exported[key] = shlex.split(value)[0]
    expected = stack.env(embedded)
    # Printed only for a registry the user started (stack up --registry), never for one
    # that something else, e.g. this test session, started.
    url = stack_registry.advertised_url(embedded)
    if url is not None:
        expected["RUNLOG_SCHEMA_REGISTRY_URL"] = url
    assert exported == expected
    assert exported["RUNLOG_BOOTSTRAP_SERVERS"] == embedded.bootstrap_servers


@pytest.mark.stack
def test_port_taken_by_another_stack_is_named(embedded: stack.StackConfig, tmp_path: Path) -> None:
    other = stack.StackConfig(
        state_dir=tmp_path / "state",
        cache_dir=embedded.cache_dir,
        kafka_port=embedded.kafka_port,
        controller_port=embedded.controller_port,
        redis_port=embedded.redis_port,
    )
    with pytest.raises(StackError, match=str(embedded.kafka_port)):
        stack.up(other, timeout=5)


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
