"""``RUNLOG_KAFKA_EXTRA``: its values never print; a user's producer tunables win over
runlog's defaults (``producer_config``), and a setting that would break a guarantee is
refused naming it."""

from __future__ import annotations

import pytest

from runlog._settings import Settings
from runlog.errors import ConfigError
from runlog.producers._writer import EventWriter, producer_config

EXTRA_SECRET = "oauth-S3CRET-91c2"


def test_kafka_extra_values_never_print(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "RUNLOG_KAFKA_EXTRA",
        f'{{"sasl.oauthbearer.client.secret": "{EXTRA_SECRET}", "client.id": "w1"}}',
    )
    s = Settings()
    for text in (repr(s), str(s), s.model_dump_json(), str(s.model_dump()), str(s.as_env())):
        assert EXTRA_SECRET not in text
    assert "sasl.oauthbearer.client.secret" in repr(s)  # the name is not a secret
    conf = s.kafka_common()
    assert conf["sasl.oauthbearer.client.secret"] == EXTRA_SECRET
    assert conf["client.id"] == "w1"
    # Settings that differ only in a secret are not the same settings.
    other = Settings(kafka_extra={"sasl.oauthbearer.client.secret": "another"})
    assert s.fingerprint() != other.fingerprint()


def _with_extra(monkeypatch: pytest.MonkeyPatch, extra: str) -> Settings:
    monkeypatch.setenv("RUNLOG_KAFKA_EXTRA", extra)
    return Settings()


def test_a_users_producer_tunables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    conf = producer_config(_with_extra(monkeypatch, '{"linger.ms": "50"}'))
    assert conf["linger.ms"] == "50"
    # An alias displaces runlog's default of the other spelling instead of racing it.
    conf = producer_config(_with_extra(monkeypatch, '{"queue.buffering.max.ms": "40"}'))
    assert conf["queue.buffering.max.ms"] == "40" and "linger.ms" not in conf
    conf = producer_config(_with_extra(monkeypatch, '{"max.in.flight": "3"}'))
    assert conf["max.in.flight"] == "3"
    assert "max.in.flight.requests.per.connection" not in conf
    conf = producer_config(_with_extra(monkeypatch, '{"acks": "-1", "enable.idempotence": "true"}'))
    assert conf["acks"] == "-1" and conf["enable.idempotence"] == "true"
    # What runlog's guarantees need is still set when the user says nothing.
    conf = producer_config(_with_extra(monkeypatch, "{}"))
    assert conf["enable.idempotence"] is True and conf["acks"] == "all"
    assert conf["partitioner"] == "murmur2_random"


@pytest.mark.parametrize(
    "name, value",
    [
        ("acks", "1"),
        ("request.required.acks", "0"),
        ("enable.idempotence", "false"),
        ("max.in.flight.requests.per.connection", "6"),
        ("max.in.flight", "100"),
        ("partitioner", "consistent_random"),
    ],
)
def test_a_producer_setting_that_breaks_a_guarantee_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    s = _with_extra(monkeypatch, f'{{"{name}": "{value}"}}')
    with pytest.raises(ConfigError) as err:
        producer_config(s)
    assert name in str(err.value) and value in str(err.value)
    assert "RUNLOG_KAFKA_EXTRA" in str(err.value)


def test_the_writer_runs_with_the_users_linger(test_settings: Settings) -> None:
    s = test_settings.model_copy(update={"kafka_extra": {"linger.ms": "50"}})
    assert producer_config(s)["linger.ms"] == "50"
    writer = EventWriter(s)
    try:
        got = writer.send(s.events_topic, b"k-1", b"v", []).result(timeout=30)
        assert got.offset >= 0
    finally:
        writer.close()
