"""The CLI's conventions, as real ``runlog`` processes against the real stack.

* Exit codes mean one thing each, for every command: 0 success, 1 failure (a refusal such as
  a decision on an approval already decided), 2 usage, 4 not found (docs/reference/cli.md).
* Another tenant's run is answered exactly as a run that does not exist, by every per-run
  command: the same exit code (4) and the same output once the run id is replaced, with
  nothing about its owner.
* Every reading command takes ``--json``, prints one valid JSON document and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from projections_support import env_for
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.cli import EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_OK, EXIT_STACK_DOWN, EXIT_USAGE
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import NOTIFY, PROJECTIONS

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
OWNER = "acme-owner"
INTRUDER = "intruder"
SECRET = "the owner's secret plan"
_SCRIPT = Path(sys.executable).parent / "runlog"
RUNLOG = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "runlog.cli"]


@dataclass(frozen=True)
class Owned:
    settings: Settings
    run_id: str
    approval_id: str


@pytest.fixture
def owned(test_settings: Settings, redis_client: redis.Redis) -> Iterator[Owned]:
    """A free run of OWNER (no worker holds it) with one action approval waiting, projected."""
    with services_for(test_settings):
        with runlog.open_run(settings=test_settings, tenant=OWNER, goal=SECRET) as run:
            approval_id = run.request_approval(f"pay 7 EUR: {SECRET}")
            rid = run.run_id
        ProjectionRunner(test_settings, redis_client, (*PROJECTIONS, NOTIFY)).catch_up(timeout_s=60)
        yield Owned(test_settings, rid, approval_id)


def _run(s: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = env_for(s, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [*RUNLOG, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _many(s: Settings, commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda argv: _run(s, *argv), commands))


def test_reading_commands_print_json_and_exit_0(owned: Owned) -> None:
    rid, ap = owned.run_id, owned.approval_id
    mine = ["--tenant", OWNER]
    commands = [
        ["runs", "--json"],
        ["show", rid, *mine, "--json"],
        ["state", rid, *mine, "--json"],
        ["audit", rid, *mine, "--json"],
        ["uncertain", "--json"],
        ["quarantine", "--json"],
        ["metrics", "--json"],
        ["approvals", "--json"],
        ["explain", rid, ap, *mine, "--json"],
        ["replay", rid, *mine, "--json"],
        ["verify", rid, *mine, "--json"],
        ["records", "list", "--json"],
        ["topics", "check", "--json"],
        ["stack", "env", "--json"],
    ]
    for argv, done in zip(commands, _many(owned.settings, commands), strict=True):
        assert done.returncode == EXIT_OK, (argv, done.returncode, done.stderr)
        json.loads(done.stdout)  # one valid JSON document, nothing else on stdout
    # The keys a script relies on are there.
    show, state, explain, verify, topics = (
        json.loads(_run(owned.settings, *argv).stdout)
        for argv in (commands[1], commands[2], commands[8], commands[10], commands[12])
    )
    assert show["run_id"] == rid and [q["approval_id"] for q in show["questions"]] == [ap]
    assert state["state"]["run_id"] == rid
    assert explain["approval_id"] == ap and explain["decided"] is None
    assert verify["ok"] is True and verify["runs"] == 1
    assert topics["ok"] is True and {"name", "exists", "drift"} <= set(topics["topics"][0])
    # `stack status` answers 0 (running) or 3 (the local stack is not the one in use), in JSON.
    status = _run(owned.settings, "stack", "status", "--json")
    assert status.returncode in (EXIT_OK, EXIT_STACK_DOWN), status.stderr
    assert json.loads(status.stdout)["running"] is (status.returncode == EXIT_OK)


PER_RUN = [
    ["show", "{run}"],
    ["state", "{run}"],
    ["audit", "{run}"],
    ["replay", "{run}"],
    ["replay", "{run}", "--json"],
    ["verify", "{run}"],
    ["verify", "{run}", "--json"],
    ["snapshot", "write", "{run}"],
    ["approve", "{run}", "{ap}", "--by", "mallory"],
    ["reject", "{run}", "{ap}", "--by", "mallory"],
    ["explain", "{run}", "{ap}"],
    ["explain", "{run}", "{ap}", "--json"],
]


def test_another_tenants_run_is_answered_exactly_as_an_unknown_run(owned: Owned) -> None:
    unknown = "r-no-such-run-" + owned.run_id[-8:]
    commands: list[list[str]] = []
    for template in PER_RUN:
        for rid in (unknown, owned.run_id):
            argv = [a.format(run=rid, ap=owned.approval_id) for a in template]
            commands.append([*argv, "--tenant", INTRUDER])
    results = _many(owned.settings, commands)
    for i, template in enumerate(PER_RUN):
        nobody, theirs = results[2 * i], results[2 * i + 1]
        for done in (nobody, theirs):
            assert done.returncode == EXIT_NOT_FOUND, (template, done.returncode, done.stderr)
        shape = [
            (nobody.stdout.replace(unknown, "RUN"), nobody.stderr.replace(unknown, "RUN")),
            (
                theirs.stdout.replace(owned.run_id, "RUN"),
                theirs.stderr.replace(owned.run_id, "RUN"),
            ),
        ]
        assert shape[0] == shape[1], (template, shape)
        said = theirs.stdout + theirs.stderr
        assert OWNER not in said and SECRET not in said, (template, said)
    # Neither decision of the intruder was recorded or queued: the approval still waits.
    question = json.loads(
        _run(
            owned.settings,
            "explain",
            owned.run_id,
            owned.approval_id,
            "--tenant",
            OWNER,
            "--json",
        ).stdout
    )
    assert question["decided"] is None


def test_an_unknown_approval_is_not_found(owned: Owned) -> None:
    for cmd in ("approve", "reject", "explain"):
        done = _run(owned.settings, cmd, owned.run_id, "ap-bogus", "--tenant", OWNER)
        assert done.returncode == EXIT_NOT_FOUND, (cmd, done.stderr)
        assert "ap-bogus" in done.stderr and done.stdout == "", (cmd, done.stderr)


def test_a_refused_decision_exits_1(owned: Owned) -> None:
    rid, ap = owned.run_id, owned.approval_id
    first = _run(owned.settings, "approve", rid, ap, "--tenant", OWNER, "--by", "ops-1")
    assert first.returncode == EXIT_OK, first.stderr
    second = _run(owned.settings, "reject", rid, ap, "--tenant", OWNER, "--by", "ops-2")
    assert second.returncode == EXIT_FAILURE, (second.stdout, second.stderr)
    assert "ops-1" in second.stderr


def test_usage_errors_exit_2(test_settings: Settings) -> None:
    commands = [
        ["no-such-command"],
        ["show"],  # a missing argument
        ["runs", "--limit", "many"],
        ["uncertain", "--deadline", "fast=3"],
        ["state", "a b"],  # a malformed run id
        ["show", "r-1", "--tenant", "*"],  # a tenant name runlog refuses
        ["verify"],  # neither a run nor --all
    ]
    for argv, done in zip(commands, _many(test_settings, commands), strict=True):
        assert done.returncode == EXIT_USAGE, (argv, done.returncode, done.stderr)
        assert done.stdout == "" and "Traceback" not in done.stderr, (argv, done.stderr)
