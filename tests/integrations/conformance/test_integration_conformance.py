"""The same attacks on every framework integration (OpenAI Agents SDK, Pydantic AI, LangGraph):
see ``driver.py``. Each test prints its counts (kills, effects, doubles, losses; ``-s`` shows
them). ``RUNLOG_CONFORMANCE_KILLS`` sets the kill loop's kills per integration (30 here, 500
in ``make soak-integrations``); ``RUNLOG_CONFORMANCE_SEED`` picks the kill points.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from workers.common import read_log, verdicts

from runlog._settings import Settings
from runlog.integrations._openai_agents_session import recorded_ops

from .driver import ADAPTERS, Script, harness, stop_server, total_kills

# How long after its start an execution may be killed: about one whole execution.
WINDOW_S = 1.5
KILLS_PER_RUN = 10

REFUSES_AMBIGUOUS_IDS = {"oai": {"ModelBehaviorError", "MaxTurnsExceeded"}}
"""The Agents SDK refuses a call without an id (``ModelBehaviorError``) and treats a call id
it has already answered as answered (the model is asked again until ``max_turns``)."""


APPROVALS = ("oai", "pai")
"""Integrations with a per-tool approval flag of their framework's own; LangGraph's tool node
has none (its runlog approvals are the escalations of uncertain calls, tested above)."""


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    yield
    stop_server()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_sigkills_at_random_points_leave_every_effect_once_and_none_lost(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    script = Script(steps=4)
    with harness(adapter, fast, redis_client, "kill-loop") as h:
        while h.counts.kills < total_kills():
            run_id = h.new_run()
            kills = min(KILLS_PER_RUN, total_kills() - h.counts.kills)
            h.kill_loop(run_id, script, kills, WINDOW_S)
            h.check(run_id, script)
        assert h.counts.kills >= total_kills()
        assert h.counts.effects == h.counts.runs * script.steps
        assert (h.counts.doubles, h.counts.losses) == (0, 0)


@pytest.mark.timeout(900)
def test_an_agents_sdk_session_holds_under_the_kill_loop(
    fast: Settings, redis_client: redis.Redis
) -> None:
    """``RunlogAgents(session=True)``: the same kill loop, and the session's history (the
    fold of its recorded operations) holds the prompt once and each charge's call and
    output once."""
    script = Script(steps=3, session=True)
    with harness("oai", fast, redis_client, "session-kill-loop") as h:
        while h.counts.kills < total_kills() // 5:
            run_id = h.new_run()
            h.kill_loop(run_id, script, KILLS_PER_RUN, WINDOW_S)
            h.check(run_id, script)
            items = session_items(fast, run_id)
            kinds = [i.get("type", i.get("role")) for i in items]
            assert kinds.count("user") == 1, kinds
            assert kinds.count("function_call") == script.steps, kinds
            assert kinds.count("function_call_output") == script.steps, kinds


def session_items(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    """The session's items as its recorded operations fold them."""
    events = [rec.event for rec in read_log(settings, run_id)]
    items: list[dict[str, Any]] = []
    for op in recorded_ops(valid(events), run_id):
        if op["op"] == "add":
            items.extend(op["items"])
        elif op["op"] == "pop" and items:
            items.pop()
        elif op["op"] == "clear":
            items.clear()
    return items


