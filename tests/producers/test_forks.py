"""Forking a run on the real stack: the world sees exactly what each effects mode promises.

The receiver (``workers/fork_worker.charge_tool``) applies every request it gets and
deduplicates nothing: a Redis list outside every worker, one entry per request. Each test
counts, per charge, how many times the world saw it, across the parent and its forks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from projections_support import replayed_states
from workers.common import ROOT, read_log, worker_env
from workers.fork_worker import charge_tool

import runlog
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._verify import verify_run
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._replay import replay
from runlog.projections._lineage import fork_key
from runlog.schemas._vocabulary import EventType

FORK_WORKER = Path(__file__).resolve().parents[1] / "workers" / "fork_worker.py"


class World:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.key = f"{settings.redis_key_prefix}:world"

    def tool(self) -> runlog.Tool:
        return charge_tool(self.client, self.key)

    def requests(self) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self.client.lrange(self.key, 0, -1)]

    def seen(self) -> Counter[int]:
        """How many requests the world took per charge ``n``."""
        return Counter(r["n"] for r in self.requests())


@pytest.fixture
def world(fast: Settings, redis_client: redis.Redis) -> World:
    return World(redis_client, fast)


def _parent(fast: Settings, world: World, ns: list[int]) -> tuple[str, dict[int, int]]:
    """A finished run that charged each ``n``; returns it and the seq of each completion."""
    with runlog.open_run(tools=[world.tool()], settings=fast) as run:
        done: dict[int, int] = {}
        for n in ns:
            run.call_tool("charge", {"n": n})
            done[n] = run.state.seq
        run.finish("done")
        return run.run_id, done


def _calls(fast: Settings, world: World, run_id: str, ns: list[int]) -> list[str]:
    with runlog.open_run(run_id, tools=[world.tool()], settings=fast) as run:
        return [run.call_tool("charge", {"n": n}) for n in ns]


def _types(fast: Settings, run_id: str) -> list[EventType]:
    return [r.event.type for r in read_log(fast, run_id)]


def test_inherit_returns_the_parents_results_and_repeats_nothing(
    fast: Settings, world: World
) -> None:
    parent, done = _parent(fast, world, [1, 2, 3])
    assert world.seen() == {1: 1, 2: 1, 3: 1}
    fork = runlog.fork(parent, at_seq=done[1], new_run_id=f"{parent}-f", settings=fast)
    assert fork.created and fork.parent_run_id == parent and fork.at_seq == done[1]
    assert {e.args_json for e in fork.other_timeline} == {'{"n":2}', '{"n":3}'}
    results = _calls(fast, world, fork.run_id, [1, 2, 4])
    # 1: the fork's own (the prefix); 2: the parent's result; 4: a new action of the fork.
    assert results[0].startswith("charged 1") and results[1].startswith("charged 2")
    assert world.seen() == {1: 1, 2: 1, 3: 1, 4: 1}
    new = [r for r in world.requests() if r["n"] == 4]
    assert new[0]["key"].endswith(f"@{fork.run_id}")  # bound to the fork
    # Run again from the top (a re-executed worker): nothing more reaches the world.
    assert _calls(fast, world, fork.run_id, [1, 2, 4]) == results
    assert world.seen() == {1: 1, 2: 1, 3: 1, 4: 1}
    st = runlog.open_run(fork.run_id, settings=fast)
    with st:
        lin = st.state.lineage
        assert lin is not None
        assert [e.args_json for e in lin.not_inherited()] == ['{"n":3}']  # what the other did
        by_args = {e.args_json: e for e in lin.effects.values()}
        assert by_args['{"n":2}'].resolution == "inherited" and by_args['{"n":2}'].run_id == parent
    resolved = [
        r.event.payload
        for r in read_log(fast, fork.run_id)
        if r.event.type is EventType.FORK_EFFECT_RESOLVED
    ]
    assert [(p.resolution, p.source_run_id) for p in resolved] == [("inherited", parent)]  # type: ignore[attr-defined]
    assert _types(fast, fork.run_id)[0] is EventType.RUN_FORKED
    # It replays on its own: only its own records are folded, and they give its state.
    own = read_log(fast, fork.run_id)
    replayed = replay(fast, runlog_redis(fast), fork.run_id)
    assert replayed.records == len(own) and replayed.state.lineage is not None
    assert replayed.state.completed_calls.keys() >= {r["key"] for r in world.requests()[:1]}


def test_execute_repeats_once_under_the_forks_own_key(fast: Settings, world: World) -> None:
    parent, done = _parent(fast, world, [1, 2])
    fork = runlog.fork(parent, at_seq=done[1], effects="execute", settings=fast)
    _calls(fast, world, fork.run_id, [1, 2])
    assert world.seen() == {1: 1, 2: 2}  # the declared repeat: once more, not twice more
    keys = [r["key"] for r in world.requests() if r["n"] == 2]
    assert keys[1] == fork_key(keys[0], fork.run_id)
    _calls(fast, world, fork.run_id, [1, 2])
    assert world.seen() == {1: 1, 2: 2}
    resolved = [
        r.event.payload
        for r in read_log(fast, fork.run_id)
        if r.event.type is EventType.FORK_EFFECT_RESOLVED
    ]
    assert [p.resolution for p in resolved] == ["repeated"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("approved", [True, False])
def test_ask_stops_for_a_person_with_the_parents_evidence(
    fast: Settings, world: World, approved: bool
) -> None:
    parent, done = _parent(fast, world, [1, 2])
    fork = runlog.fork(parent, at_seq=done[1], effects="ask", settings=fast)
    with pytest.raises(runlog.Escalated) as stopped:
        _calls(fast, world, fork.run_id, [1, 2])
    assert world.seen() == {1: 1, 2: 1}  # nothing ran while a person is asked
    approval_id = stopped.value.approval_id
    assert approval_id is not None
    q = runlog.question(fork.run_id, approval_id, settings=fast)
    assert parent in json.dumps(q.to_dict())  # the parent's evidence is in the question
    # Asked again before anyone decided: still waiting, one request, nothing run.
    with pytest.raises(runlog.Escalated):
        _calls(fast, world, fork.run_id, [1, 2])
    runlog.decide(fork.run_id, approval_id, approved=approved, decided_by="ops", settings=fast)
    results = _calls(fast, world, fork.run_id, [1, 2])
    assert world.seen() == ({1: 1, 2: 2} if approved else {1: 1, 2: 1})
    _calls(fast, world, fork.run_id, [1, 2])
    assert world.seen() == ({1: 1, 2: 2} if approved else {1: 1, 2: 1})
    assert results[1].startswith("charged 2")


def test_a_fork_of_a_fork_repeats_nothing_of_either_timeline(fast: Settings, world: World) -> None:
    parent, done = _parent(fast, world, [1, 2, 3])
    f1 = runlog.fork(parent, at_seq=done[1], settings=fast)
    with runlog.open_run(f1.run_id, tools=[world.tool()], settings=fast) as run:
        run.call_tool("charge", {"n": 2})  # inherited
        run.call_tool("charge", {"n": 5})  # the fork's own new action
        f1_head = run.state.seq
    assert world.seen() == {1: 1, 2: 1, 3: 1, 5: 1}
    f2 = runlog.fork(f1.run_id, at_seq=f1_head, settings=fast)
    # 3 was done by the root after the first fork point and not met by f1: still the
    # other timeline's, carried down; inherited here like the parent's own.
    assert [e.args_json for e in f2.other_timeline] == ['{"n":3}']
    _calls(fast, world, f2.run_id, [1, 2, 5, 3, 6])
    assert world.seen() == {1: 1, 2: 1, 3: 1, 5: 1, 6: 1}
    report = verify_run(fast, runlog_redis(fast), f2.run_id)
    assert report.ok, report
    lineage = next(c for c in report.checks if c.name == "lineage")
    assert "matches the parent's log" in lineage.detail
    # The projections fold forks like any run: state equals the log's fold, and the audit
    # names each fork and what the other timeline did.
    runner = ProjectionRunner(fast, runlog_redis(fast), PROJECTIONS)
    runner.catch_up(timeout_s=60)
    expected = replayed_states(fast, [f1.run_id, f2.run_id])
    for rid in (f1.run_id, f2.run_id):
        view = queries.get_state(runlog_redis(fast), fast, rid)
        assert view is not None and view["state"] == expected[rid], rid
    audit = queries.get_audit(runlog_redis(fast), fast, f2.run_id)
    forked = [e for e in audit if e["kind"] == "forked"]
    assert forked[0]["parent_run_id"] == f1.run_id
    assert [x["args_json"] for x in forked[0]["other_timeline"]] == ['{"n":3}']


def test_a_fork_inside_an_open_call_settles_it_by_the_parents_evidence(
    fast: Settings, world: World, redis_client: redis.Redis
) -> None:
    """N falls between a call's STARTED and its completion: in the parent the outcome was
    unknown until recovery found it; the fork settles it from the parent's log (completed
    after N) or, forked while it was still open, by the same recovery, never repeating it."""
    flaky = {"lost": True}

    def charge(args: dict[str, Any], *, idempotency_key: str) -> str:
        world.client.rpush(world.key, json.dumps({"key": idempotency_key, "n": args["n"]}))
        if flaky["lost"]:
            raise TimeoutError("the answer was lost after the charge was applied")
        return f"charged {args['n']} ({idempotency_key})"

    available = {"yes": False}

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        if not available["yes"]:
            return runlog.Inconclusive("ledger down")
        found = any(r["key"] == idempotency_key for r in world.requests())
        return (
            runlog.Match(f"charged {args['n']} ({idempotency_key})") if found else runlog.Absent("")
        )

    tool = runlog.tool("charge", risk="irreversible", reconcile=lookup)(charge)
    run = runlog.open_run(tools=[tool], settings=fast)
    with pytest.raises(runlog.CallUncertain):
        run.call_tool("charge", {"n": 7})
    started = next(
        r.event.seq
        for r in read_log(fast, run.run_id)
        if r.event.type is EventType.TOOL_CALL_STARTED
    )
    run.close()
    # Forked while the call is still uncertain in the parent: the fork recovers it itself.
    open_fork = runlog.fork(run.run_id, at_seq=started, settings=fast)
    assert [e.status for e in open_fork.other_timeline] == []  # the call is the fork's own
    # The uncertain-call queue shows it in the fork too, before anyone recovers it there.
    ProjectionRunner(fast, runlog_redis(fast), PROJECTIONS).catch_up(timeout_s=60)
    queue = queries.uncertain_report(runlog_redis(fast), fast).open
    assert {c["run_id"] for c in queue} >= {run.run_id, open_fork.run_id}
    # The parent settles it (the ledger is back): a match, completed by reconciliation.
    available["yes"] = True
    with runlog.open_run(run.run_id, tools=[tool], settings=fast) as again:
        assert again.call_tool("charge", {"n": 7}).startswith("charged 7")
        head = again.state.seq
    assert head > started
    settled = runlog.fork(run.run_id, at_seq=started, settings=fast)
    flaky["lost"] = False
    with runlog.open_run(settled.run_id, tools=[tool], settings=fast) as f:
        assert not f.state.open_calls  # settled from the parent's completion after N
        assert f.call_tool("charge", {"n": 7}).startswith("charged 7")
    with runlog.open_run(open_fork.run_id, tools=[tool], settings=fast) as f:
        assert not f.state.open_calls  # its recovery found the charge: a match
        assert f.call_tool("charge", {"n": 7}).startswith("charged 7")
    assert world.seen() == {7: 1}


def runlog_redis(settings: Settings) -> redis.Redis:
    from runlog._bootstrap import Services

    return Services.shared(settings).redis


def test_refusals_another_tenant_and_seqs_outside_the_log(fast: Settings, world: World) -> None:
    parent, done = _parent(fast, world, [1])
    env = worker_env(fast)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "runlog.cli", "fork", *args],
            env={**env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    other = cli(parent, "--tenant", "other", "--at-seq", "1")
    unknown = cli("r-no-such-run", "--tenant", "other", "--at-seq", "1")
    assert other.returncode == 4 and unknown.returncode == 4
    assert other.stderr.replace(parent, "RUN") == unknown.stderr.replace("r-no-such-run", "RUN")
    beyond = cli(parent, "--at-seq", str(done[1] + 99))
    assert beyond.returncode == 1, beyond.stderr
    zero = cli(parent, "--at-seq", "0")
    assert zero.returncode == 1
    assert cli(parent, "--at-seq", "1", "--input", "{not json").returncode == 2
    made = cli(parent, "--at-seq", "2", "--run-id", f"{parent}-cli", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["created"] is True
    again = cli(parent, "--at-seq", "2", "--run-id", f"{parent}-cli", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["created"] is False
    clash = cli(parent, "--at-seq", "1", "--run-id", f"{parent}-cli")
    assert clash.returncode == 1  # the id is another fork: refused, nothing written
    assert [r.event.type for r in read_log(fast, f"{parent}-cli")] == [EventType.RUN_FORKED]
    verify = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "verify", f"{parent}-cli"],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _worker(fast: Settings, *args: str, flag: Path | None = None) -> subprocess.Popen[str]:
    env = {**worker_env(fast), "PYTHONPATH": str(ROOT)}
    if flag is not None:
        env["FORK_FLAG"] = str(flag)
    return subprocess.Popen(
        [sys.executable, str(FORK_WORKER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("die", ["before-ack", "after-ack"])
def test_sigkill_during_the_lineage_write_leaves_one_fork_or_none(
    fast: Settings, world: World, die: str
) -> None:
    parent, done = _parent(fast, world, [1, 2])
    fid = f"{parent}-k"
    common = ["--parent", parent, "--at-seq", str(done[1]), "--run-id", fid, "--world", world.key]
    killed = _worker(fast, "make", *common, "--die", die)
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    first = [r.event.type for r in read_log(fast, fid)]
    assert first in ([], [EventType.RUN_FORKED])  # never half a fork
    if die == "after-ack":
        assert first == [EventType.RUN_FORKED]  # acknowledged: the whole fork is there
    time.sleep(fast.lease_ttl_ms / 1000)
    again = _worker(fast, "make", *common)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert json.loads(out)["created"] is (first == [])
    assert [r.event.type for r in read_log(fast, fid)] == [EventType.RUN_FORKED]
    _calls(fast, world, fid, [1, 2])
    assert world.seen() == {1: 1, 2: 1}


def test_sigkill_of_the_forks_worker_mid_fork_resumes_each_effect_once(
    fast: Settings, world: World, tmp_path: Path
) -> None:
    parent, done = _parent(fast, world, [1, 2])
    fork = runlog.fork(parent, at_seq=done[1], settings=fast)
    flag = tmp_path / "effect"
    calls = json.dumps([{"n": 1}, {"n": 2}, {"n": 4}, {"n": 5}])
    common = ["--run-id", fork.run_id, "--world", world.key, "--calls", calls]
    w = _worker(fast, "calls", *common, "--hold", "4", flag=flag)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert w.poll() is None, w.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(w.pid, signal.SIGKILL)
    w.communicate(timeout=30)
    assert world.seen() == {1: 1, 2: 1, 4: 1}
    w2 = _worker(fast, "calls", *common)
    _, err = w2.communicate(timeout=120)
    assert w2.returncode == 0, err
    # 4 was applied before the kill: recovery found it (a match), nothing ran twice.
    assert world.seen() == {1: 1, 2: 1, 4: 1, 5: 1}
    report = verify_run(fast, runlog_redis(fast), fork.run_id)
    assert report.ok, report


def test_aio_fork_and_a_fork_while_the_parent_still_runs(fast: Settings, world: World) -> None:
    """``await runlog.aio.fork(...)`` forks a run its owner still holds (the fork reads the
    log, never takes the parent's lease); the fork knows the parent's effects as of then."""
    import asyncio

    with runlog.open_run(tools=[world.tool()], settings=fast) as parent:
        parent.call_tool("charge", {"n": 1})
        at = parent.state.seq
        parent.call_tool("charge", {"n": 2})
        made = asyncio.run(runlog.aio.fork(parent.run_id, at_seq=at, settings=fast))
        assert made.created and [e.args_json for e in made.other_timeline] == ['{"n":2}']
        parent.call_tool("charge", {"n": 3})  # the parent goes on: its own new action
    _calls(fast, world, made.run_id, [1, 2])
    assert world.seen() == {1: 1, 2: 1, 3: 1}


def test_lineage_you_can_see_runs_forked_from_show_and_diff(fast: Settings, world: World) -> None:
    parent, done = _parent(fast, world, [1, 2, 3])
    fork = runlog.fork(parent, at_seq=done[1], effects="execute", settings=fast)
    _calls(fast, world, fork.run_id, [1, 2, 4])
    assert world.seen() == {1: 1, 2: 2, 3: 1, 4: 1}
    ProjectionRunner(fast, runlog_redis(fast), PROJECTIONS).catch_up(timeout_s=60)
    env = {**worker_env(fast), "PYTHONPATH": str(ROOT)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "runlog.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = cli("runs", "--forked-from", parent, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == [fork.run_id]
    assert json.loads(cli("runs", "--forked-from", fork.run_id, "--json").stdout)["runs"] == []
    shown = cli("show", parent, "--json")
    assert json.loads(shown.stdout)["forks"] == [fork.run_id]
    shown = cli("show", fork.run_id)
    assert f"forked from {parent} at seq {done[1]}" in shown.stdout
    got = cli("diff", parent, fork.run_id, "--json")
    assert got.returncode == 0, got.stderr
    d = json.loads(got.stdout)
    # They share the history up to the fork point; then the parent charged 2 and the fork
    # decided to repeat it.
    assert d["first_a"]["run_id"] == parent and d["first_a"]["seq"] == done[1] + 1
    assert d["first_b"]["run_id"] == fork.run_id and d["first_b"]["type"] == "fork_effect_resolved"
    assert sorted(e["args_json"] for e in d["only_a"]) == ['{"n":2}', '{"n":3}']
    assert sorted(e["args_json"] for e in d["only_b"]) == ['{"n":2}', '{"n":4}']
    assert all(e["key"].endswith(f"@{fork.run_id}") for e in d["only_b"])
    other = cli("diff", parent, fork.run_id, "--tenant", "other")
    assert other.returncode == 4


def test_an_agent_forked_at_every_seq_never_applies_an_effect_twice(
    fast: Settings, world: World
) -> None:
    """A scripted agent (three charges, the same charge twice on purpose, a compaction)
    forked after each of its events with ``inherit``: each fork finishes the script, sees
    exactly its parent's conversation up to the fork point, and across the parent and all
    its forks the world took each charge exactly as often as the parent did."""
    from runlog.testing import AgentLoop, Call, CompactStep, FinishStep, ModelStep, ScriptedModel

    script = [
        ModelStep("charge 1", calls=(Call("charge", {"n": 1}),)),
        ModelStep("charge 2", calls=(Call("charge", {"n": 2}),)),
        CompactStep("charged 1 and 2", kept_turns=1),
        ModelStep("charge 2 again, on purpose", calls=(Call("charge", {"n": 2}),)),
        ModelStep("charge 3", calls=(Call("charge", {"n": 3}),)),
        FinishStep("succeeded"),
    ]

    def loop() -> AgentLoop:
        return AgentLoop(ScriptedModel(script))

    with runlog.open_run(tools=[world.tool()], settings=fast) as run:
        loop().run(run, user_message="charge the customer")
        parent, head = run.run_id, run.state.seq
    assert world.seen() == {1: 1, 2: 2, 3: 1}
    for at in range(1, head):  # every seq but the finish
        made = runlog.fork(parent, at_seq=at, settings=fast)
        with runlog.open_run(made.run_id, tools=[world.tool()], settings=fast) as fork:
            at_n = replay(fast, runlog_redis(fast), parent, to_seq=at).state
            assert fork.state.messages == at_n.messages, at
            assert fork.state.compactions == at_n.compactions
            loop().run(fork, user_message="charge the customer")
            assert fork.state.status == "finished" and fork.state.outcome == "succeeded", at
        assert world.seen() == {1: 1, 2: 2, 3: 1}, at


def test_an_effect_the_parent_left_uncertain_is_a_persons_to_repeat_and_safe_tools_run(
    fast: Settings, world: World
) -> None:
    """After N the parent started a charge whose outcome nobody knows (its worker died):
    ``inherit`` has no result to take, so the fork asks; rejected, the call returns the
    refusal and nothing runs. A safe tool the parent also ran after N simply runs again."""
    peeks: list[str] = []

    def peek(args: dict[str, Any], *, idempotency_key: str) -> str:
        peeks.append(idempotency_key)
        return "balance 10"

    safe = runlog.tool("peek", risk="safe")(peek)
    with runlog.open_run(tools=[world.tool(), safe], settings=fast) as run:
        run.call_tool("charge", {"n": 1})
        at = run.state.seq
        run.call_tool("peek", {})
        parent = run.run_id
    # The parent's worker dies inside charge 2: a STARTED without an outcome.
    with runlog.open_run(parent, settings=fast, recover=False) as run:
        run.append(
            EventType.TOOL_CALL_STARTED,
            call_id="c-lost",
            name="charge",
            args_json='{"n":2}',
            idempotency_key=run.key_for("charge", {"n": 2}),
            risk="irreversible",
        )
    fork = runlog.fork(parent, at_seq=at, settings=fast)
    assert {(e.args_json, e.status) for e in fork.other_timeline} == {
        ('{"n":2}', "uncertain"),
        ("{}", "completed"),
    }
    with runlog.open_run(fork.run_id, tools=[world.tool(), safe], settings=fast) as f:
        assert f.call_tool("peek", {}) == "balance 10"
        with pytest.raises(runlog.Escalated) as asked:
            f.call_tool("charge", {"n": 2})
    assert len(peeks) == 2 and peeks[1].endswith(f"@{fork.run_id}")
    assert asked.value.approval_id is not None
    runlog.decide(
        fork.run_id,
        asked.value.approval_id,
        approved=False,
        decided_by="ops",
        note="the bank has it",
        settings=fast,
    )
    with runlog.open_run(fork.run_id, tools=[world.tool(), safe], settings=fast) as f:
        assert f.call_tool("charge", {"n": 2}).startswith("not repeated: ops declined")
    assert world.seen() == {1: 1}
