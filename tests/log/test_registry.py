"""Confluent's wire format through a real schema registry (Apicurio, from Maven Central).

What an analytics team's own tools need: confluent-kafka's plain ``AvroDeserializer`` (no
runlog code) reads every event type runlog writes; the registry refuses an incompatible
schema; a registry that does not answer stops appends instead of changing the encoding;
every runlog reader accepts both encodings, upcasting old versions either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from replay_support import FIXTURE_VERSIONS, load_fixture
from scan_support import events_records
from workers.common import services_for

import runlog
from runlog import stack
from runlog._settings import Settings
from runlog.consumers._queries import get_state
from runlog.consumers.runner import rebuild
from runlog.errors import RegistryUnavailable, SchemaError, UnknownSchemaId
from runlog.log import _registry as regmod
from runlog.log._reader import LogReader
from runlog.log._registry import RegistryIds, ids_for, subject_for
from runlog.log._replay import replay
from runlog.producers._writer import EventWriter
from runlog.projections._run_state import RunState
from runlog.schemas import _codec as codec
from runlog.schemas._registry import WriterSchema, registry
from runlog.schemas._vocabulary import EventType
from runlog.stack import _registry as stack_registry

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session")
def registry_url(settings: Settings) -> Iterator[str]:
    """The stack's schema registry, started (and fetched, once) if it is not running, and
    stopped at the end of the session if it started it. Never advertised: the user's own
    `runlog stack env` prints what it printed before the tests."""
    cfg = stack.StackConfig.from_env()
    started = stack_registry.url_if_running(cfg) is None
    try:
        url = stack_registry.up(cfg)
    except runlog.RunlogError as exc:
        if started:
            stack_registry.down(cfg)
        pytest.fail(f"could not start the schema registry: {exc}", pytrace=False)
    yield url
    if started:
        stack_registry.down(cfg)


@pytest.fixture
def reg(test_settings: Settings, registry_url: str) -> Iterator[Settings]:
    """This test's topics, with every released schema registered under their subjects."""
    s = test_settings.model_copy(update={"schema_registry_url": registry_url})
    ids = ids_for(s)
    assert ids is not None
    ids.register_all()
    with services_for(s):
        yield s


class StaticIds:
    """``SchemaIds`` from a fixed table, for bytes framed without a registry at hand."""

    def __init__(self) -> None:
        self.by_id = {i: ws for i, ws in enumerate(registry().by_type_version.values(), 1)}
        self.ids = {(ws.event_type, ws.version): i for i, ws in self.by_id.items()}

    def id_for(self, schema: WriterSchema) -> int:
        return self.ids[(schema.event_type, schema.version)]

    def schema_for(self, schema_id: int) -> WriterSchema:
        try:
            return self.by_id[schema_id]
        except KeyError:
            raise UnknownSchemaId(f"no schema {schema_id}") from None


def fold_dict(view: dict[str, Any]) -> str:
    """Digest of the state projection's stored state (the live run's ``state.digest()``)."""
    return RunState.from_dict(view["state"]).digest()


def _as_confluent(single_object: bytes, ids: Any) -> bytes:
    """The same Avro body in Confluent's framing (what a registry-configured writer emits)."""
    ws = codec.writer_schema_of(single_object)
    return bytes([0]) + ids.id_for(ws).to_bytes(4, "big") + single_object[codec.HEADER_LEN :]


def _every_type_through_runlog(s: Settings) -> dict[EventType, int]:
    """A live run's events plus the permanent fixture's other types, all in Confluent format."""
    tools = [
        runlog.tool("charge", risk="safe")(lambda args, *, idempotency_key: "ok"),
        runlog.tool("pay", risk="irreversible")(lambda args, *, idempotency_key: "paid"),
    ]
    with runlog.open_run(settings=s, tools=tools) as run:
        run.append(EventType.USER_MESSAGE, content="hello")
        at = run.state.seq
        run.call_tool("charge", {"amount": 7})
        run.call_tool("pay", {"amount": 7})
        run.sleep(0)  # a durable timer, due at once (outside a worker it waits here)
        run.finish("succeeded")
    # A fork's records begin a run of their own (a fixture is one started run): the fork
    # meets the parent's payment after its fork point and inherits it.
    made = runlog.fork(run.run_id, at_seq=at, settings=s, forked_by="t", reason="registry")
    with runlog.open_run(made.run_id, settings=s, tools=tools) as forked:
        assert forked.call_tool("pay", {"amount": 7}) == "paid"
        forked.finish("succeeded")
    # An erasure comes after the finish (the parent's and, following it, the fork's).
    runlog.forget(tenant="default", run_id=run.run_id, reason="registry", by="t", settings=s)
    ids = ids_for(s)
    assert ids is not None
    writer = EventWriter(s)
    try:
        latest = load_fixture(FIXTURE_VERSIONS[-1])
        for rec in latest.records:
            ev = codec.decode(rec.value)
            writer.send(s.events_topic, rec.key, codec.encode(ev, ids), codec.headers(ev))
        writer.flush()
    finally:
        writer.close()
    return {et: 1 for et in EventType}


