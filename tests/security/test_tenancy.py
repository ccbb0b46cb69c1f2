"""Tenancy and secrets.

* Two tenants using the same run id and the same tool arguments get different
  idempotency keys and different Redis keys; tenant B cannot fence tenant A, never sees
  A's events, and every reader excludes the other tenant's events from a run's fold.
* Configured secrets (SASL password, TLS key password, Redis password) reach librdkafka
  and Redis, and nothing else: not the Kafka topics, not Redis keys or values (leases,
  start index, snapshots), not logs, not ``Settings.as_env()``, ``repr`` or ``str``.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from scan_support import redis_bytes, topic_bytes

from runlog import stack
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import TenantMismatch
from runlog.log._clients import redis_client
from runlog.log._reader import LogReader
from runlog.producers._approvals import decisions_key
from runlog.producers._lease import LeaseManager
from runlog.producers._opening import open_run_with
from runlog.producers._tools import Tool
from runlog.projections._run_state import RunState, apply
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import idempotency_key, new_run_id
from runlog.schemas._vocabulary import EventType

SASL_SECRET = "sasl-S3CRET-a94be1"
TLS_SECRET = "tls-S3CRET-77c0d2"
REDIS_SECRET = "redis-S3CRET-5f1e08"
SECRETS = (SASL_SECRET, TLS_SECRET, REDIS_SECRET)


def _echo_tool(calls: list[str]) -> Tool:
    def echo(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        return f"echo {args}"

    return Tool(name="echo", fn=echo)


# ---------------------------------------------------------------------------- keys


def test_idempotency_and_redis_keys_of_two_tenants_never_collide() -> None:
    rid = new_run_id()
    args = canonical_json({"amount": 7, "to": "acct-1"})
    assert idempotency_key("a", rid, "pay", args, 0) != idempotency_key("b", rid, "pay", args, 0)
    # A tenant name cannot be forged out of the scope: fields are separated, not glued.
    assert idempotency_key("a", "b" + rid, "pay", args, 0) != idempotency_key(
        "ab", rid, "pay", args, 0
    )
    leases = LeaseManager(redis.Redis(), key_prefix="p")  # never connects: keys only
    for key in (leases.lease_key, leases.epoch_key, leases.run_tag):
        assert key("a", rid) != key("b", rid)
    # Tenant "a:x" with run "y" would share tenant "a"'s lease of run "x:y": refused.
    for bad in ("a:x", "", "a\x1fb", "a\nb"):
        with pytest.raises(ValueError):
            leases.lease_key(bad, "y")
        with pytest.raises(ValueError):
            idempotency_key(bad, rid, "pay", args, 0)


def _fold_for(records: list[Any], run_id: str, tenant: str) -> RunState:
    state = RunState(run_id=run_id, tenant=tenant)
    for rec in records:
        apply(state, rec.event)
    return state


def _without_foreign(state: RunState) -> dict[str, Any]:
    d = state.to_dict()
    del d["fenced_writes"], d["max_epoch_seen"]
    return d


def test_same_run_id_in_two_tenants_stays_apart(test_settings: Settings) -> None:
    """Tenant B opening A's run id neither fences A nor sees A's conversation."""
    services = Services(test_settings, writer_id="tenancy")
    deps = services.run_deps()
    rid = new_run_id()
    calls: list[str] = []
    args = {"amount": 7, "to": "acct-1"}
    try:
        a = open_run_with(deps, rid, tenant="a", tools=[_echo_tool(calls)])
        a.append(EventType.USER_MESSAGE, content="a's private message")
        key_a = a.key_for("echo", args)
        a.call_tool("echo", args)
        a_epoch = a.epoch
        # The same arguments in another tenant are another action.
        key_b = idempotency_key("b", rid, "echo", canonical_json(args), 0)
        assert key_b != key_a
        # Tenant b is refused a's run id before it writes anything.
        with pytest.raises(TenantMismatch):
            open_run_with(deps, rid, tenant="b", tools=[_echo_tool(calls)])
        # A still owns its run at its epoch and keeps appending.
        a.append(EventType.USER_MESSAGE, content="a again")
        assert a.epoch == a_epoch
        a.finish("completed")
        assert len(set(calls)) == len(calls)

        with LogReader(test_settings) as reader:
            records = list(reader.read(rid))
        fold_a = _fold_for(records, rid, "a")
        assert fold_a.status == "finished" and fold_a.tenant == "a"
        assert all(m.content != "b's message" for m in fold_a.messages)
        # The writer never read b's records back; only their count and epochs differ.
        assert _without_foreign(fold_a) == _without_foreign(a.state)
        assert [r for r in records if r.event.tenant == "b"] == []
        assert fold_a.fenced_writes == 0
        assert key_a in fold_a.completed_calls
    finally:
        services.close()


# ---------------------------------------------------------------------------- secrets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[str]:
    """A throwaway redis-server that requires ``REDIS_SECRET`` (never the shared one)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (runlog stack up installs it)")
    port = _free_port()
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            REDIS_SECRET,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
            "--logfile",
            str(tmp_path / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url, password=REDIS_SECRET).ping()
                break
            except (redis.RedisError, OSError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _secret_settings(base: Settings, redis_url: str) -> Settings:
    from pydantic import SecretStr

    return base.model_copy(
        update={
            "redis_url": redis_url,
            "redis_password": SecretStr(REDIS_SECRET),
            # PLAINTEXT broker: librdkafka takes (and ignores) the SASL/TLS secrets.
            "sasl_mechanism": "PLAIN",
            "sasl_username": "runlog",
            "sasl_password": SecretStr(SASL_SECRET),
            "ssl_key_password": SecretStr(TLS_SECRET),
            "snapshot_interval": 2,
        }
    )


def test_secrets_pass_through_to_clients() -> None:
    from pydantic import SecretStr

    s = Settings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password=SecretStr(SASL_SECRET),
        ssl_ca_location="/etc/ca.pem",
        ssl_certificate_location="/etc/cert.pem",
        ssl_key_location="/etc/key.pem",
        ssl_key_password=SecretStr(TLS_SECRET),
        redis_password=SecretStr(REDIS_SECRET),
    )
    conf = s.kafka_common()
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl.username"] == "svc"
    assert conf["sasl.password"] == SASL_SECRET
    assert conf["ssl.key.password"] == TLS_SECRET
    assert conf["ssl.ca.location"] == "/etc/ca.pem"
    assert conf["ssl.certificate.location"] == "/etc/cert.pem"
    assert conf["ssl.key.location"] == "/etc/key.pem"
    client = redis_client(s)
    try:
        assert client.connection_pool.connection_kwargs["password"] == REDIS_SECRET
    finally:
        client.close()
    printed = [repr(s), str(s), str(s.as_env()), s.model_dump_json(), str(s.model_dump())]
    for text in printed:
        for secret in SECRETS:
            assert secret not in text
    # Environment variables are read the same way (the names are a public contract).


