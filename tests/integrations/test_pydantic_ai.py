"""A Pydantic AI agent as a runlog run: real worker processes killed, raced and resumed.

Offline: the model is Pydantic AI's ``FunctionModel`` scripted in ``workers/pai_worker.py``.
Effects are counted in Redis outside the workers (the ``ledger`` fixture); every answer the
model gave is logged there too, with a nonce the response carries into the log.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic_ai import RunContext
from workers.common import (
    EXIT_ESCALATED,
    EXIT_OK,
    KEEP,
    ROOT,
    Worker,
    assert_log_sound,
    payloads,
    read_log,
    start_worker,
    wait_lease_gone,
    worker_env,
)
from workers.pai_worker import requests_key

from runlog import aio
from runlog._settings import Settings
from runlog.projections._run_state import RunState
from runlog.schemas._models import Event, ModelTurn, ToolCallStarted
from runlog.schemas._vocabulary import EventType

PAI_WORKER = Path(__file__).resolve().parents[1] / "workers" / "pai_worker.py"
STEPS = 12
PACE = ("--steps", str(STEPS), "--think-s", "0.15", "--tool-s", "0.06")
MAX_ATTEMPTS = 60


def start(settings: Settings, tmp: Path, name: str, run_id: str, *args: str, **env: str) -> Worker:
    return start_worker(settings, tmp, name, "--run-id", run_id, *args, script=PAI_WORKER, **env)


def run_ok(settings: Settings, *argv: str) -> str:
    """Run a command on the stack to its end; what it printed (it must succeed)."""
    done = subprocess.run(
        argv,
        env=worker_env(settings),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def new_run_id() -> str:
    return f"pai-{uuid.uuid4().hex[:16]}"


def finish(
    settings: Settings, tmp: Path, name: str, run_id: str, *args: str, expect: int = EXIT_OK
) -> dict[str, Any]:
    """Start a worker meant to finish (``KEEP``'s TTLs) and wait for it to exit with
    ``expect``; what it reported."""
    code, result = start(settings, tmp, name, run_id, *args, **KEEP).finish(timeout=120)
    assert code == expect, result
    return result


def events_of(settings: Settings, run_id: str) -> list[Event]:
    return [rec.event for rec in read_log(settings, run_id)]


def sound_log(settings: Settings, run_id: str) -> tuple[list[Event], RunState]:
    """The run's log, which must be sound, and its folded state."""
    events = events_of(settings, run_id)
    return events, assert_log_sound(events)


def reject(settings: Settings, run_id: str, approval_id: str, by: str, note: str) -> None:
    asyncio.run(
        aio.decide(run_id, approval_id, approved=False, decided_by=by, note=note, settings=settings)
    )


def assert_no_recorded_turn_requested_again(
    client: redis.Redis, settings: Settings, run_id: str, events: list[Event]
) -> None:
    """Turn t's MODEL_TURN carries the nonce of the answer it recorded: it must be the
    last answer the model ever gave for t (a request after the record would come later)."""
    turns = payloads(events, EventType.MODEL_TURN)
    assert turns, "no model turn recorded"
    for t, turn in enumerate(turns):
        assert isinstance(turn, ModelTurn)
        assert turn.response_json, "the whole response is recorded"
        asked = [
            n.decode()
            for n in client.lrange(requests_key(settings.redis_key_prefix, run_id, t), 0, -1)
        ]
        assert asked, f"turn {t} recorded but never requested"
        assert turn.text.endswith(asked[-1]), (
            f"turn {t} was requested again after it was recorded: {turn.text!r} vs {asked}"
        )
    assert not client.exists(requests_key(settings.redis_key_prefix, run_id, len(turns)))


def assert_effects_once(ledger: Any, events: list[Event]) -> list[str]:
    started = [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == "charge"]
    keys = sorted({p.idempotency_key for p in started if isinstance(p, ToolCallStarted)})
    counts = ledger.per_key()
    assert sorted(counts) == keys, f"effects {counts} vs started keys {keys}"
    assert all(n == 1 for n in counts.values()), f"an effect happened twice: {counts}"
    return keys


@pytest.mark.timeout(900)  # tens of worker processes; a loaded machine starts them slowly
def test_a_multi_step_agent_killed_at_random_points_finishes_with_every_effect_once(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    rng = random.Random(20261130)
    run_id = new_run_id()
    kills, live_kills, code, result = 0, 0, None, {}
    for attempt in range(MAX_ATTEMPTS):
        w = start(fast, tmp_path, f"w{attempt}", run_id, "--takeover", *PACE)
        w.wait_flag("started", timeout=60)
        if attempt % 2:
            # Anywhere: opening the run, recovering, replaying, asking, calling.
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            # Inside the agent's own work: a model request or a tool call of this process.
            while not w.flag("live").exists() and w.proc.poll() is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
        # The last worker is let finish: the kills before it are the test, and a slow
        # machine's workers may each make too little progress to finish between kills.
        if w.proc.poll() is None and attempt < MAX_ATTEMPTS - 1:
            live_kills += w.flag("live").exists()
            w.kill(signal.SIGKILL)
            kills += 1
            continue
        code, result = w.finish(timeout=180)
        assert code == EXIT_OK, result
        break
    assert code == EXIT_OK, f"the run did not finish in {MAX_ATTEMPTS} workers"
    assert kills >= 8, f"only {kills} kills landed"
    assert live_kills >= 4, f"only {live_kills} kills landed in the agent's own work"
    print(f"{kills} kills ({live_kills} in the agent's own work), finished by worker {attempt}")
    assert result["output"].startswith("done")

    events, state = sound_log(fast, run_id)
    assert state.status == "finished" and state.outcome == "succeeded"
    assert state.turns == STEPS + 1
    # A kill while live came after that worker's claim: each live-killed worker but the
    # first (whose claim is RUN_STARTED) resumed the run. The finishing worker need not
    # have: its predecessor may have been killed after appending RUN_FINISHED.
    assert state.resumptions >= live_kills - 1
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)
    keys = assert_effects_once(ledger, events)
    assert len(keys) == STEPS  # one charge per step, none twice, none lost
    # The keys each MODEL_TURN announced are the keys the calls ran under.
    announced = {
        c.idempotency_key
        for p in payloads(events, EventType.MODEL_TURN)
        for c in p.tool_calls
        if c.name == "charge"
    }
    assert announced == set(keys)

    # A worker re-run on the finished run replays it whole: nothing requested, nothing run.
    again = finish(fast, tmp_path, "again", run_id, *PACE)
    assert again["requested"] == 0 and again["replayed"] == STEPS + 1
    assert again["output"] == result["output"]
    assert_effects_once(ledger, events_of(fast, run_id))


def test_an_approval_required_tool_waits_for_runlog_approve_then_runs_once(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run_id = new_run_id()
    result = finish(fast, tmp_path, "ask", run_id, "--scenario", "approval", expect=EXIT_ESCALATED)
    approval_id = result["approval_id"]
    assert ledger.total() == 0  # nothing ran before a person decided

    # Resumed before anyone decided: it asks nothing new and waits again.
    early = finish(fast, tmp_path, "early", run_id, "--scenario", "approval", expect=EXIT_ESCALATED)
    assert early["approval_id"] == approval_id

    cli = Path(sys.executable).with_name("runlog")
    run_ok(fast, str(cli), "approve", run_id, approval_id, "--by", "alice", "--note", "ok")

    after = finish(fast, tmp_path, "after", run_id, "--scenario", "approval")
    assert after["output"].startswith("done") and after["requested"] == 1

    events, state = sound_log(fast, run_id)
    assert state.status == "finished"
    (approval,) = state.approvals.values()
    assert approval.approved and approval.decided_by == "alice"
    assert approval.approval_id == approval_id
    started = [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == "refund"]
    assert len(started) == 1 and approval.idempotency_key == started[0].idempotency_key
    assert ledger.per_key() == {started[0].idempotency_key: 1}
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)


def test_a_rejected_approval_is_a_denial_the_agent_sees_and_nothing_runs(
    fast: Settings, ledger: Any, tmp_path: Path
) -> None:
    run_id = new_run_id()
    result = finish(fast, tmp_path, "ask", run_id, "--scenario", "approval", expect=EXIT_ESCALATED)

    reject(fast, run_id, result["approval_id"], "bob", "refund refused: order already credited")
    finish(fast, tmp_path, "after", run_id, "--scenario", "approval")
    events, state = sound_log(fast, run_id)
    assert state.status == "finished"
    assert ledger.total() == 0
    assert not [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == "refund"]


def test_an_irreversible_call_killed_mid_effect_escalates_and_is_never_repeated(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run_id = new_run_id()
    w = start(fast, tmp_path, "dies", run_id, "--scenario", "uncertain")
    key = w.wait_flag("in_tool", timeout=120)
    w.kill(signal.SIGKILL)  # the refund happened; its completion was never recorded
    assert ledger.per_key() == {key: 1}

    w = start(fast, tmp_path, "resumes", run_id, "--scenario", "uncertain", "--takeover", **KEEP)
    code, result = w.finish(timeout=120)
    assert code == EXIT_ESCALATED, result
    assert not w.flag("in_tool").exists()  # the resumed worker never reached the tool
    assert ledger.per_key() == {key: 1}  # not retried without evidence
    events, state = sound_log(fast, run_id)
    (call,) = state.open_calls.values()
    assert call.idempotency_key == key and call.status == "escalated"
    assert result["approval_id"] == call.approval_id

    # A person who checked the payment service rules that the refund stands.
    reject(fast, run_id, result["approval_id"], "carol", "refunded 700 for order 42")
    finish(fast, tmp_path, "ends", run_id, "--scenario", "uncertain")
    assert ledger.per_key() == {key: 1}
    events, state = sound_log(fast, run_id)
    assert state.status == "finished" and not state.open_calls
    assert state.completed_calls[key] == "resolved by carol: refunded 700 for order 42"
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)


def test_a_safe_call_killed_mid_call_is_retried_by_recovery_before_the_agent_runs(
    fast: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run_id = new_run_id()
    w = start(fast, tmp_path, "dies", run_id, "--scenario", "safe", "--hold-lookup")
    key = w.wait_flag("in_tool", timeout=120)
    # A safe call's turn and STARTED are pipelined: killed in the tool once they are in the
    # log (a tool that holds this long has long seen them leave the producer's linger).
    deadline = time.monotonic() + 10
    while EventType.TOOL_CALL_STARTED not in {e.type for e in events_of(fast, run_id)}:
        assert time.monotonic() < deadline, "the safe call's STARTED never reached the log"
        time.sleep(0.05)
    w.kill(signal.SIGKILL)
    result = finish(fast, tmp_path, "resumes", run_id, "--scenario", "safe", "--takeover")
    # Recovery ran the Pydantic AI tool again inside open_run, with the same key and a
    # run context of its own; the replayed turn then found the call completed.
    lookups = [
        k.decode() for k in redis_client.lrange(f"{fast.redis_key_prefix}:pai:lookups", 0, -1)
    ]
    assert lookups == [key, key]
    events, state = sound_log(fast, run_id)
    assert state.status == "finished" and state.completed_calls[key] == "order 7: 2 items"
    assert result["requested"] == 1 and result["replayed"] == 1
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)


CONTENDER_TTL_MS = 8000


def _contender(
    settings_dump: dict[str, Any], run_id: str, tmp: str, index: int, barrier: Any, out: Any
) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import argparse

    from workers.pai_worker import build

    import runlog

    # The race is decided at the open (wait_s=0), whatever the lease's length; the winner
    # holds a longer lease (and session) than the `fast` one so that a stall of the shared
    # CI machine longer than 1.5 s does not fence it mid-run, which is right but not this
    # test's point.
    settings = Settings(**settings_dump).model_copy(
        update={"lease_ttl_ms": CONTENDER_TTL_MS, "liveness_ttl_ms": CONTENDER_TTL_MS}
    )
    opts = argparse.Namespace(
        dir=tmp,
        name=f"c{index}",
        run_id=run_id,
        scenario="steps",
        steps=STEPS,
        think_s=0.05,
        tool_s=0.0,
        hold_lookup=False,
    )
    durable = build(opts, settings)

    async def go() -> str:
        barrier.wait(60)
        got = await durable.run(run_id=run_id, wait_s=0)
        return f"finished requested={got.requested_turns}"

    try:
        out.put((index, asyncio.run(go())))
    except runlog.RunLocked:
        out.put((index, "locked"))
    except runlog.Fenced:
        out.put((index, "fenced"))
    except Exception as exc:  # noqa: BLE001  (reported to the test, which fails on it)
        out.put((index, f"error {type(exc).__name__}: {exc}"))


def test_two_workers_racing_to_resume_one_wins_and_no_effect_repeats(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    rng = random.Random(7)
    ctx = mp.get_context("spawn")
    for trial in range(3):
        run_id = new_run_id()
        w = start(fast, tmp_path, f"first{trial}", run_id, "--steps", str(STEPS))
        w.wait_flag(f"charged-{rng.randrange(1, STEPS - 1)}", timeout=120)
        w.kill(signal.SIGKILL)
        wait_lease_gone(redis_client, fast)

        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(
                target=_contender,
                args=(fast.model_dump(), run_id, str(tmp_path), i, barrier, out),
            )
            for i in range(2)
        ]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=180) for _ in procs)
        for p in procs:
            p.join(60)
        assert all(not v.startswith("error") for v in got.values()), got
        assert any(v.startswith("finished") for v in got.values()), got
        # Both opened at once with wait_s=0: exactly one held the run while the other tried.
        assert sum(v in ("locked", "fenced") for v in got.values()) <= 1

        events, state = sound_log(fast, run_id)
        assert state.status == "finished"
        assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)
    # Every trial's effects together: each key once.
    counts = ledger.per_key()
    assert len(counts) == 3 * STEPS and all(n == 1 for n in counts.values()), counts