def test_confluent_avro_deserializer_reads_every_event_type_runlog_writes(reg: Settings) -> None:
    _every_type_through_runlog(reg)
    client = SchemaRegistryClient({"url": reg.schema_registry_url})
    plain = AvroDeserializer(client)  # no reader schema, no runlog code: the writer's own
    seen: set[str] = set()
    for msg in events_records(reg):
        value = msg.value()
        assert value[0] == 0, "a registry-configured writer emits Confluent's wire format"
        ctx = SerializationContext(reg.events_topic, MessageField.VALUE)
        record = plain(value, ctx)
        headers = dict(msg.headers() or [])
        assert record["type"] == headers["runlog.type"].decode()
        assert record["seq"] == int(headers["runlog.seq"])
        assert runlog.decode(value, ids_for(reg)).event_id == record["event_id"]
        seen.add(record["type"])
    assert seen == {et.value for et in EventType}
    subjects = client.get_subjects()
    assert subject_for(reg.events_topic, EventType.MODEL_TURN) in subjects
    assert client.get_compatibility(subject_for(reg.events_topic, EventType.MODEL_TURN)) == (
        "BACKWARD"
    )


def test_readers_accept_both_encodings_on_one_topic(
    reg: Settings, redis_client: redis.Redis
) -> None:
    plain = reg.model_copy(update={"schema_registry_url": None})
    with services_for(plain), runlog.open_run(settings=plain) as old:
        old.append(EventType.USER_MESSAGE, content="written before the registry")
        old_digest = old.state.digest()
    with runlog.open_run(settings=reg) as new:
        new.append(EventType.USER_MESSAGE, content="written with the registry")
        new_digest = new.state.digest()
    assert replay(reg, redis_client, old.run_id).state.digest() == old_digest
    assert replay(reg, redis_client, new.run_id).state.digest() == new_digest
    # The old run resumes under a registry-configured writer: one run, two framings.
    with runlog.open_run(old.run_id, settings=reg) as resumed:
        resumed.append(EventType.USER_MESSAGE, content="after the switch")
        digest = resumed.state.digest()
    with LogReader(reg) as reader:
        kinds = {rec.event.seq: rec.event for rec in reader.read(old.run_id)}
    assert len(kinds) == 4
    assert replay(reg, redis_client, old.run_id).state.digest() == digest
    # The projection services fold both framings the same way as the writer did.
    rebuild(redis_client, reg, ["state"])
    for rid, digest_now in ((old.run_id, digest), (new.run_id, new_digest)):
        view = get_state(redis_client, reg, rid)
        assert view is not None and fold_dict(view) == digest_now
    # A reader without the registry names what it cannot read, never guesses.
    with LogReader(plain) as reader, pytest.raises(SchemaError, match="schema registry"):
        list(reader.read(new.run_id))