def test_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLOG_SASL_PASSWORD", SASL_SECRET)
    monkeypatch.setenv("RUNLOG_REDIS_PASSWORD", REDIS_SECRET)
    monkeypatch.setenv("RUNLOG_SSL_KEY_PASSWORD", TLS_SECRET)
    s = Settings()
    assert s.kafka_common()["sasl.password"] == SASL_SECRET
    assert s.kafka_common()["ssl.key.password"] == TLS_SECRET
    assert s.redis_password is not None
    assert s.redis_password.get_secret_value() == REDIS_SECRET
    for text in (repr(s), str(s), str(s.as_env())):
        assert not any(secret in text for secret in SECRETS)


def test_configured_secrets_never_reach_logs_topics_or_redis(
    test_settings: Settings,
    redis_with_password: str,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    s = _secret_settings(test_settings, redis_with_password)
    calls: list[str] = []
    services = Services(s, writer_id="secrets")
    caplog.set_level(logging.DEBUG)
    try:
        deps = services.run_deps()
        rid = new_run_id()
        with open_run_with(deps, rid, tools=[_echo_tool(calls)]) as run:
            for i in range(5):
                run.append(EventType.USER_MESSAGE, content=f"hello {i}")
                run.call_tool("echo", {"i": i})
            run.request_approval("check", kind="action")
        with open_run_with(deps, rid, tools=[_echo_tool(calls)]) as again:  # resume
            again.finish("completed", "done")
        client = redis_client(s)
        try:
            client.rpush(decisions_key(deps, "default", rid), b"{}")  # an inbox exists too
        finally:
            client.close()
        stored = redis_bytes(s)
    finally:
        services.close()
    assert calls and stored, "the workload wrote nothing to scan"
    scanned: dict[str, bytes] = {
        "kafka topics": topic_bytes(s),
        "redis keys and values (leases, start index, snapshots, inbox)": stored,
        "python logs": caplog.text.encode(),
        "stdout/stderr (librdkafka logs)": "".join(capfd.readouterr()).encode(),
    }
    cfg = stack.StackConfig.from_env()
    for path in [n.server_log for n in cfg.nodes()] + [cfg.redis_log]:
        if path.is_file():
            scanned[str(path)] = path.read_bytes()[-5_000_000:]
    for where, data in scanned.items():
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} found in {where}"
