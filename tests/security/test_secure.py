"""runlog on the secure stack: TLS + SASL/SCRAM + ACLs on Kafka, TLS + ACL users on Redis.

Every test here talks to ``runlog stack up --secure`` (the ``secure_stack`` session
fixture: its own ports and state dir; the session fails if it cannot start). The topics
are created by the admin with ``ensure_topics(..., acls=True)``, exactly what
``runlog topics create`` does; every other client connects as one of runlog's roles.

* What works: a worker process runs, is killed with SIGKILL and its run resumes in another
  process; the projection service folds the log and the operator reads it.
* What is refused, with an error that names it: no credentials, a wrong password, a
  certificate from another CA, and each role outside its grant (analytics producing a
  forged event or touching Redis, the projection service running the lease scripts or
  writing a lease, a worker writing projections or creating topics).
* Secrets: no password of any role in a topic, a Redis key or value, a log, or the repr of
  the settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from pydantic import SecretStr
from scan_support import redis_bytes, topic_bytes
from workers.secure_worker import note_tool

import runlog
from runlog import stack
from runlog._bootstrap import Services
from runlog._security import ensure_acls
from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.consumers import _queries as queries
from runlog.consumers._store import ProjectionKeys
from runlog.consumers.runner import ProjectionRunner, rebuild
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import ConfigError, RedisUnavailable
from runlog.fleet._handoffs import announce, announce_coming, coming_key, handoffs_key
from runlog.fleet._lifecycle import Record
from runlog.fleet._reconciling import read_reply, write_reply
from runlog.fleet._worker import live_workers, workers_key
from runlog.log._clients import async_redis_client, loop_get, redis_client
from runlog.log._setaside import set_aside, set_aside_key, set_aside_offsets
from runlog.producers._lease import Lease, LeaseManager
from runlog.producers._opening import open_run_with, submit_decision
from runlog.producers._writer import DeliveryFailed, EventWriter
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType
from runlog.stack import _secure as secure

WORKER = Path(__file__).resolve().parents[1] / "workers" / "secure_worker.py"
PARTITIONS = 3


@pytest.fixture(scope="module")
def prefix(secure_stack: stack.StackConfig) -> Iterator[str]:
    """This module's topics, created with the roles' ACLs by the admin."""
    name = f"s-{uuid.uuid4().hex[:8]}"
    admin = secure.role_settings(secure_stack, "admin", topic_prefix=name, partitions=PARTITIONS)
    report = ensure_topics(admin, acls=True)
    report.raise_for_drift()
    assert len(report.acls) > 10
    _wait_until_worker_sees(secure_stack, name)
    yield name
    AdminClient(admin.kafka_common()).delete_topics(
        [admin.events_topic, admin.quarantine_topic], operation_timeout=10
    )
    # the projections of these topics; runs' own keys are few and keyed by fresh ids
    with redis_client(admin) as client:
        pattern = f"{admin.redis_key_prefix}:proj:*:{{{admin.events_topic}:*"
        for key in list(client.scan_iter(match=pattern, count=1000)):
            client.delete(key)


def _wait_until_worker_sees(cfg: stack.StackConfig, name: str) -> None:
    """ACLs reach the authorizer through the metadata log: wait until they apply."""
    worker = _settings(cfg, "worker", name)
    admin = AdminClient(worker.kafka_common())
    deadline = time.monotonic() + 20
    while True:
        md = admin.list_topics(timeout=5)
        topic = md.topics.get(worker.events_topic)
        if topic is not None and topic.error is None:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the worker never saw {worker.events_topic}: {topic and topic.error}")
        time.sleep(0.1)


def _settings(cfg: stack.StackConfig, role: str, prefix: str, **update: Any) -> Settings:
    return secure.role_settings(
        cfg, role, topic_prefix=prefix, partitions=PARTITIONS, lease_ttl_ms=1000, **update
    )


def _role_env(cfg: stack.StackConfig, role: str, prefix: str) -> dict[str, str]:
    """A child process' environment: `runlog stack env --secure --role R` + the role's file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLOG_")}
    env.update(secure.client_env(cfg, role))
    env.update(secure.credentials(cfg, role))
    env.update(
        RUNLOG_TOPIC_PREFIX=prefix,
        RUNLOG_PARTITIONS=str(PARTITIONS),
        RUNLOG_LEASE_TTL_MS="1000",
        RUNLOG_REDIS_KEY_PREFIX=cfg.redis_key_prefix,
    )
    return env