def test_an_incompatible_schema_is_refused_at_registration(
    reg: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = regmod.released()
    et = EventType.MODEL_TURN
    top = registry().current[et]
    raw = json.loads(json.dumps(next(r for t, v, r in shipped if t is et and v == top)))
    raw["fields"].append({"name": "required_without_default", "type": "string"})
    monkeypatch.setattr(regmod, "released", lambda: [*shipped, (et, top + 1, raw)])
    ids = RegistryIds(str(reg.schema_registry_url), reg.events_topic)
    with pytest.raises(SchemaError, match=rf"v{top + 1} refused by the registry \(409\)"):
        ids.register_all()


def test_a_registry_that_does_not_answer_stops_appends(test_settings: Settings) -> None:
    dead = test_settings.model_copy(
        update={"schema_registry_url": "http://127.0.0.1:9/apis/ccompat/v7"}
    )
    with services_for(dead), pytest.raises(RegistryUnavailable, match=r"127\.0\.0\.1:9/"):
        runlog.open_run(settings=dead)
    with LogReader(test_settings) as reader:
        assert all(reader.high_watermark(p) == 0 for p in range(test_settings.partitions)), (
            "nothing may be written in another encoding instead"
        )


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_permanent_fixtures_decode_the_same_in_both_framings(version: str) -> None:
    """Old versions are upcast through either framing, to the same events."""
    ids = StaticIds()
    fx = load_fixture(version)
    for rec in fx.records:
        assert codec.decode(_as_confluent(rec.value, ids), ids) == codec.decode(rec.value)


def test_the_registry_path_upcasts_old_versions(reg: Settings) -> None:
    ids = ids_for(reg)
    assert ids is not None
    v1 = load_fixture("v1")
    compacted = [
        r
        for r in v1.records
        if codec.writer_schema_of(r.value).event_type is EventType.CONTEXT_COMPACTED
    ]
    assert compacted, "the v1 fixture holds a v1 compaction"
    for rec in compacted:
        framed = _as_confluent(rec.value, ids)  # id of v1 as the live registry numbers it
        ev = codec.decode(framed, ids)
        assert ev.schema_version == registry().current[EventType.CONTEXT_COMPACTED]
        assert ev == codec.decode(rec.value)


def test_schemas_register_and_check_commands(
    test_settings: Settings,
    registry_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from runlog.cli import main as cli_main

    monkeypatch.setenv("RUNLOG_TOPIC_PREFIX", test_settings.topic_prefix)
    monkeypatch.setenv("RUNLOG_SCHEMA_REGISTRY_URL", registry_url)
    assert cli_main(["schemas", "check"]) == 1  # a fresh topic: nothing registered yet
    assert "MISSING" in capsys.readouterr().out
    assert cli_main(["schemas", "register"]) == 0
    assert cli_main(["schemas", "register"]) == 0  # idempotent: the same ids
    out = capsys.readouterr().out.splitlines()
    half = len(out) // 2
    assert out[:half] == out[half:] and len(out) == len(registry().by_type_version) * 2
    assert cli_main(["schemas", "check"]) == 0
    assert "MISSING" not in capsys.readouterr().out


def _stack_env() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "stack", "env"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_stack_env_exports_a_registry_only_when_the_user_started_it(registry_url: str) -> None:
    """A registry that something else started (this session) changes nothing the user's
    `runlog stack env` prints; `runlog stack up --registry` makes it exported, until down."""
    cfg = stack.StackConfig.from_env()
    marker = stack_registry.RegistryPaths.of(cfg).advertised
    was_advertised = marker.exists()
    try:
        marker.unlink(missing_ok=True)
        assert "RUNLOG_SCHEMA_REGISTRY_URL" not in _stack_env()
        assert stack_registry.up(cfg, advertise=True) == registry_url
        assert f"RUNLOG_SCHEMA_REGISTRY_URL={registry_url}" in _stack_env()
    finally:
        if not was_advertised:
            marker.unlink(missing_ok=True)


def test_sealed_fields_reach_registry_readers_as_the_documented_envelope(
    reg: Settings, redis_client: redis.Redis
) -> None:
    """Encryption on with a registry: a consumer with only the registry (no runlog, no key)
    reads every content field as ``runlog.Sealed {key_id, nonce, ciphertext}`` and every
    structural field in the clear; runlog's readers (replay, the state projection) open it."""
    from pydantic import SecretStr

    from runlog.log import _keys as keys_mod

    s = reg.model_copy(update={"encryption": "on", "kek": SecretStr(f"k1:{keys_mod.new_kek()}")})
    try:
        with services_for(s), runlog.open_run(settings=s, subject="user-9") as run:
            run.append(EventType.USER_MESSAGE, content="sealed for the registry")
            digest = run.state.digest()
        client = SchemaRegistryClient({"url": s.schema_registry_url})
        plain = AvroDeserializer(client)
        found = None
        for msg in events_records(s):
            record = plain(msg.value(), SerializationContext(s.events_topic, MessageField.VALUE))
            if record["type"] == "user_message":
                found = record
        assert found is not None and found["run_id"] == run.run_id and found["seq"] == 2
        envelope = found["payload"]["content"]
        assert set(envelope) == {"key_id", "nonce", "ciphertext"}
        assert b"sealed for the registry" not in envelope["ciphertext"]
        assert len(envelope["nonce"]) == 12
        assert replay(s, redis_client, run.run_id).state.digest() == digest
        rebuild(redis_client, s, ["state"])
        view = get_state(redis_client, s, run.run_id)
        assert view is not None and fold_dict(view) == digest
    finally:
        keys_mod.close_shared()