# In one process: what a tool raises to steer the agent -------------------------------------
def _in_process_agent(fast: Settings, calls: list[str]) -> Any:
    from pydantic_ai import Agent, ApprovalRequired, DeferredToolRequests, ModelRetry
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("pay", {"order": 1}, tool_call_id="p")])
        if turn == 1:  # after the retry prompt
            return ModelResponse(parts=[ToolCallPart("pay", {"order": 2}, tool_call_id="p")])
        if turn == 2:
            return ModelResponse(parts=[ToolCallPart("wire", {"cents": 900}, tool_call_id="w")])
        return ModelResponse(parts=[TextPart("done")])

    agent: Any = Agent(FunctionModel(script), output_type=[str, DeferredToolRequests])

    @agent.tool_plain
    def pay(order: int) -> str:
        calls.append(f"pay {order}")
        if order == 1 and calls.count("pay 1") == 1:
            raise ModelRetry("order 1 is closed: pay order 2")
        return f"paid order {order}"

    @agent.tool
    def wire(ctx: RunContext[None], cents: int) -> str:
        calls.append(f"wire {cents} approved={ctx.tool_call_approved}")
        if not ctx.tool_call_approved:
            raise ApprovalRequired()
        return f"wired {cents}"

    policies = {"pay": ToolPolicy("irreversible"), "wire": ToolPolicy("irreversible")}
    return RunlogAgent(agent, tools=policies, settings=fast)