# ------------------------------------------------------------------------------ it works


def test_worker_killed_resumed_and_projected_over_tls_and_scram(
    secure_stack: stack.StackConfig, prefix: str, tmp_path: Path
) -> None:
    cfg = secure_stack
    rid = new_run_id()
    ready, effects = tmp_path / "ready", tmp_path / "effects"
    argv = [sys.executable, str(WORKER), "--run-id", rid, "--ready", str(ready)]
    proc = subprocess.Popen(
        [*argv, "--effects", str(effects)],
        env=_role_env(cfg, "worker", prefix),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out = proc.communicate()[0].decode(errors="replace")
                pytest.fail(f"the worker (role worker) did not get going:\n{out[-3000:]}")
            time.sleep(0.02)
        before = json.loads(ready.read_text())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    # Another process resumes it as the worker role: the dead owner's lease expires first.
    worker = _settings(cfg, "worker", prefix)
    services = Services(worker, writer_id="secure-resume")
    try:
        deps = services.run_deps()
        with open_run_with(deps, rid, tools=[note_tool(effects)], wait_s=10) as run:
            assert run.epoch > before["epoch"]
            assert run.state.seq > before["seq"]  # its RUN_RESUMED follows the dead one's
            assert len(run.state.completed_calls) == 1
            approval = run.request_approval("ship it?", kind="action")
            run.append(EventType.USER_MESSAGE, content="resumed over TLS")
        # The operator decides (takes the free run like any writer), then the worker ends it.
        operator = _settings(cfg, "operator", prefix)
        op_services = Services(operator, writer_id="secure-operator")
        try:
            outcome = submit_decision(
                op_services.run_deps(), rid, approval, approved=True, decided_by="ops"
            )
            assert outcome == "recorded"
        finally:
            op_services.close()
        with open_run_with(deps, rid, tools=[note_tool(effects)], wait_s=10) as run:
            run.finish("completed", "done")
    finally:
        services.close()
    assert len(effects.read_text().splitlines()) == 1  # the tool ran once, before the kill

    # A worker with a bug writes bytes nobody can decode: the projection service must be
    # able to copy them to the quarantine topic (its only write).
    producer = Producer({**worker.kafka_common(), "partitioner": "murmur2_random"})
    producer.produce(worker.events_topic, key=b"bad-run", value=b"not an event")
    assert producer.flush(30) == 0

    # The projection service folds everything, as its own role.
    projections = _settings(cfg, "projections", prefix)
    with redis_client(projections) as pclient:
        ProjectionRunner(projections, pclient, PROJECTIONS).catch_up(timeout_s=60)
    # The operator, through the CLI with `runlog stack env --secure --role operator`:
    # rebuilds every projection from offset zero, then reads state, audit and quarantine.
    env = _role_env(cfg, "operator", prefix)
    commands = (
        ["rebuild", "all"],
        ["state", rid, "--json"],
        ["quarantine", "--json"],
        ["metrics", "--json"],
        ["verify", rid],
        ["replay", rid, "--json"],
    )
    for argv in commands:
        done = subprocess.run(
            [sys.executable, "-m", "runlog.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"runlog {' '.join(argv)}:\n{done.stdout}{done.stderr}"
        if argv[0] == "state":
            state = json.loads(done.stdout)
        if argv[0] == "quarantine":
            assert [r["run_id"] for r in json.loads(done.stdout)] == ["bad-run"]
    assert state["state"]["status"] == "finished", state
    assert state["state"]["fenced_writes"] == 0 and not state["quarantined"]
    operator = _settings(cfg, "operator", prefix)
    with redis_client(operator) as oclient:
        assert queries.get_audit(oclient, operator, rid), "the audit projection is empty"
    # An analytics reader reads the same log in its own group.
    analytics = _settings(cfg, "analytics", prefix)
    consumer = Consumer(
        {
            **analytics.kafka_common(),
            "group.id": f"{prefix}.analytics-test",
            "auto.offset.reset": "earliest",
        }
    )
    seen: set[str] = set()
    try:
        consumer.subscribe([analytics.events_topic])
        deadline = time.monotonic() + 30
        while rid not in seen and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.5):
                assert msg.error() is None, msg.error()
                seen.add((msg.key() or b"").decode())
    finally:
        consumer.close()
    assert rid in seen


# ------------------------------------------------------------------------------ refusals


def _refusal(conf: dict[str, Any], expect: int | None = None) -> set[int]:
    """Connect with ``conf``; the call must fail. The librdkafka error codes of the failed
    call and of the client's error callback, once ``expect`` is among them (or after 20 s:
    a busy CI machine may be slow).

    Codes, not texts: what a refusal says depends on the OpenSSL, JDK and librdkafka
    versions at each end (TLS 1.3 sends ``certificate_required`` where 1.2 sent
    ``bad_certificate``); which layer refused is what the tests assert."""
    codes: set[int] = set()
    logger = logging.getLogger(f"test.secure.rdkafka.{uuid.uuid4().hex[:6]}")
    logger.propagate = False  # librdkafka's own FAIL lines are not the test's output
    logger.addHandler(logging.NullHandler())
    admin = AdminClient({**conf, "error_cb": lambda e: codes.add(e.code())}, logger=logger)
    with pytest.raises(KafkaException) as failed:
        admin.list_topics(timeout=1.5)
    codes.add(failed.value.args[0].code())
    deadline = time.monotonic() + 20
    while expect is not None and expect not in codes and time.monotonic() < deadline:
        admin.poll(0.1)
    admin.poll(0)
    return codes


def _answers(conf: dict[str, Any]) -> bool:
    """The control: the same listener serves a client that holds what the refused lacked."""
    admin = AdminClient(conf)
    return bool(admin.list_topics(timeout=20).brokers)


def test_kafka_refuses_no_credentials_wrong_password_and_another_ca(
    secure_stack: stack.StackConfig, prefix: str, tmp_path: Path
) -> None:
    worker = _settings(secure_stack, "worker", prefix)
    assert _answers(worker.kafka_common())
    plain = {"bootstrap.servers": worker.bootstrap_servers}
    # No TLS, no SASL: the listener only speaks TLS; the connection is closed.
    assert KafkaError._TRANSPORT in _refusal(plain, KafkaError._TRANSPORT)
    # TLS but no SASL: the broker closes the connection before any request is served.
    tls_only = {**plain, "security.protocol": "SSL", "ssl.ca.location": worker.ssl_ca_location}
    assert KafkaError._TRANSPORT in _refusal(tls_only, KafkaError._TRANSPORT)
    # A wrong password: refused by SASL, past a TLS handshake that succeeded.
    bad = worker.model_copy(update={"sasl_password": SecretStr("not-the-password")})
    codes = _refusal(bad.kafka_common(), KafkaError._AUTHENTICATION)
    assert KafkaError._AUTHENTICATION in codes and KafkaError._SSL not in codes, codes
    # A CA that did not sign the broker's certificate: the client refuses the broker (a TLS
    # failure on the client's side, before any credential is sent).
    rogue = tmp_path / "rogue"
    secure.make_ca("openssl", rogue, cn="someone else's CA")
    other_ca = worker.model_copy(update={"ssl_ca_location": str(rogue / "ca.pem")})
    codes = _refusal(other_ca.kafka_common(), KafkaError._SSL)
    assert KafkaError._SSL in codes and KafkaError._AUTHENTICATION not in codes, codes
    # The broker's own mutual-TLS listener (its principal is a super user) takes no client
    # without a certificate from the stack's CA: none at all, or one from another CA with the
    # broker's own name. Whichever TLS alert the broker's JDK sends, the client is refused
    # (the connection fails) while the broker's own certificate is served.
    internal = {
        "bootstrap.servers": f"127.0.0.1:{secure_stack.nodes()[0].internal_port}",
        "security.protocol": "SSL",
        "ssl.ca.location": worker.ssl_ca_location,
    }
    tls = secure_stack.state_dir / "tls"
    assert _answers(
        {
            **internal,
            "ssl.certificate.location": str(tls / "broker.pem"),
            "ssl.key.location": str(tls / "broker.key"),
        }
    )
    assert KafkaError._TRANSPORT in _refusal(internal, KafkaError._TRANSPORT)
    secure.issue_cert("openssl", rogue, "intruder", "runlog-broker")
    intruder = {
        **internal,
        "ssl.certificate.location": str(rogue / "intruder.pem"),
        "ssl.key.location": str(rogue / "intruder.key"),
    }
    assert KafkaError._TRANSPORT in _refusal(intruder, KafkaError._TRANSPORT)


def test_redis_refuses_no_credentials_wrong_password_and_another_ca(
    secure_stack: stack.StackConfig, prefix: str, tmp_path: Path
) -> None:
    worker = _settings(secure_stack, "worker", prefix)
    anonymous = worker.model_copy(update={"redis_username": None, "redis_password": None})
    # The control: the role's own credentials and CA are served.
    assert redis_client(worker).ping()
    # Refusals by kind (redis-py's exception classes), whatever Redis or OpenSSL word them.
    with pytest.raises(redis.AuthenticationError):
        redis_client(anonymous).ping()
    wrong = worker.model_copy(update={"redis_password": SecretStr("not-the-password")})
    with pytest.raises(redis.AuthenticationError):
        redis_client(wrong).ping()
    rogue = tmp_path / "rogue"
    secure.make_ca("openssl", rogue, cn="someone else's CA")
    other_ca = worker.model_copy(update={"redis_ssl_ca": str(rogue / "ca.pem")})
    with pytest.raises(redis.ConnectionError) as refused:
        redis_client(other_ca).ping()
    # Refused by the TLS handshake, not by a timeout or a missing server.
    assert not isinstance(refused.value, redis.TimeoutError)
    # Plain TCP to the TLS port gets no answer a client could use.
    plain = worker.model_copy(
        update={
            "redis_url": worker.redis_url.replace("rediss://", "redis://"),
            "redis_ssl_ca": None,
        }
    )
    with pytest.raises(redis.ConnectionError):
        redis_client(plain, socket_timeout=2).ping()


def test_analytics_cannot_forge_events_leave_its_group_or_touch_redis(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    analytics = _settings(secure_stack, "analytics", prefix)
    # runlog's own (idempotent) writer: refused before a byte is written.
    writer = EventWriter(analytics)
    try:
        fut = writer.send(analytics.events_topic, b"forged-run", b"forged", [])
        with pytest.raises(DeliveryFailed) as info:
            fut.result(timeout=30)
        assert not info.value.unknown  # refused for sure, not an unknown outcome
        assert info.value.error.code() in (
            KafkaError.CLUSTER_AUTHORIZATION_FAILED,
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
        ), info.value.error
    finally:
        writer.close(timeout=5)
    # A plain producer: the broker names the topic it refuses.
    producer = Producer({**analytics.kafka_common(), "enable.idempotence": False})
    refused: list[KafkaError] = []
    producer.produce(
        analytics.events_topic,
        b"forged",
        key=b"forged-run",
        on_delivery=lambda e, _m: refused.append(e),
    )
    producer.flush(30)
    assert [e.code() for e in refused] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    # Reading in a group that is not its own.
    consumer = Consumer(
        {
            **analytics.kafka_common(),
            "group.id": "someone-elses-group",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.subscribe([analytics.events_topic])
        errors: list[KafkaError] = []
        deadline = time.monotonic() + 15
        while not errors and time.monotonic() < deadline:
            errors = [m.error() for m in consumer.consume(10, timeout=0.2) if m.error()]
    finally:
        consumer.close()
    assert errors and errors[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED, errors
    # Reading the quarantine topic (undecodable records of every tenant) is not its job.
    md = AdminClient(analytics.kafka_common()).list_topics(analytics.quarantine_topic, timeout=10)
    error = md.topics[analytics.quarantine_topic].error
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, error
    # No Redis user at all: neither anonymous nor with its Kafka password.
    with pytest.raises(redis.AuthenticationError):
        redis_client(analytics).ping()
    as_user = analytics.model_copy(
        update={"redis_username": "runlog-analytics", "redis_password": analytics.sasl_password}
    )
    with pytest.raises(redis.AuthenticationError):
        redis_client(as_user).ping()


def test_projection_service_cannot_touch_a_lease(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    projections = _settings(secure_stack, "projections", prefix)
    with redis_client(projections) as client:
        leases = LeaseManager(client, key_prefix=projections.redis_key_prefix)
        with pytest.raises(RedisUnavailable) as refused:
            leases.try_acquire("default", new_run_id(), "intruder", 1000)
        assert isinstance(refused.value.__cause__, redis.exceptions.NoPermissionError)
        lease_key = leases.lease_key("default", new_run_id())
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set(lease_key, "intruder|99")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get(lease_key)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
        leases.close()


def test_a_projection_service_completes_a_dead_rebuild_as_its_role(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    """A projection service completes a rebuild that died with its own Redis user: one
    that may not run scripts (above), so the rebuild's markers must not need one."""
    projections = _settings(secure_stack, "projections", prefix)
    with redis_client(projections) as client:
        keys = ProjectionKeys(projections.redis_key_prefix, "state", projections.events_topic)
        client.set(keys.incomplete_marker(), "{}")  # what a rebuild that died leaves
        rebuild(client, projections, ["state"], takeover=True)
        assert not client.exists(keys.incomplete_marker())
        assert not client.exists(keys.rebuild_marker())


def test_the_asyncio_ownership_check_asks_over_tls_as_its_role(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    """The asyncio barrier's GET (``LoopGet``) opens its connection as the client does:
    TLS to the CA, AUTH as the role's user, so the role's key permissions hold for it too."""
    worker = _settings(secure_stack, "worker", prefix)
    projections = _settings(secure_stack, "projections", prefix)

    async def ask(settings: Settings, key: str) -> Any:
        client = async_redis_client(settings)
        try:
            return await loop_get(client)(key)
        finally:
            await client.aclose()

    with redis_client(worker) as client:
        leases = LeaseManager(client, key_prefix=worker.redis_key_prefix)
        run_id = new_run_id()
        lease = leases.try_acquire("default", run_id, "owner-tls", 5000)
        assert isinstance(lease, Lease)
        key = leases.lease_key("default", run_id)
        try:
            assert asyncio.run(ask(worker, key)) == lease.token.encode()
            with pytest.raises(redis.exceptions.NoPermissionError):
                asyncio.run(ask(projections, key))
        finally:
            lease.release()
            leases.close()


def test_worker_cannot_write_projections_or_create_topics(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    worker = _settings(secure_stack, "worker", prefix)
    with (
        redis_client(worker) as client,
        pytest.raises(redis.exceptions.NoPermissionError),
    ):
        client.set(f"{worker.redis_key_prefix}:proj:state:{{x:0}}:pos", "1")
    with pytest.raises(ConfigError, match="TOPIC_AUTHORIZATION_FAILED"):
        ensure_topics(worker.model_copy(update={"topic_prefix": f"{prefix}-evil"}))
    admin_as_worker = AdminClient(worker.kafka_common())
    with pytest.raises(ConfigError, match="refused"):  # only a super user grants ACLs
        ensure_acls(admin_as_worker, worker, {"analytics": "User:runlog-worker"})


def test_operator_cannot_change_topics_or_permissions(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    operator = _settings(secure_stack, "operator", prefix)
    with pytest.raises(ConfigError, match="TOPIC_AUTHORIZATION_FAILED"):
        ensure_topics(operator.model_copy(update={"topic_prefix": f"{prefix}-ops"}))
    admin = AdminClient(operator.kafka_common())
    futures = admin.delete_topics([operator.events_topic], operation_timeout=10)
    with pytest.raises(KafkaException) as refused:
        futures[operator.events_topic].result(timeout=30)
    assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    with pytest.raises(ConfigError, match="refused"):
        ensure_acls(admin, operator, {"analytics": "User:runlog-operator"})
    with redis_client(operator) as client:
        for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "dir")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)


def test_each_role_reaches_the_fleet_keys_it_needs_and_no_more(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    """A secure worker announces itself (the agents it serves), answers reconcile requests,
    and announces the runs it hands over and those about to come, which another worker pops
    from both lists at once (its listener's ``BLPOP``); the operator lists workers, reads
    the answers and sets records aside; every role that reads runs reads the set-aside
    list, and only the operator writes it."""
    worker = _settings(secure_stack, "worker", prefix)
    operator = _settings(secure_stack, "operator", prefix)
    projections = _settings(secure_stack, "projections", prefix)
    me = f"w-acl-{uuid.uuid4().hex[:6]}"
    with (
        redis_client(worker) as w,
        redis_client(operator) as o,
        redis_client(projections) as p,
    ):
        w.hset(workers_key(worker, me), mapping={"id": me, "agents": "payer"})
        w.expire(workers_key(worker, me), 30)
        write_reply(w, worker, me, {"status": "settled"})
        assert me in {x.get("id") for x in live_workers(o, operator)}
        assert read_reply(o, operator, me) == {"status": "settled"}
        assert set_aside(o, operator, 0, 10**9, by="ops", reason="acl test", error="none")
        for client, settings in ((w, worker), (p, projections), (o, operator)):
            assert 10**9 in set_aside_offsets(client, settings, 0)
        for client, settings in ((w, worker), (p, projections)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.hset(set_aside_key(settings), "0:1", "{}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            p.hgetall(workers_key(projections, me))
        o.hdel(set_aside_key(operator), f"0:{10**9}")
        w.delete(workers_key(worker, me))

        lists = [handoffs_key(worker), coming_key(worker)]
        announce_coming(w, worker, {0: {"r-acl": "t1"}})
        announce(w, worker, [("r-acl", Record("open", "t1", "payer"))])
        assert w.llen(lists[0]) == 1 and w.llen(lists[1]) == 1  # best effort: checked here
        popped = {w.blpop(lists, timeout=1)[0], w.blpop(lists, timeout=1)[0]}
        assert {k.decode() if isinstance(k, bytes) else k for k in popped} == set(lists)
        with pytest.raises(redis.exceptions.NoPermissionError):
            p.blpop(lists, timeout=1)


# ------------------------------------------------------------------------------ secrets


def _all_passwords(cfg: stack.StackConfig) -> list[str]:
    return [pw for role in secure.ALL_ROLES for pw in secure.credentials(cfg, role).values()]


def test_no_password_in_logs_topics_redis_or_settings(
    secure_stack: stack.StackConfig,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cfg = secure_stack
    passwords = _all_passwords(cfg)
    assert len(passwords) == 9  # Kafka for 5 principals, Redis for 4 users
    caplog.set_level(logging.DEBUG)
    worker = _settings(cfg, "worker", prefix, snapshot_interval=2)
    services = Services(worker, writer_id="secure-secrets")
    calls: list[str] = []

    def echo(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        return f"echo {args}"

    tool = runlog.tool("echo")(echo)
    try:
        deps = services.run_deps()
        rid = new_run_id()
        with open_run_with(deps, rid, tools=[tool]) as run:
            for i in range(4):
                run.append(EventType.USER_MESSAGE, content=f"hello {i}")
                run.call_tool("echo", {"i": i})
        with open_run_with(deps, rid, tools=[tool]) as again:
            again.finish("completed", "done")
    finally:
        services.close()
    assert calls
    admin = secure.role_settings(cfg, "admin", topic_prefix=prefix, partitions=PARTITIONS)
    topics, stored = topic_bytes(admin), redis_bytes(admin)
    assert topics, "nothing read from the topics"
    assert stored, "nothing in Redis"
    scanned: dict[str, bytes] = {
        "kafka topics": topics,
        "redis keys and values": stored,
        "python logs": caplog.text.encode(),
        "stdout/stderr (librdkafka)": "".join(capfd.readouterr()).encode(),
        "settings": "".join(
            f"{s!r}{s}{s.as_env()}{s.model_dump_json()}"
            for s in (secure.role_settings(cfg, r) for r in secure.ALL_ROLES)
        ).encode(),
        "runlog stack env": "".join(str(stack.env(cfg, role=r)) for r in secure.ALL_ROLES).encode(),
        "stack status": stack.status(cfg).describe().encode(),
    }
    for path in (
        [n.server_log for n in cfg.nodes()]
        + [n.stdout_log for n in cfg.nodes()]
        + [n.server_properties for n in cfg.nodes()]
        + [cfg.redis_log, cfg.redis_conf, secure.redis_acl_path(cfg)]
    ):
        if path.is_file():
            scanned[str(path)] = path.read_bytes()[-5_000_000:]
    for where, data in scanned.items():
        for pw in passwords:
            assert pw.encode() not in data, f"a password found in {where}"
    # The files that do hold them are the owner's only.
    for role in secure.ALL_ROLES:
        assert secure.secrets_file(cfg, role).stat().st_mode & 0o077 == 0


def test_stack_env_names_the_password_file_never_a_password(
    secure_stack: stack.StackConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    from runlog.cli import main

    passwords = _all_passwords(secure_stack)
    for role in secure.ALL_ROLES:
        assert main(["stack", "env", "--secure", "--role", role]) == 0
        out = capsys.readouterr().out
        assert f"export RUNLOG_SASL_USERNAME=runlog-{role}" in out
        assert "export RUNLOG_SECURITY_PROTOCOL=SASL_SSL" in out
        assert str(secure.secrets_file(secure_stack, role)) in out
        assert not any(pw in out for pw in passwords)
    assert main(["stack", "status", "--secure"]) == 0
    out = capsys.readouterr().out
    assert "0600" in out and not any(pw in out for pw in passwords)


def test_restarted_secure_redis_keeps_leases_and_projection_transactions(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    """Redis replays its append-only file as the ``default`` user, checking each EXEC.

    With ``default`` switched off *and* stripped of every permission, Redis 7.0 dropped
    every MULTI/EXEC on restart (a lease script's effects, a projection's atomic update).
    """
    worker = _settings(secure_stack, "worker", prefix)
    projections = _settings(secure_stack, "projections", prefix)
    wclient, pclient = redis_client(worker), redis_client(projections)
    rid = new_run_id()
    leases = LeaseManager(wclient, key_prefix=worker.redis_key_prefix)
    pos_key = f"{projections.redis_key_prefix}:proj:test:{{{projections.events_topic}:0}}:pos"
    try:
        lease = leases.try_acquire("default", rid, "before-restart", 60_000)
        assert isinstance(lease, Lease), lease
        with pclient.pipeline(transaction=True) as pipe:
            pipe.set(pos_key, "41").incr(pos_key).execute()
        leases.close()
    finally:
        wclient.close()
        pclient.close()
    before = secure_stack.redis_log.read_text(errors="replace").count("CRITICAL")
    stack.kill_redis(secure_stack, sig=signal.SIGTERM)  # a clean stop: the AOF is complete
    stack.start_redis(secure_stack)
    after = secure_stack.redis_log.read_text(errors="replace").count("CRITICAL")
    wclient, pclient = redis_client(worker), redis_client(projections)
    try:
        assert wclient.get(leases.lease_key("default", rid)) == b"before-restart|1"
        assert wclient.get(leases.epoch_key("default", rid)) == b"1"
        assert pclient.get(pos_key) == b"42"
        pclient.delete(pos_key)
    finally:
        wclient.close()
        pclient.close()
    assert after == before, "Redis refused part of its append-only file on restart"