def valid(events: list[Any]) -> list[Any]:
    return [ev for ev, ok in verdicts(events) if ok]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_run_driven_to_its_end_reads_finished_in_its_log(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    script = Script(steps=2)
    with harness(adapter, fast, redis_client, "finished") as h:
        run_id = h.new_run()
        h.kill_at(run_id, script, "after", 1)
        assert h.run_once(h.spec(run_id, script))["outcome"] == "finished"
        h.check(run_id, script)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_two_resumers_released_together_leave_every_effect_once(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """A run killed after its first charge, then two resumers released from a barrier, each
    willing to wait for the lease: whichever gets it second finds the run further on (or
    finished) and repeats nothing. Three times."""
    script = Script(steps=3)
    with harness(adapter, fast, redis_client, "two-resumers") as h:
        for _ in range(3):
            run_id = h.new_run()
            h.kill_at(run_id, script, "after", 1)
            outcomes = [got["outcome"] for got in h.race(run_id, script, wait_s=15.0)]
            # The second one waits, gives up (locked) or is fenced when it writes on a state
            # the first one moved past; either way it repeats nothing.
            assert set(outcomes) <= {"finished", "locked", "fenced"}, outcomes
            if "finished" not in outcomes:  # both lost their lease on a loaded machine
                assert h.run_once(h.spec(run_id, script))["outcome"] == "finished"
            h.check(run_id, script)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ids", ["repeated", "missing"])
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_repeated_or_missing_call_ids_keep_two_legitimate_charges_apart(
    adapter: str, ids: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """The model names every call ``call_0`` (or gives no id) and asks for the same charge at
    every step: each step's charge is its own effect, once, under kills."""
    script = Script(steps=3, ids=ids, same_args=True)  # type: ignore[arg-type]
    with harness(adapter, fast, redis_client, f"{ids}-ids") as h:
        if adapter in REFUSES_AMBIGUOUS_IDS:
            # The framework itself refuses such a model before any tool runs, with or without
            # runlog; what runlog adds must not change that into a charge.
            run_id = h.new_run()
            got = h.run_once(h.spec(run_id, script), error=True)
            assert got["outcome"] == "error", got
            assert got["error"].split(":")[0] in REFUSES_AMBIGUOUS_IDS[adapter], got
            assert all(n == 1 for n in h.receiver.applied(run_id).values())
            return
        run_id = h.new_run()
        h.kill_at(run_id, script, "after", 1)  # so a recorded turn is replayed
        h.kill_loop(run_id, script, 4, WINDOW_S)
        h.check(run_id, script)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_charge_killed_mid_effect_waits_for_a_person_and_their_decision_holds(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """The charge has no lookup: killed after the receiver applied it (or before), recovery
    cannot know, and the run asks a person. The person decides from the receiver (reject
    what happened, approve a retry of what did not); more kills, more decisions; at the end
    every charge happened once."""
    script = Script(steps=3, lookup=False)
    with harness(adapter, fast, redis_client, "decided") as h:
        for phase in ("after", "before"):
            run_id = h.new_run()
            h.kill_at(run_id, script, phase, 2)
            got = h.run_once(h.spec(run_id, script))
            assert got["outcome"] == "escalated", got  # nothing guessed without a person
            assert h.decide_by_truth(run_id) == 1
            h.kill_loop(run_id, script, 3, WINDOW_S)
            h.check(run_id, script)
        assert h.counts.escalations >= 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", APPROVALS)
def test_an_approval_survives_a_kill_while_waiting_and_each_approved_charge_runs_once(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """The framework's own approval flag (``needs_approval``, ``requires_approval``): the
    execution waiting for the decision is SIGKILLed, a person approves, and the run goes on
    under more kills (each charge asks again); every approved charge runs once."""
    script = Script(steps=2, approval=True)
    with harness(adapter, fast, redis_client, "approval") as h:
        run_id = h.new_run()
        h.kill_while_waiting(run_id, script)
        assert h.receiver.applied(run_id) == {}  # nothing ran before a person decided
        assert h.decide_by_truth(run_id) == 1
        h.kill_loop(run_id, script, 4, WINDOW_S)
        state = h.check(run_id, script)
        assert len(state.approvals) == script.steps
        assert all(a.approved for a in state.approvals.values())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_run_resumed_with_a_changed_agent_definition_replays_its_log_and_repeats_nothing(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """Documented behaviour: replay is positional. A run killed after its second charge,
    resumed by an agent with other instructions and one more tool, gets its recorded turns
    from the log (the charges already made are not made again) and the new definition only
    for the turns the log does not hold."""
    script = Script(steps=3)
    with harness(adapter, fast, redis_client, "changed-definition") as h:
        run_id = h.new_run()
        h.kill_at(run_id, script, "after", 2)
        changed = Script(steps=3, definition="v2")
        assert h.run_once(h.spec(run_id, changed))["outcome"] == "finished"
        h.check(run_id, changed)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_resume_without_the_tool_a_recorded_call_needs_repeats_and_loses_nothing(
    adapter: str, fast: Settings, redis_client: redis.Redis
) -> None:
    """A run killed inside a charge (STARTED, the effect not applied), resumed by a definition
    without the charge tool: whatever that execution does (refused, or stopped by its
    framework), it charges nothing twice and closes no charge; the original definition then
    finishes the run with every charge once."""
    script = Script(steps=3)
    with harness(adapter, fast, redis_client, "tool-removed") as h:
        run_id = h.new_run()
        h.kill_at(run_id, script, "before", 2)
        got = h.run_once(h.spec(run_id, Script(steps=3, definition="v3")), error=True)
        print(f"\n{adapter} resumed without its charge tool: {got['outcome']} {got.get('error')}")
        assert got["outcome"] != "finished", got
        assert all(n == 1 for n in h.receiver.applied(run_id).values())
        assert h.run_once(h.spec(run_id, script))["outcome"] == "finished"
        h.check(run_id, script)