def _history(messages: list[Any]) -> list[tuple[str, Any, Any]]:
    """What the model was shown, without the timestamps of the execution that built it."""
    return [
        (type(p).__name__, getattr(p, "content", None), getattr(p, "tool_call_id", None))
        for m in messages
        for p in m.parts
    ]


def test_a_retry_or_approval_a_tool_raised_is_replayed_never_run_again(fast: Settings) -> None:
    import runlog

    calls: list[str] = []
    durable = _in_process_agent(fast, calls)
    with pytest.raises(runlog.Escalated) as first:
        asyncio.run(durable.run("pay and wire"))
    run_id, approval_id = first.value.run_id, first.value.approval_id
    assert calls == ["pay 1", "pay 2", "wire 900 approved=False"]

    # Resumed before anyone decided: the failed payment and the tool's own request for
    # approval are replayed from the log, neither tool runs, the same approval waits.
    with pytest.raises(runlog.Escalated) as again:
        asyncio.run(durable.run(run_id=run_id))
    assert again.value.approval_id == approval_id
    assert calls == ["pay 1", "pay 2", "wire 900 approved=False"]

    asyncio.run(aio.decide(run_id, approval_id, approved=True, decided_by="dan", settings=fast))
    got = asyncio.run(durable.run(run_id=run_id))
    assert got.output == "done" and got.requested_turns == 1
    assert calls == ["pay 1", "pay 2", "wire 900 approved=False", "wire 900 approved=True"]

    # The finished run replayed whole: nothing runs, the agent sees the same history.
    replayed = asyncio.run(durable.run(run_id=run_id))
    assert replayed.output == "done" and replayed.requested_turns == 0
    assert len(calls) == 4
    assert _history(replayed.messages) == _history(got.messages)
    _, state = sound_log(fast, run_id)
    assert sorted(state.completed_calls.values()) == ["paid order 2", "wired 900"]


