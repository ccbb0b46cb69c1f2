"""``runlog uncertain --tenant`` lists only that tenant's uncertain calls (text and
``--json``), on the real stack with a projection caught up."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import redis
from workers.common import worker_env

import runlog
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.producers._handle import engine_of

pytestmark = pytest.mark.timeout(120)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


class Crash(BaseException):
    """Not an Exception: the owner dies between STARTED and any outcome."""


def _orphan_call(settings: Settings, tenant: str) -> str:
    def dies(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash

    tool = runlog.tool("refund", risk="irreversible")(dies)
    run = runlog.open_run(tenant=tenant, tools=[tool], settings=settings)
    with pytest.raises(Crash):
        run.call_tool("refund", {"order": tenant})
    engine_of(run).lease.release()
    key = next(iter(run.state.open_calls))
    # A new owner without the tool: the call is uncertain in the log, and stays open.
    runlog.open_run(run.run_id, tenant=tenant, settings=settings).close()
    return key


def test_uncertain_accepts_tenant_and_lists_only_that_tenants_calls(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    ours, theirs = _orphan_call(test_settings, "acme"), _orphan_call(test_settings, "globex")
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    env = worker_env(test_settings)

    def listed(*args: str) -> set[str]:
        done = _cli(env, "uncertain", "--json", *args)
        assert done.returncode == 0, done.stderr
        return {c["idempotency_key"] for c in json.loads(done.stdout)["open"]}

    assert listed() == {ours, theirs}
    assert listed("--tenant", "acme") == {ours}
    assert listed("--tenant", "globex") == {theirs}
    assert listed("--tenant", "nobody") == set()
    text = _cli(env, "uncertain", "--tenant", "acme")
    assert text.returncode == 0 and ours in text.stdout and theirs not in text.stdout
