"""Every per-run command (``state``, ``audit``, ``replay``, ``verify``, ``snapshot write``,
``approve``/``reject``) takes ``--tenant`` (default ``default``) and answers a run of another
tenant exactly as an unknown run (exit 4), naming no owner; ``approve``/``reject`` read the
run first: an approval id the run never issued is refused, naming it, instead of being
queued or appended.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from projections_support import env_for

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.cli import main
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._reader import LogReader
from runlog.producers._approvals import decisions_key
from runlog.producers._opening import open_run_with
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