def test_many_agent_runs_share_one_event_loop(fast: Settings) -> None:
    from pydantic_ai.usage import UsageLimits

    from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy
    from tools.benchmarks.pydantic_ai_steps import _agent

    durable = RunlogAgent(_agent(4), tools={"lookup": ToolPolicy("irreversible")}, settings=fast)

    async def many() -> list[Any]:
        limits = UsageLimits(request_limit=None)
        runs = (durable.run(f"task {i}", usage_limits=limits) for i in range(20))
        return list(await asyncio.gather(*runs))

    results = asyncio.run(many())
    assert len({r.run_id for r in results}) == 20
    for r in results:
        assert r.output == "done" and r.requested_turns == 5
        state = assert_log_sound(events_of(fast, r.run_id))
        assert state.status == "finished" and state.turns == 5 and len(state.completed_calls) == 4
        assert state.messages[0].content == f"task {results.index(r)}"


def test_the_refund_example_killed_in_its_refund_resumes_with_one_refund(
    fast: Settings, tmp_path: Path
) -> None:
    bank = tmp_path / "refunds.json"
    cmd = [sys.executable, "-m", "tools.demo.pydantic_ai_refund", "--bank", str(bank)]
    first = subprocess.Popen(
        [*cmd, "--pause-in-refund", "60"],
        env=worker_env(fast),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert first.stdout is not None
    lines: list[str] = []
    for line in first.stdout:
        lines.append(line)
        if "kill -9 me now" in line:
            break
    first.kill()  # SIGKILL: the refund is in the payment service, its completion is not
    first.wait(10)
    run_id = lines[0].split()[1]
    assert lines[0].startswith("run ") and len(json.loads(bank.read_text())) == 1

    out = run_ok(fast, *cmd, run_id, "--takeover")
    assert "turns replayed 2, requested 1" in out, out
    refunds = json.loads(bank.read_text())
    assert list(refunds.values()) == [700]
    state = assert_log_sound(events_of(fast, run_id))
    assert state.status == "finished"
    (key,) = refunds
    assert state.completed_calls[key] == "refunded 700 cents for order 42"
