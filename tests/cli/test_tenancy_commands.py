"""Tenancy at every per-run entry point, and secrets and precedence of RUNLOG_KAFKA_EXTRA.

* ``TenantMismatch`` says that a run belongs to another tenant, never which one.
* Every per-run command (``state``, ``audit``, ``replay``, ``verify``, ``snapshot write``,
  ``approve``/``reject``) takes ``--tenant`` (default ``default``) and answers a run of
  another tenant exactly as an unknown run (exit 4).
* ``approve``/``reject`` read the run first: an approval id the run never issued is
  refused, naming it, instead of being queued or appended.
* ``RUNLOG_KAFKA_EXTRA`` values never print; a user's producer tunables win over runlog's
  defaults, and a setting that would break a guarantee is refused naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import redis
from projections_support import env_for

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.cli import main
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import ConfigError, TenantMismatch
from runlog.log._reader import LogReader
from runlog.producers._approvals import decisions_key
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.producers._writer import EventWriter, producer_config
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

OWNER = "owner-acme-7f3"
"""The owning tenant's name: no message shown to another tenant may contain it."""


@pytest.fixture
def services(test_settings: Settings) -> Iterator[Services]:
    svc = Services(test_settings, writer_id="tenancy-cmds")
    try:
        yield svc
    finally:
        svc.close()


@pytest.fixture
def cli_env(test_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """``runlog`` commands run in this process read the test's topics and keys."""
    for name, value in env_for(test_settings).items():
        monkeypatch.setenv(name, value)


def _count_records(settings: Settings, run_id: str) -> int:
    with LogReader(settings) as reader:
        return sum(1 for _ in reader.read(run_id))


# ---------------------------------------------------------------------------- TenantMismatch


def test_tenant_mismatch_never_names_the_owner(services: Services) -> None:
    deps = services.run_deps()
    rid = new_run_id()
    with open_run_with(deps, rid, tenant=OWNER) as run:
        run.append(EventType.USER_MESSAGE, content="private")
    with pytest.raises(TenantMismatch) as err:
        open_run_with(deps, rid, tenant="intruder")
    assert "another tenant" in str(err.value) and OWNER not in str(err.value)


class _HookedReader:
    """A LogReader that runs ``hook`` once, right after the first read it serves."""

    def __init__(self, inner: LogReader, hook: Callable[[], None]) -> None:
        self._inner, self._hook = inner, hook

    def read(self, *args: Any, **kwargs: Any) -> Generator[Any, None, None]:
        yield from self._inner.read(*args, **kwargs)
        hook, self._hook = self._hook, lambda: None
        hook()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_claim_lost_to_another_tenant_never_names_it(
    services: Services, test_settings: Settings
) -> None:
    """Tenant B replays a new run id, then tenant A starts it before B's claim lands."""
    deps = services.run_deps()
    rid = f"race-{new_run_id()}"

    def owner_starts_it() -> None:
        with open_run_with(deps, rid, tenant=OWNER) as run:
            run.append(EventType.USER_MESSAGE, content="first")

    hooked: RunDeps = dataclasses.replace(
        deps,
        reader_factory=lambda: _HookedReader(LogReader(test_settings), owner_starts_it),  # type: ignore[arg-type,return-value]
    )
    with pytest.raises(TenantMismatch) as err:
        open_run_with(hooked, rid, tenant="intruder")
    assert "meanwhile" in str(err.value), err.value
    assert "another tenant" in str(err.value) and OWNER not in str(err.value)


# ---------------------------------------------------------------------------- per-run commands


@pytest.fixture
def owned_run(services: Services, test_settings: Settings, redis_client: redis.Redis) -> str:
    """A finished run of tenant OWNER, with an approval request, projected."""
    with open_run_with(services.run_deps(), tenant=OWNER) as run:
        run.append(EventType.USER_MESSAGE, content="secret plan")
        run.request_approval("check", kind="action")
        run.finish("done")
        rid = run.run_id
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    return rid


PER_RUN = [
    ["state"],
    ["audit"],
    ["replay"],
    ["snapshot", "write"],
]


@pytest.mark.usefixtures("cli_env")
def test_per_run_commands_refuse_another_tenants_run(
    owned_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for cmd in PER_RUN:
        for tenant_args in (["--tenant", "intruder"], []):  # default: "default"
            rc = main([*cmd, owned_run, *tenant_args])
            out, err = capsys.readouterr()
            assert rc == 4, (cmd, tenant_args, out, err)  # answered as an unknown run
            assert f"UnknownRun: no run {owned_run}" in err, (cmd, err)
            assert OWNER not in out + err and "secret plan" not in out, (cmd, out, err)
        assert main([*cmd, owned_run, "--tenant", OWNER]) == 0, cmd
        capsys.readouterr()
    # verify too: not found (4), naming no owner; a check that fails would exit 1.
    assert main(["verify", owned_run, "--tenant", "intruder"]) == 4
    out, err = capsys.readouterr()
    assert f"no run {owned_run}" in err and OWNER not in out + err
    assert main(["verify", owned_run, "--tenant", OWNER]) == 0


@pytest.mark.usefixtures("cli_env")
def test_approve_refuses_an_approval_id_the_run_never_issued(
    services: Services, test_settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    deps = services.run_deps()
    run = open_run_with(deps, tenant=OWNER)  # held: a decision would be queued
    try:
        aid = run.request_approval("pay 7 USD", kind="action")
        inbox = decisions_key(deps, OWNER, run.run_id)

        assert main(["approve", run.run_id, "ap-bogus", "--tenant", OWNER]) == 4
        err = capsys.readouterr().err
        assert "UnknownApproval" in err and "ap-bogus" in err and aid in err
        assert deps.redis.llen(inbox) == 0

        assert main(["approve", run.run_id, aid, "--tenant", "intruder"]) == 4
        err = capsys.readouterr().err
        assert f"UnknownRun: no run {run.run_id}" in err and OWNER not in err
        assert deps.redis.llen(inbox) == 0

        assert main(["approve", run.run_id, aid, "--tenant", OWNER]) == 0
        assert "queued" in capsys.readouterr().out
        assert deps.redis.llen(inbox) == 1
    finally:
        run.close()

    # A free run: refused before anything is appended (no takeover, no decision).
    before = _count_records(test_settings, run.run_id)
    assert main(["reject", run.run_id, "ap-bogus", "--tenant", OWNER]) == 4
    assert "ap-bogus" in capsys.readouterr().err
    assert _count_records(test_settings, run.run_id) == before


# ---------------------------------------------------------------------------- KAFKA_EXTRA

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
