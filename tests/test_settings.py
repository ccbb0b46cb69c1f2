"""Settings (``runlog._settings``) from ``RUNLOG_*`` environment variables
(docs/reference/settings.md, docs/howto/production.md, docs/howto/security.md).

* With no variable set, the documented defaults, and the names derived from them (topics,
  the fleet's group, ``min.insync.replicas`` = RF-1, at least 1).
* Each variable is read under its documented name and parsed to its type (numbers, flags,
  comma-separated lists, JSON); the settings are frozen.
* A value outside its documented range, or not of its type, is refused naming the setting;
  the documented bound itself is allowed.
* Secrets set in the environment never show in ``repr``/``str``/JSON or ``as_env``, yet
  reach librdkafka and change the settings' fingerprint.
* ``as_env`` gives variables that read back as the same settings.
* A producer property that would break a guarantee is refused naming it and where it came
  from, a caller's ``extra`` included.

``RUNLOG_KAFKA_EXTRA`` (secret values, tunables winning, each refused guarantee):
tests/producers/test_writer_kafka_extra.py.
"""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from runlog._settings import Settings
from runlog.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_runlog_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the RUNLOG_* variables it sets itself."""
    for name in list(os.environ):
        if name.startswith("RUNLOG_"):
            monkeypatch.delenv(name)


def test_the_documented_defaults() -> None:
    s = Settings()
    assert s.bootstrap_servers == "127.0.0.1:19092"
    assert s.redis_url == "redis://127.0.0.1:16379/0"
    assert s.redis_cluster is False
    assert (s.topic_prefix, s.redis_key_prefix) == ("runlog", "runlog")
    assert (s.partitions, s.replication_factor, s.min_insync_replicas) == (6, 1, None)
    assert (s.lease_ttl_ms, s.liveness_ttl_ms) == (15_000, 2_000)
    assert (s.worker_session_timeout_ms, s.worker_drain_s) == (10_000, 20.0)
    assert (s.delivery_timeout_ms, s.snapshot_interval) == (30_000, 0)
    assert (s.schema_registry_url, s.schema_registry_timeout_ms) == (None, 10_000)
    assert s.approval_deadline_s is None
    assert (s.notify_max_attempts, s.notify_backoff_s, s.notify_backoff_cap_s) == (10, 1.0, 300.0)
    assert (s.encryption, s.key_store, s.kek, s.kek_file) == ("off", "kafka", None, None)
    assert (s.decider_public_keys, s.tenant_keys, s.decider_key_file) == (None, None, None)
    assert (s.kafka_extra, s.redact_fields) == ({}, ())
    # Derived names.
    assert (s.events_topic, s.quarantine_topic) == ("runlog.events", "runlog.quarantine")
    assert (s.keys_topic, s.lifecycle_topic) == ("runlog.keys", "runlog.lifecycle")
    assert s.fleet_group == "runlog.workers"
    assert s.effective_min_insync_replicas == 1  # RF-1, but at least 1


def test_variables_are_read_under_their_names_and_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RUNLOG_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
        "RUNLOG_TOPIC_PREFIX": "acme",
        "RUNLOG_PARTITIONS": "12",
        "RUNLOG_REPLICATION_FACTOR": "3",
        "RUNLOG_REDIS_CLUSTER": "true",
        "RUNLOG_WORKER_DRAIN_S": "12.5",
        "RUNLOG_ENCRYPTION": "on",
        "RUNLOG_REDACT_FIELDS": " password, card_number,,",
        "RUNLOG_KAFKA_EXTRA": '{"client.id": "w1"}',
    }.items():
        monkeypatch.setenv(name, value)
    s = Settings()
    assert s.bootstrap_servers == "k1:9092,k2:9092"
    assert (s.partitions, s.replication_factor, s.redis_cluster) == (12, 3, True)
    assert (s.worker_drain_s, s.encryption) == (12.5, "on")
    assert s.redact_fields == ("password", "card_number")
    assert s.kafka_common()["client.id"] == "w1"
    assert (s.events_topic, s.quarantine_topic, s.keys_topic) == (
        "acme.events",
        "acme.quarantine",
        "acme.keys",
    )
    assert s.fleet_group == "acme.workers"
    assert s.effective_min_insync_replicas == 2  # production's RF 3: two brokers per ack
    monkeypatch.setenv("RUNLOG_MIN_INSYNC_REPLICAS", "3")
    monkeypatch.setenv("RUNLOG_WORKER_GROUP", "fleet-a")
    s = Settings()
    assert (s.effective_min_insync_replicas, s.fleet_group) == (3, "fleet-a")
    with pytest.raises(ValidationError):
        s.partitions = 1  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("RUNLOG_PARTITIONS", "0", "partitions"),
        ("RUNLOG_PARTITIONS", "six", "partitions"),
        ("RUNLOG_REPLICATION_FACTOR", "0", "replication_factor"),
        ("RUNLOG_MIN_INSYNC_REPLICAS", "0", "min_insync_replicas"),
        ("RUNLOG_LEASE_TTL_MS", "199", "lease_ttl_ms"),
        ("RUNLOG_LIVENESS_TTL_MS", "-1", "liveness_ttl_ms"),
        ("RUNLOG_WORKER_SESSION_TIMEOUT_MS", "999", "worker_session_timeout_ms"),
        ("RUNLOG_WORKER_DRAIN_S", "-0.5", "worker_drain_s"),
        ("RUNLOG_DELIVERY_TIMEOUT_MS", "999", "delivery_timeout_ms"),
        ("RUNLOG_SNAPSHOT_INTERVAL", "-1", "snapshot_interval"),
        ("RUNLOG_SCHEMA_REGISTRY_TIMEOUT_MS", "99", "schema_registry_timeout_ms"),
        ("RUNLOG_APPROVAL_DEADLINE_S", "0", "approval_deadline_s"),
        ("RUNLOG_APPROVAL_DEADLINE_S", "inf", "approval_deadline_s"),
        ("RUNLOG_NOTIFY_MAX_ATTEMPTS", "0", "notify_max_attempts"),
        ("RUNLOG_NOTIFY_BACKOFF_S", "nan", "notify_backoff_s"),
        ("RUNLOG_NOTIFY_TIMEOUT_S", "0", "notify_timeout_s"),
        ("RUNLOG_ENCRYPTION", "yes", "encryption"),
        ("RUNLOG_KEY_STORE", "redis", "key_store"),
        ("RUNLOG_KEYS_SEGMENT_MS", "0", "keys_segment_ms"),
        ("RUNLOG_REDIS_CLUSTER", "maybe", "redis_cluster"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str
) -> None:
    """``ConfigError`` naming the variable (not pydantic's field) and the value given."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        Settings()
    assert f"{variable}:" in str(err.value) and repr(value) in str(err.value)
    assert str(err.value).count("RUNLOG_") == 1  # that setting alone is named


@pytest.mark.parametrize(
    ("variable", "value", "field", "parsed"),
    [
        ("RUNLOG_PARTITIONS", "1", "partitions", 1),
        ("RUNLOG_LEASE_TTL_MS", "200", "lease_ttl_ms", 200),
        ("RUNLOG_LIVENESS_TTL_MS", "0", "liveness_ttl_ms", 0),
        ("RUNLOG_WORKER_SESSION_TIMEOUT_MS", "1000", "worker_session_timeout_ms", 1000),
        ("RUNLOG_WORKER_DRAIN_S", "0", "worker_drain_s", 0.0),
        ("RUNLOG_DELIVERY_TIMEOUT_MS", "1000", "delivery_timeout_ms", 1000),
        ("RUNLOG_SCHEMA_REGISTRY_TIMEOUT_MS", "100", "schema_registry_timeout_ms", 100),
        ("RUNLOG_APPROVAL_DEADLINE_S", "0.001", "approval_deadline_s", 0.001),
    ],
)
def test_the_documented_bound_itself_is_allowed(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str, parsed: object
) -> None:
    monkeypatch.setenv(variable, value)
    assert getattr(Settings(), field) == parsed


SECRETS = {
    "RUNLOG_SASL_PASSWORD": ("sasl-pw-5f1e", "sasl.password"),
    "RUNLOG_SSL_KEY_PASSWORD": ("ssl-pw-77ab", "ssl.key.password"),
    "RUNLOG_REDIS_PASSWORD": ("redis-pw-0c3d", None),
    "RUNLOG_SCHEMA_REGISTRY_AUTH": ("user:reg-pw-91aa", None),
    "RUNLOG_KEK": ("k1:a2VrLXNlY3JldC1ieXRlcy1rZWstc2VjcmV0LWJ5dGVzISE=", None),
}


def test_secrets_never_print_but_reach_their_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLOG_SASL_USERNAME", "worker")
    monkeypatch.setenv("RUNLOG_SECURITY_PROTOCOL", "SASL_SSL")
    for name, (secret, _) in SECRETS.items():
        monkeypatch.setenv(name, secret)
    s = Settings()
    shown = (repr(s), str(s), s.model_dump_json(), str(s.as_env()))
    for secret, _ in SECRETS.values():
        assert not any(secret in text for text in shown), secret
    conf = s.kafka_common()
    assert conf["sasl.username"] == "worker" and conf["security.protocol"] == "SASL_SSL"
    for secret, prop in SECRETS.values():
        if prop:
            assert conf[prop] == secret
    assert s.redis_password is not None and s.redis_password.get_secret_value() == "redis-pw-0c3d"
    # Settings that differ only in a secret are other settings.
    monkeypatch.setenv("RUNLOG_REDIS_PASSWORD", "redis-pw-other")
    assert Settings().fingerprint() != s.fingerprint()


def test_unset_optional_properties_are_not_passed_to_librdkafka() -> None:
    conf = Settings().kafka_common()
    assert conf == {"bootstrap.servers": "127.0.0.1:19092"}


def test_as_env_reads_back_as_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RUNLOG_BOOTSTRAP_SERVERS": "k1:9093",
        "RUNLOG_REDIS_URL": "redis://r:6380/2",
        "RUNLOG_TOPIC_PREFIX": "acme",
        "RUNLOG_PARTITIONS": "9",
        "RUNLOG_REPLICATION_FACTOR": "3",
        "RUNLOG_LEASE_TTL_MS": "5000",
    }.items():
        monkeypatch.setenv(name, value)
    first = Settings()
    env = first.as_env()
    assert all(name.startswith("RUNLOG_") for name in env)
    for name in list(os.environ):
        if name.startswith("RUNLOG_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == first


def test_a_callers_extra_that_breaks_a_guarantee_is_refused_naming_it() -> None:
    s = Settings()
    with pytest.raises(ConfigError) as err:
        s.durable_producer_config({"acks": "1"})
    assert "acks='1'" in str(err.value) and "extra" in str(err.value)
    assert "RUNLOG_KAFKA_EXTRA" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        s.durable_producer_config({"max.in.flight.requests.per.connection": "many"})
    assert "max.in.flight.requests.per.connection" in str(err.value)
    conf = s.durable_producer_config({"acks": "-1", "linger.ms": 50})
    assert conf["acks"] == "-1" and conf["linger.ms"] == 50
    assert conf["enable.idempotence"] is True and conf["partitioner"] == "murmur2_random"
    assert conf["delivery.timeout.ms"] == s.delivery_timeout_ms


def test_a_bad_secret_is_named_but_never_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLOG_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("RUNLOG_KAFKA_EXTRA", '{"sasl.password": ["not", "text", "hunter3"]}')
    with pytest.raises(ConfigError) as err:
        Settings()
    assert "RUNLOG_KAFKA_EXTRA" in str(err.value)
    assert "hunter" not in str(err.value) and err.value.__cause__ is None


def test_a_value_that_is_no_json_is_refused_naming_its_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNLOG_KAFKA_EXTRA", "{not json")
    with pytest.raises(ConfigError) as err:
        Settings()
    assert "kafka_extra" in str(err.value)
