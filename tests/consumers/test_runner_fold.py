"""Projections equal the writers' fold; a rebuild from zero is byte-identical to live."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import redis
from projections_support import (
    dump,
    env_for,
    prometheus_sample,
    replayed_states,
    wait_caught_up,
)

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner, rebuild
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator


def test_projections_import_neither_kafka_nor_redis() -> None:
    code = (
        "import sys, projections, projections._state_view, projections._uncertain, "
        "runlog.projections._audit, projections._verdict\n"
        "bad = [m for m in ('confluent_kafka', 'redis') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_state_projection_equals_the_fold_of_every_run(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    gen = LoadGenerator(test_settings, seed=7)
    run_ids = gen.generate(runs=25, events_per_run=30)
    runner = ProjectionRunner(test_settings, redis_client, PROJECTIONS)
    runner.catch_up(timeout_s=60)
    assert runner.stats.applied["state"] == gen.sent

    expected = replayed_states(test_settings, run_ids)
    fenced = 0
    for rid in run_ids:
        view = queries.get_state(redis_client, test_settings, rid)
        assert view is not None, rid
        assert view["state"] == expected[rid], rid
        fenced += view["state"]["fenced_writes"]
        summary = queries.get_summary(redis_client, test_settings, rid)
        assert summary is not None
        assert summary["seq"] == str(expected[rid]["seq"])
        assert summary["status"] == "finished"
        # Where the run starts: its first record is the RUN_STARTED at that offset.
        assert view["first_offset"] is not None and view["partition"] is not None
        audit = queries.get_audit(redis_client, test_settings, rid)
        assert [e["seq"] for e in audit if e["kind"] == "finished"] == [expected[rid]["seq"]]
        assert sum(e["kind"] == "fenced_write" for e in audit) == expected[rid]["fenced_writes"]
    assert fenced > 0, "the load should contain fenced writes"


def test_rebuild_is_byte_identical_to_the_live_projection(
    test_settings: Settings, redis_client: redis.Redis, unique_group, capsys, monkeypatch
) -> None:
    gen = LoadGenerator(test_settings, seed=3)
    gen.generate(runs=10, events_per_run=20)
    runner = ProjectionRunner(test_settings, redis_client, PROJECTIONS, group=unique_group("live"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        gen.steady(rate_per_s=400, duration_s=2.0, runs=15)  # appends while it projects
        wait_caught_up(redis_client, test_settings)
    finally:
        runner.stop()
        thread.join(timeout=30)
    live = dump(redis_client, test_settings)
    assert live and len([k for k in live if ":run:" in k]) >= 3 * 25

    # The CLI's rebuild: deletes the keys and positions, refolds to the watermarks.
    for k, v in env_for(test_settings).items():
        monkeypatch.setenv(k, v)
    from runlog.cli import main

    assert main(["rebuild", "all"]) == 0
    assert "rebuilt state, uncertain, audit" in capsys.readouterr().out
    rebuilt = dump(redis_client, test_settings)
    assert rebuilt.keys() == live.keys()
    assert rebuilt == live

    # And once more through the library, from a projection whose contents were damaged.
    first = next(k for k in live if ":run:" in k)
    redis_client.set(test_settings.redis_key_prefix + first, b"{}")
    rebuild(redis_client, test_settings, ("state", "uncertain", "audit"))
    assert dump(redis_client, test_settings) == live


def test_cli_queries(
    test_settings: Settings, redis_client: redis.Redis, capsys, monkeypatch
) -> None:
    gen = LoadGenerator(test_settings, seed=11)
    run_ids = gen.generate(runs=4, events_per_run=25)
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    for k, v in env_for(test_settings).items():
        monkeypatch.setenv(k, v)
    from runlog.cli import main

    capsys.readouterr()
    # The load generator's runs belong to tenant "load"; per-run commands refuse them to
    # any other tenant, the default one included.
    assert main(["state", run_ids[0], "--json", "--tenant", "load"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["state"]["run_id"] == run_ids[0]
    assert main(["state", run_ids[0], "--tenant", "load"]) == 0
    assert f"run        {run_ids[0]}" in capsys.readouterr().out
    assert main(["state", run_ids[0]]) == 4  # another tenant's run: not found
    theirs = capsys.readouterr().err
    assert main(["state", "no-such-run"]) == 4
    assert capsys.readouterr().err == theirs.replace(run_ids[0], "no-such-run")
    assert main(["audit", run_ids[0], "--json"]) == 4
    capsys.readouterr()
    assert main(["audit", run_ids[0], "--json", "--tenant", "load"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert entries[-1]["kind"] == "finished"
    assert main(["uncertain", "--json", "--deadline", "safe=1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["still_open"] == len(rep["open"])
    assert main(["quarantine", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["metrics", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    for name in PROJECTIONS:
        assert snap["projections"][name]["lag"] == 0
        assert snap["projections"][name]["applied"] == gen.sent
    assert main(["metrics"]) == 0
    text = capsys.readouterr().out
    lag = prometheus_sample(
        text, "runlog_projection_lag_records", projection="state", partition="0"
    )
    assert lag == 0


@pytest.mark.parametrize("bad", ["safe", "safe=x", "fast=3"])
def test_cli_rejects_bad_deadlines(bad: str, capsys) -> None:
    from runlog.cli import main

    assert main(["uncertain", "--deadline", bad]) == 2
