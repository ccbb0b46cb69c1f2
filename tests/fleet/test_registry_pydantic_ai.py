"""A Pydantic AI agent registered with the fleet (``runlog.integrations.pydantic_ai.register``)
runs on `runlog worker` processes like any agent, and survives their SIGKILL.

The agent (tests/workers/pai_fleet_agents.py) runs on Pydantic AI's own ``FunctionModel``:
no network. Its irreversible ``charge`` counts each idempotency key on a receiver that does
not deduplicate; every count must be 1, and no model turn the log holds is asked again.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pydantic_ai  # noqa: F401 - a dev dependency: missing, the test fails rather than skips
import pytest
import redis
from fleet_support import Fleet, effects, verify_all, wait_finished

import runlog
from runlog._settings import Settings
from runlog.log._reader import LogReader
from runlog.schemas._vocabulary import EventType

AGENTS = "workers.pai_fleet_agents"
RUNS = 6
STEPS = 4


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path, FLEET_TEST_STEP_S="0.25")
    yield f
    f.stop_all()


def _holder(settings: Settings, rids: list[str], fleet: Fleet) -> str | None:
    """A live worker that wrote the last event of a run that is not finished."""
    with LogReader(settings) as reader:
        for rid in rids:
            evs = [r.event for r in reader.read(rid, partition=reader.partition_of(rid), start=0)]
            if len(evs) < 3 or evs[-1].type is EventType.RUN_FINISHED:
                continue
            for name in fleet.alive():
                if evs[-1].writer_id.startswith(f"{name}-"):
                    return name
    return None


def _turns(client: redis.Redis, settings: Settings) -> dict[str, int]:
    raw = client.hgetall(f"{settings.redis_key_prefix}:pai-turns")
    return {k.decode(): int(v) for k, v in raw.items()}


def test_a_registered_pydantic_ai_agent_runs_on_the_fleet(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.spawn(agents=AGENTS)
    rid = runlog.start("pai.charger", "order solo steps 2", tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "charged solo 2 times")
    assert st.agent_name == "pai.charger" and st.agent_version
    assert st.turns == 3
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]


def test_a_pydantic_ai_agent_survives_sigkills_of_its_workers_each_effect_once(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    rng = random.Random(29)
    for _ in range(2):
        fleet.spawn(agents=AGENTS, concurrency=4)
    orders = [f"o{i}" for i in range(RUNS)]
    rids = [
        runlog.start(
            "pai.charger", f"order {o} steps {STEPS}", tenant="t1", settings=fleet_settings
        )
        for o in orders
    ]
    kills = 0
    deadline = time.monotonic() + 120
    while kills < 3 and time.monotonic() < deadline:
        time.sleep(rng.uniform(0.3, 0.8))
        victim = _holder(fleet_settings, rids, fleet)
        if victim is None:
            continue
        fleet.kill(victim)  # it holds a run mid-way: each charge is 0.25 s in flight
        kills += 1
        fleet.spawn(agents=AGENTS, concurrency=4, wait=False)
    assert kills == 3, "no worker held a run mid-way: slow the tool down"
    got = wait_finished(fleet_settings, rids, 120, fleet)
    assert {st.outcome for st in got.values()} == {"succeeded"}
    assert sum(st.resumptions for st in got.values()) >= 1
    counts = effects(redis_client, fleet_settings)
    assert len(counts) == RUNS * STEPS and set(counts.values()) == {1}
    # A turn is asked of the model again only if its MODEL_TURN never became durable; a
    # turn the log holds is replayed. Every run's log has exactly STEPS + 1 turns.
    assert all(st.turns == STEPS + 1 for st in got.values())
    turns = _turns(redis_client, fleet_settings)
    assert {f"{o}:{t}" for o in orders for t in range(STEPS + 1)} <= set(turns)
    done = verify_all(fleet_settings)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_fork_with_another_prompt_and_model_is_shown_the_parents_conversation(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    """``runlog.fork(..., input={"prompt", "model"})`` of a registered Pydantic AI agent's
    run: the worker that takes the fork drives the agent with the model the input names,
    which is shown the parent's conversation up to the fork point and the new prompt; the
    parent's charges are not made again."""
    import json

    fleet.spawn(agents=AGENTS)
    task = "order wf steps 2"
    rid = runlog.start("pai.charger", task, tenant="t1", settings=fleet_settings)
    wait_finished(fleet_settings, [rid], 60, fleet)
    with LogReader(fleet_settings) as reader:
        evs = [r.event for r in reader.read(rid, partition=reader.partition_of(rid), start=0)]
    at = [e.seq for e in evs if e.type is EventType.TOOL_CALL_COMPLETED][1]  # both charged
    made = runlog.fork(
        rid,
        tenant="t1",
        at_seq=at,
        input=json.dumps({"prompt": "what if we refund instead", "model": "whatif"}),
        settings=fleet_settings,
    )
    (st,) = wait_finished(fleet_settings, [made.run_id], 60, fleet).values()
    assert st.summary == "what-if answered: what if we refund instead"
    shown = json.loads(redis_client.hget(f"{fleet_settings.redis_key_prefix}:pai-whatif", task))
    assert shown == [
        ["ModelRequest", "UserPromptPart", task, None],
        ["ModelResponse", "ToolCallPart", "", "c0"],
        ["ModelRequest", "ToolReturnPart", "charged wf #0", "c0"],
        ["ModelResponse", "ToolCallPart", "", "c1"],
        ["ModelRequest", "ToolReturnPart", "charged wf #1", "c1"],
        ["ModelRequest", "UserPromptPart", "what if we refund instead", None],
    ]
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1]
