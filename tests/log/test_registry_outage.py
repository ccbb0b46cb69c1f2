"""A schema registry that goes away under a running projection service, and comes back.

A registry that does not answer says nothing about a record: the runner waits for it
(capped backoff, logged), never exits and never quarantines a record for it, and catches
up once the registry answers again. A registry that answers "no such schema id" has
spoken: that record is quarantined and the runner keeps going.

The registry is the real one (Apicurio, ``runlog.stack._registry``), stopped and started
once. Its storage is in memory, so the test starts it fresh and registers the schemas in
the same order before and after the restart (the ids come out the same, checked); a
forwarder in front of it keeps the runner from asking between the restart and the
re-registration, when a real but empty registry would answer "not found".
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from projections_support import dump, env_for, stop, wait_assigned, wait_caught_up
from registry_support import Gate
from replay_support import FIXTURE_VERSIONS, load_fixture
from workers.common import services_for

import runlog
from runlog import stack
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import RegistryUnavailable
from runlog.log._registry import RegistryIds, ids_for
from runlog.producers._writer import EventWriter
from runlog.schemas import _codec as codec
from runlog.schemas._registry import registry
from runlog.schemas._vocabulary import EventType
from runlog.stack import _registry as stack_registry

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def fresh_registry() -> Iterator[stack.StackConfig]:
    """The stack's registry restarted empty for this test, and stopped after it (always);
    one that was running before (another test's) is started again, empty."""
    cfg = stack.StackConfig.from_env()
    was_running = stack_registry.url_if_running(cfg) is not None
    stack_registry.down(cfg)
    try:
        stack_registry.up(cfg, timeout=120)
        yield cfg
    finally:
        stack_registry.down(cfg)
        if was_running:
            stack_registry.up(cfg, timeout=120)


def test_a_registry_that_accepts_but_never_answers_is_unavailable_not_a_hang() -> None:
    """A hung registry (a paused JVM, a half-open network) must surface as an outage the
    runner retries and logs, not block its caller forever with nothing said."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts (the kernel completes the handshake); never answers
    port = hole.getsockname()[1]
    ids = RegistryIds(f"http://127.0.0.1:{port}/apis/ccompat/v7", "t.events", timeout_ms=300)
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            ids.schema_for(1)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    # The client's own retries (3, with up to 1 + 2 + 4 s of jitter) plus 4 timeouts.
    asker.join(timeout=30)
    hole.close()
    assert outcome, "the lookup still hangs on a registry that does not answer"
    assert isinstance(outcome[0], RegistryUnavailable), outcome


def _confluent_records(s: Settings) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """The latest permanent fixture's records (every event type) in Confluent's framing."""
    ids = ids_for(s)
    assert ids is not None
    out = []
    for rec in load_fixture(FIXTURE_VERSIONS[-1]).records:
        ev = codec.decode(rec.value)
        out.append((rec.key, codec.encode(ev, ids), codec.headers(ev)))
    return out


def _send(s: Settings, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]) -> None:
    writer = EventWriter(s)
    try:
        for key, value, headers in records:
            writer.send(s.events_topic, key, value, headers)
        writer.flush()
    finally:
        writer.close()


def _applied(client: redis.Redis, s: Settings) -> int:
    rows = queries.positions(client, s, "state")
    return sum(int(r["applied"] or 0) + int(r["quarantined"] or 0) for r in rows.values())


def test_a_registry_outage_is_waited_out_and_an_unknown_id_is_quarantined(
    test_settings: Settings,
    redis_client: redis.Redis,
    unique_group,
    tmp_path: Path,
    fresh_registry: stack.StackConfig,
) -> None:
    paths = stack_registry.RegistryPaths.of(fresh_registry)
    gate = Gate(paths.port)
    s = test_settings.model_copy(update={"schema_registry_url": gate.url("/apis/ccompat/v7")})
    ids = ids_for(s)
    assert ids is not None
    before = ids.register_all()
    # This process writes during the outage: it looks up every current id now.
    for et in EventType:
        ids.id_for(registry().writer(et))
    log_path = str(tmp_path / "runner.log")
    proc = None
    try:
        with services_for(s):
            # The runner meets only the first types while the registry is there.
            with runlog.open_run(settings=s) as run:
                run.append(EventType.USER_MESSAGE, content="before the outage")
            group = unique_group("reg")
            out = open(log_path, "ab")  # noqa: SIM115 - the child writes it
            proc = subprocess.Popen(
                [sys.executable, "-m", "runlog.cli", "project", "all", "--group", group],
                env=env_for(s, RUNLOG_SCHEMA_REGISTRY_URL=str(s.schema_registry_url)),
                stdout=out,
                stderr=out,
            )
            wait_assigned(proc, log_path)
            wait_caught_up(redis_client, s)
            first = _applied(redis_client, s)

            # The registry goes away; records of types the runner has no id for arrive.
            gate.open = False
            stack_registry.down(fresh_registry)
            records = _confluent_records(s)
            _send(s, records)
            time.sleep(8)  # several backoff rounds
            assert proc.poll() is None, Path(log_path).read_text()[-3000:]
            assert _applied(redis_client, s) == first, "applied records it could not decode"
            assert queries.quarantined(redis_client, s) == []
            assert "schema registry" in Path(log_path).read_text()
            assert "retrying" in Path(log_path).read_text()

            # Back, with the same ids (in-memory storage: registered again, same order).
            stack_registry.up(fresh_registry, timeout=120)
            again = RegistryIds(f"http://127.0.0.1:{paths.port}/apis/ccompat/v7", s.events_topic)
            assert again.register_all() == before
            gate.open = True
            wait_caught_up(redis_client, s, timeout=90)
            assert proc.poll() is None, Path(log_path).read_text()[-3000:]
            assert queries.quarantined(redis_client, s) == [], "quarantined for an outage"
            assert _applied(redis_client, s) == first + len(records)

            # A schema id the registry answers "not found" for: quarantined, still running.
            key, value, headers = records[0]
            unknown = bytes([0]) + (999_999).to_bytes(4, "big") + value[5:]
            _send(s, [(key, unknown, headers)])
            wait_caught_up(redis_client, s, timeout=60)
            bad = queries.quarantined(redis_client, s)
            assert [(q["error"], sorted(q["projections"])) for q in bad] == [
                ("UnknownSchemaId", sorted(PROJECTIONS))
            ]
            assert proc.poll() is None
            live = dump(redis_client, s)
            # Everything the outage held up was folded as a rebuild from zero folds it.
            ref = s.model_copy(update={"redis_key_prefix": s.redis_key_prefix + "-ref"})
            ProjectionRunner(ref, redis_client, PROJECTIONS).catch_up(timeout_s=120)
            assert live == dump(redis_client, ref)
    finally:
        if proc is not None:
            code = stop(proc)
            assert code == 0, Path(log_path).read_text()[-3000:]
        gate.close()
