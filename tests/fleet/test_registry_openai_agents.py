"""An OpenAI Agents SDK agent registered with the fleet: started by name, executed by
`runlog worker`, resumed by another worker after a SIGKILL with every effect once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fleet_support import Fleet, effects, wait_finished

import runlog
from runlog._settings import Settings

AGENTS = "workers.oai_fleet_agents"


@pytest.fixture
def fleet_settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(update={"lease_ttl_ms": 3000})


@pytest.fixture
def fleet(fleet_settings: Settings, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(fleet_settings, tmp_path)
    yield f
    f.stop_all()


def test_a_registered_sdk_agent_killed_mid_run_is_finished_by_another_worker_once(
    fleet_settings: Settings, fleet: Fleet, redis_client: redis.Redis
) -> None:
    first = fleet.spawn(agents=AGENTS)
    rid = runlog.start("oai-billing", "charge three orders", settings=fleet_settings)
    deadline = time.monotonic() + 60
    while not effects(redis_client, fleet_settings):
        assert time.monotonic() < deadline, fleet.tail(first)
        time.sleep(0.02)
    fleet.kill(first)  # inside the first charge: applied, its completion not recorded
    fleet.spawn(agents=AGENTS)
    (st,) = wait_finished(fleet_settings, [rid], 90, fleet).values()
    assert (st.outcome, st.summary) == ("succeeded", "charged 3")
    assert st.agent_name == "oai-billing"
    assert sorted(effects(redis_client, fleet_settings).values()) == [1, 1, 1]
