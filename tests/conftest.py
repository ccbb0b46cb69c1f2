"""Session fixtures: every test runs against a real Kafka and Redis.

Where the stack comes from, in order:
1. ``RUNLOG_BOOTSTRAP_SERVERS`` and ``RUNLOG_REDIS_URL`` are both set: use them as they are.
2. Something already answers on the stack's ports but is not runlog's embedded stack
   (e.g. ``docker compose up -d``): use it.
3. A Docker engine answers: docker-compose.yml's stack through testcontainers.
4. Otherwise start (or reuse) the embedded stack with :func:`runlog.stack.up`.

A missing or unreachable service FAILS the session (never a skip), in CI and locally.

The secure stack (``secure_stack``: TLS, SASL/SCRAM, ACLs; Redis TLS + ACL users) is always
the embedded one, on its own ports and state dir (``RUNLOG_SECURE_*``), started for the
session if it is not running and stopped again at the end if this session started it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from runlog import stack
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog._topics import delete_topics, ensure_topics
from runlog.errors import RunlogError
from runlog.log._clients import redis_client as make_redis

DEFAULT_TEST_TIMEOUT = int(os.environ.get("RUNLOG_TEST_TIMEOUT", "300"))
TEST_PARTITIONS = 3


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stack: exercises the embedded stack itself")
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is required: pip install -e '.[dev]'")
    # A session stopped by SIGTERM or SIGHUP (a CI runner's cancel, a closed terminal) ends
    # as one interrupted by ^C does: pytest then runs the session's finalizers, which stop
    # what the session started (the secure stack, the schema registry, Redis Cluster).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _interrupt)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets a timeout (a hung broker call must fail, not hang CI)."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


def _answers(host_port: str) -> bool:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


def _verify(settings: Settings, source: str) -> None:
    """A real call on both services, or the session fails with what was tried."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        md = AdminClient(settings.kafka_common()).list_topics(timeout=15)
        if not md.brokers:
            raise RuntimeError("metadata lists no brokers")
    except (KafkaException, RuntimeError) as exc:
        pytest.fail(
            f"Kafka at {settings.bootstrap_servers} ({source}) is unreachable: {exc}",
            pytrace=False,
        )
    try:
        make_redis(settings, socket_timeout=5).ping()
    except (redis.RedisError, OSError) as exc:
        pytest.fail(
            f"Redis at {settings.redis_url} ({source}) is unreachable: {exc}", pytrace=False
        )


@pytest.fixture(scope="session")
def stack_source() -> str:
    """``env`` (RUNLOG_* given), ``external`` (ports answer), ``docker`` or ``embedded``."""
    if os.environ.get("RUNLOG_BOOTSTRAP_SERVERS") and os.environ.get("RUNLOG_REDIS_URL"):
        cfg = stack.StackConfig.from_env()
        if os.environ["RUNLOG_BOOTSTRAP_SERVERS"] != cfg.bootstrap_servers:
            return "env"
    cfg = stack.StackConfig.from_env()
    st = stack.status(cfg)
    if st.running:
        return "embedded"
    kafka_ports_answer = all(_answers(s) for s in cfg.bootstrap_servers.split(","))
    if kafka_ports_answer and not any(s.running for s in st.services if s.managed):
        return "external"
    if _docker_engine_answers():
        return "docker"
    return "embedded"


def _docker_engine_answers() -> bool:
    """True only when a Docker *engine* answers (a docker client alone is not enough)."""
    if os.environ.get("RUNLOG_TEST_NO_DOCKER") or shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


@contextlib.contextmanager
def _compose_stack() -> Iterator[None]:
    """docker-compose.yml's Kafka + Redis through testcontainers, for the session."""
    from testcontainers.compose import DockerCompose

    compose = DockerCompose(Path(__file__).resolve().parent.parent, wait=True)
    compose.start()
    try:
        yield
    finally:
        compose.stop()


