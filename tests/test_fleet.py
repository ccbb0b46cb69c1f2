"""The worker fleet on the real stack: `runlog worker` processes, SIGKILLed at random.

Runs are started with `runlog.start` (a durable request); workers dispatched by Kafka's
consumer group execute them, resume the orphans of the dead, wake sleeping runs and the
runs a person decided. Effects land on a non-idempotent receiver (tests/workers/
fleet_agents.py) that counts each key: every count must be 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, effects, wait_finished

import runlog
from runlog.settings import Settings


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Fleet:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def test_a_started_run_is_executed_and_finishes_with_the_summary(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.spawn()
    rid = runlog.start("payer", {"to": "acme", "steps": 3}, tenant="t1", settings=fleet_settings)
    (st,) = wait_finished(fleet_settings, [rid], 60, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "paid 3 times")
    assert st.agent_name == "payer" and st.agent_version and st.agent_input
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1, 1]
