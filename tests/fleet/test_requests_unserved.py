"""A start nobody serves is visible, on the real stack with a real `runlog worker` that
serves other agents: `runlog start` warns at once (and refuses with --require-worker,
writing nothing), `runlog show` of the requested run shows the request (agent, tenant, by
whom, since) instead of an unknown run, `runlog runs` lists it, `--json` says it is not
served, and so does the console; another tenant sees none of it."""

from __future__ import annotations

import getpass
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fleet_support import Fleet, fleet_env
from ui_support import TOKEN_A, TOKEN_B, console

from runlog._settings import Settings
from runlog.fleet._lifecycle import read_latest
from runlog.fleet._worker import live_workers
from runlog.log._clients import redis_client

pytestmark = pytest.mark.timeout(240)


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=fleet_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_start_nobody_serves_is_visible_everywhere(
    test_settings: Settings, tmp_path: Path
) -> None:
    fleet = Fleet(test_settings, tmp_path)
    try:
        fleet.spawn()  # serves the agents of workers.fleet_agents, not "nosuchagent"
        client = redis_client(test_settings)
        deadline = time.monotonic() + 30
        while not live_workers(client, test_settings):  # its first heartbeat
            assert time.monotonic() < deadline, fleet.tail("w1")
            time.sleep(0.1)
        started = _cli(
            test_settings,
            "start",
            "nosuchagent",
            "--input",
            "{}",
            "--tenant",
            "acme",
        )
        assert started.returncode == 0, started
        rid = started.stdout.strip()
        assert "no live worker serves agent 'nosuchagent'" in started.stderr

        shown = _cli(test_settings, "show", rid, "--tenant", "acme")
        assert shown.returncode == 0, shown
        assert "no live worker serves agent nosuchagent since" in shown.stdout
        by = f"{getpass.getuser()}@{socket.gethostname()}"  # who asked, by default
        assert by in shown.stdout and "acme" in shown.stdout

        as_json = json.loads(_cli(test_settings, "show", rid, "--tenant", "acme", "--json").stdout)
        assert as_json["status"] == "requested" and as_json["served"] is False
        assert (as_json["agent"], as_json["tenant"], as_json["requested_by"]) == (
            "nosuchagent",
            "acme",
            by,
        )
        assert as_json["since"] is not None

        refused = _cli(
            test_settings,
            "start",
            "nosuchagent",
            "--input",
            "{}",
            "--tenant",
            "acme",
            "--run-id",
            "ask-refused",
            "--require-worker",
        )
        assert refused.returncode == 1, refused
        assert "nosuchagent" in refused.stderr
        assert "ask-refused" not in read_latest(test_settings)  # nothing written

        named = _cli(test_settings, "start", "nosuchagent", "--tenant", "acme", "--by", "ops@desk")
        shown2 = _cli(test_settings, "show", named.stdout.strip(), "--tenant", "acme", "--json")
        assert json.loads(shown2.stdout)["requested_by"] == "ops@desk", (named, shown2)

        # Another tenant is answered as for any unknown run.
        assert _cli(test_settings, "show", rid, "--tenant", "globex").returncode == 4

        runs = _cli(test_settings, "runs", "--tenant", "acme")
        line = next(ln for ln in runs.stdout.splitlines() if rid in ln)
        assert "requested" in line and "no live worker serves agent nosuchagent" in line
        only = _cli(test_settings, "runs", "--tenant", "acme", "--status", "requested")
        assert rid in only.stdout and only.returncode == 0, only
        listed = json.loads(_cli(test_settings, "runs", "--tenant", "acme", "--json").stdout)
        (entry,) = [r for r in listed["requested"] if r["run_id"] == rid]
        assert entry["served"] is False
        other = json.loads(_cli(test_settings, "runs", "--tenant", "globex", "--json").stdout)
        assert not [r for r in other["requested"] if r["run_id"] == rid]

        # A request of an agent a live worker serves is said to be served.
        served = _cli(
            test_settings, "start", "napper", "--input", '{"sleep_s": 30}', "--tenant", "acme"
        )
        assert served.returncode == 0 and "warning" not in served.stderr, served

        with console(test_settings) as base:
            web = httpx.Client(base_url=base, timeout=30)
            page = web.get(f"/runs/{rid}", headers={"Authorization": f"Bearer {TOKEN_A}"})
            assert page.status_code == 200
            assert "no live worker serves agent nosuchagent since" in page.text
            assert by in page.text
            listing = web.get("/", headers={"Authorization": f"Bearer {TOKEN_A}"})
            assert rid in listing.text and "no live worker serves agent nosuchagent" in listing.text
            foreign = web.get(f"/runs/{rid}", headers={"Authorization": f"Bearer {TOKEN_B}"})
            assert foreign.status_code == 404 and "nosuchagent" not in foreign.text
            assert rid not in web.get("/", headers={"Authorization": f"Bearer {TOKEN_B}"}).text
        client.close()
    finally:
        fleet.stop_all()