@pytest.fixture(scope="session")
def settings(stack_source: str) -> Iterator[Settings]:
    """Settings pointing at a live Kafka + Redis (see the module docstring)."""
    if stack_source == "docker":
        with _compose_stack():
            s = Settings()
            _verify(s, stack_source)
            ensure_topics(s)
            os.environ["RUNLOG_BOOTSTRAP_SERVERS"] = s.bootstrap_servers
            os.environ["RUNLOG_REDIS_URL"] = s.redis_url
            yield s
        return
    if stack_source == "env":
        s = Settings()
    elif stack_source == "external":
        cfg = stack.StackConfig.from_env()
        s = Settings(bootstrap_servers=cfg.bootstrap_servers, redis_url=cfg.redis_url)
    else:
        try:
            st = stack.up()
        except RunlogError as exc:
            pytest.fail(
                f"could not bring up the embedded stack (runlog stack up): {exc}", pytrace=False
            )
        s = Settings(bootstrap_servers=st.bootstrap_servers, redis_url=st.redis_url)
    _verify(s, stack_source)
    # Tests choose their encoding: a registry exported by `runlog stack env` would switch
    # every writer, and every subprocess, to Confluent's format (tests/log/test_registry.py
    # opts in with its own settings).
    os.environ.pop("RUNLOG_SCHEMA_REGISTRY_URL", None)
    s = s.model_copy(update={"schema_registry_url": None})
    # Subprocesses and code that reads Settings() from the environment find the same stack.
    os.environ["RUNLOG_BOOTSTRAP_SERVERS"] = s.bootstrap_servers
    os.environ["RUNLOG_REDIS_URL"] = s.redis_url
    yield s


@pytest.fixture
def topic_prefix() -> str:
    """A prefix unique to this test, e.g. ``t-1a2b3c4d``."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    # Through runlog's factory, so a Redis with ACL users or TLS (RUNLOG_REDIS_USERNAME,
    # RUNLOG_REDIS_SSL_CA) named by RUNLOG_* works here as it does for runlog.
    client = make_redis(settings)
    yield client
    client.close()


@pytest.fixture
def test_settings(
    settings: Settings, topic_prefix: str, redis_client: redis.Redis
) -> Iterator[Settings]:
    """Settings with this test's own topics (created, 3 partitions) and Redis key prefix.

    Topics and keys are removed afterwards (best effort).
    """
    s = settings.model_copy(
        update={
            "topic_prefix": topic_prefix,
            "redis_key_prefix": topic_prefix,
            "partitions": TEST_PARTITIONS,
        }
    )
    ensure_topics(s).raise_for_drift()
    yield s
    _cleanup(s, redis_client)


def _cleanup(s: Settings, client: redis.Redis) -> None:
    with contextlib.suppress(RunlogError):  # best effort: the broker keeps running
        delete_topics(
            s, [s.events_topic, s.quarantine_topic, s.lifecycle_topic, s.keys_topic], timeout=10
        )
    try:
        keys = list(client.scan_iter(match=f"{s.redis_key_prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    except redis.RedisError:
        pass


@pytest.fixture
def unique_group() -> Callable[..., str]:
    """Factory for consumer group names unique to this test: ``unique_group("state")``."""

    def make(name: str = "g") -> str:
        return f"{name}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture(scope="session")
def secure_stack() -> Iterator[stack.StackConfig]:
    """The secure embedded stack (``runlog stack up --secure``); fails if it cannot start."""
    cfg = stack.StackConfig.from_env(secure=True)
    was_running = stack.status(cfg).running
    t0 = time.monotonic()
    try:
        stack.up(cfg, timeout=120)
    except RunlogError as exc:
        pytest.fail(
            f"could not bring up the secure stack (runlog stack up --secure): {exc}",
            pytrace=False,
        )
    if not was_running:
        print(f"\nsecure stack up in {time.monotonic() - t0:.1f}s")
    yield cfg
    if not was_running:
        # The session's clients of this stack first: none is left retrying a stopped broker.
        Services.close_shared(cfg.bootstrap_servers)
        stack.down(cfg)


@pytest.fixture
def fast(test_settings: Settings) -> Iterator[Settings]:
    """This test's stack with a short lease, so a takeover after a kill takes ~1.5 s; the
    process's shared clients for it are closed afterwards."""
    from workers.common import services_for

    s = test_settings.model_copy(update={"lease_ttl_ms": 1500})
    with services_for(s):
        yield s


@pytest.fixture
def steady(test_settings: Settings) -> Iterator[Settings]:
    """This test's stack with 8 s of lease and liveness, for in-process owners under load that
    are meant to finish: ``fast``'s 1.5 s let one stall of a loaded CI machine starve the
    liveness renewal and fence them. A test that needs a lease to run out uses ``fast``."""
    from workers.common import KEEP, services_for

    s = test_settings.model_copy(
        update={
            "lease_ttl_ms": int(KEEP["RUNLOG_LEASE_TTL_MS"]),
            "liveness_ttl_ms": int(KEEP["RUNLOG_LIVENESS_TTL_MS"]),
        }
    )
    with services_for(s):
        yield s


@pytest.fixture
def ledger(fast: Settings, redis_client: redis.Redis) -> Any:
    """The effects receivers record, one entry per idempotency key (tests/workers/common)."""
    from workers.common import Ledger

    return Ledger(redis_client, fast.redis_key_prefix)
