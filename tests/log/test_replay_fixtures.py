"""Permanent fixtures: every prefix folds to the live state, and old runs resume today."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from confluent_kafka import Producer
from replay_support import FIXTURE_VERSIONS, Fixture, FixtureRecord, load_fixture

import runlog
from runlog._settings import Settings
from runlog.cli import main as cli_main
from runlog.consumers._verify import check_gaps, verify_events, verify_run
from runlog.log._replay import replay
from runlog.producers._tools import tool
from runlog.projections._run_state import RunState, apply, fold
from runlog.schemas._models import ApprovalDecided
from runlog.schemas._signing import generate_key_pair, parse_public_keys
from runlog.schemas._vocabulary import EventType

# Fields a resumption legitimately changes; everything else must be carried over exactly.
RESUME_FIELDS = {"seq", "epoch", "max_epoch_seen", "resumptions", "last_event_at"}


def test_fixtures_exist_for_every_released_version() -> None:
    assert {"v1", "v2", "v3", "v4", "v5", "v6"} <= set(FIXTURE_VERSIONS)


def test_v5_holds_what_a_started_run_of_the_fleet_and_its_operators_write() -> None:
    """v5 (the fleet, operator controls, undo and retry): a start with its code version and
    input, a decision with an answer, a durable timer, a person's cancellation of the
    unowned run (its takeover names the operator), and a cancelled finish."""
    fx = load_fixture("v5")
    written = set(fx.meta["written_versions"])
    assert {
        "run_started v2",
        "run_resumed v2",
        "approval_decided v3",
        "timer_started v1",
        "run_cancel_requested v1",
    } <= written
    events = fx.events()
    first = events[0].payload
    assert (first.code_version, first.input_json) == ("fixture-agent-1.0", '{"order":42}')  # type: ignore[union-attr]
    (decided,) = [e for e in events if e.type is EventType.APPROVAL_DECIDED]
    assert decided.payload.answer == "undo_and_retry"  # type: ignore[union-attr]
    (cancel,) = [e for e in events if e.type is EventType.RUN_CANCEL_REQUESTED]
    took = next(e for e in events if e.seq == cancel.seq - 1 and e.type is EventType.RUN_RESUMED)
    assert took.payload.operator == "bob@example.com"  # type: ignore[union-attr]
    last = fx.states[max(fx.states)]
    assert (last["outcome"], last["cancel"]["requested_by"]) == ("cancelled", "bob@example.com")
    assert last["timers"] and last["agent_version"] == "fixture-agent-1.0"


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_every_prefix_folds_to_the_live_state(version: str) -> None:
    fx = load_fixture(version)
    state = RunState(authority=fx.authority)
    compared = 0
    for i, ev in enumerate(fx.events()):
        before = state.seq
        apply(state, ev)
        if state.seq == before:  # a fenced record: excluded, counted
            assert state.fenced_writes >= 1, f"record {i} rejected without being counted"
            continue
        assert state.to_dict() == fx.states[state.seq], (
            f"{version}: state differs at seq {state.seq}"
        )
        compared += 1
    assert compared == len(fx.states) == state.seq


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_fixture_passes_verification(version: str) -> None:
    fx = load_fixture(version)
    events = fx.events()
    checks = {c.name: c for c in verify_events(events, fx.authority)}
    assert all(c.ok for c in checks.values()), checks
    assert checks["gaps"].counts == {"stale_epoch_duplicate_seq": 1}
    # Every type of the fixture's release (its meta names them): a later release's new
    # type cannot be in an older fixture. A fixture is one started run: a fork's two
    # records begin a run of their own.
    forks = {EventType.RUN_FORKED.value, EventType.FORK_EFFECT_RESOLVED.value}
    assert set(checks["vocabulary"].counts) == set(fx.meta["current_versions"]) - forks
    assert set(fx.meta["current_versions"]) <= {et.value for et in EventType}


def test_a_signed_fixture_decision_counts_only_under_its_deciders_key() -> None:
    """v4's decision is signed (approval_decided v2): trusted keys accept it; other keys make
    it a forgery; no keys accept it unchecked. v1's unsigned decision is a forgery wherever
    keys are trusted."""
    fx = load_fixture("v4")
    events = fx.events()
    (decided,) = [e for e in events if e.type is EventType.APPROVAL_DECIDED]
    assert isinstance(decided.payload, ApprovalDecided)
    assert decided.payload.key_id == "fixture-decider" and decided.payload.signature
    signed = {c.name: c for c in verify_events(events, fx.authority)}["decisions"]
    assert signed.ok and signed.counts == {"signed": 1}
    _, other = generate_key_pair("fixture-decider")  # the same name, another key
    strangers = parse_public_keys(other)
    check = {c.name: c for c in verify_events(events, strangers)}["decisions"]
    assert not check.ok and "not signed by a decider" in check.detail
    st = fold(events, RunState(authority=strangers))
    assert all(a.approved is None for a in st.approvals.values())
    unchecked = {c.name: c for c in verify_events(events)}["decisions"]
    assert unchecked.ok and unchecked.counts == {"unsigned": 1}
    v1 = load_fixture("v1").events()
    assert not {c.name: c for c in verify_events(v1, fx.authority)}["decisions"].ok


def test_verification_can_fail_on_an_unexplained_gap() -> None:
    events = load_fixture("v1").events()
    # Drop one valid event from the middle: the next one's seq no longer follows.
    holed = events[:10] + events[11:]
    gaps = check_gaps(holed)
    assert not gaps.ok and "seq_gap" in gaps.counts


def _produce(settings: Settings, records: list[FixtureRecord]) -> None:
    p = Producer({**settings.kafka_common(), "partitioner": "murmur2_random", "acks": "all"})
    for r in records:
        p.produce(settings.events_topic, key=r.key, value=r.value, headers=list(r.headers))
    assert p.flush(30) == 0


def _tools() -> list[Any]:
    @tool("notify", risk="safe")
    def notify(args: dict[str, Any], *, idempotency_key: str) -> str:
        return f"notified {args['to']} again"

    return [notify]


def _prefix(fx: Fixture, seq: int) -> list[FixtureRecord]:
    """Records up to the valid event with ``seq`` (fenced ones before it included)."""
    out: list[FixtureRecord] = []
    state = RunState(authority=fx.authority)
    for r, ev in zip(fx.records, fx.events(), strict=True):
        out.append(r)
        apply(state, ev)
        if state.seq == seq:
            return out
    raise AssertionError(f"no seq {seq}")


def _carried(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in RESUME_FIELDS}


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_old_runs_resume_under_current_code(
    version: str, test_settings: Settings, redis_client: redis.Redis
) -> None:
    fx = load_fixture(version)
    test_settings = fx.settings(test_settings)
    # The fixture ends with RUN_FINISHED (from v6, then the erasure of its content).
    finish = next(r.seq for r in reversed(fx.records) if r.type == "run_finished")
    before_finish = finish - 1
    _produce(test_settings, _prefix(fx, before_finish))

    with runlog.open_run(
        fx.run_id, tenant=fx.tenant, settings=test_settings, tools=_tools()
    ) as run:
        got = run.state.to_dict()
        assert run.state.seq == before_finish + 1
        assert run.state.status == "running"
        assert run.state.epoch > fx.states[before_finish]["max_epoch_seen"]  # floor raised
    assert _carried(got) == _carried(fx.states[before_finish])
    assert got["resumptions"] == fx.states[before_finish]["resumptions"] + 1

    result = replay(test_settings, redis_client, fx.run_id, tenant=fx.tenant)
    assert result.state.to_dict() == got
    assert result.source == "time"  # raw records, no start index: the run id's time


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_old_run_crashed_mid_tool_call_recovers_under_current_code(
    version: str, test_settings: Settings
) -> None:
    fx = load_fixture(version)
    # Owner 1 died right after a TOOL_CALL_STARTED: the last seq before the first takeover.
    crash = next(r.seq for r in fx.records if r.type == "run_resumed") - 1
    assert fx.states[crash]["open_calls"], "fixture should end owner 1 mid-tool-call"
    _produce(test_settings, _prefix(fx, crash))
    open_key = next(iter(fx.states[crash]["open_calls"]))
    with runlog.open_run(
        fx.run_id, tenant=fx.tenant, settings=test_settings, tools=_tools()
    ) as run:
        assert run.state.completed_calls[open_key] == "notified customer again"
        assert not run.state.open_calls
        # Everything the old run knew is still there, in the same order.
        n = len(fx.states[crash]["messages"])
        assert run.state.to_dict()["messages"][:n] == fx.states[crash]["messages"]


def test_time_travel_and_cli(
    test_settings: Settings,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fx = load_fixture("v1")
    _produce(test_settings, fx.records)
    for seq in (1, 18, 27, 33, max(fx.states)):
        r = replay(test_settings, redis_client, fx.run_id, tenant=fx.tenant, to_seq=seq)
        assert r.state.to_dict() == fx.states[seq], seq

    monkeypatch.setenv("RUNLOG_TOPIC_PREFIX", test_settings.topic_prefix)
    monkeypatch.setenv("RUNLOG_REDIS_KEY_PREFIX", test_settings.redis_key_prefix)
    monkeypatch.setenv("RUNLOG_PARTITIONS", str(test_settings.partitions))
    assert cli_main(["replay", fx.run_id, "--tenant", fx.tenant, "--to-seq", "18", "--json"]) == 0
    assert '"compactions": 1' in capsys.readouterr().out
    assert cli_main(["verify", fx.run_id, "--tenant", fx.tenant]) == 0
    assert cli_main(["verify", "--all"]) == 0
    out = capsys.readouterr().out
    assert "verified 1 run(s): 0 failed" in out

    report = verify_run(test_settings, redis_client, fx.run_id, tenant="wrong-tenant")
    assert not report.ok
    assert cli_main(["verify", fx.run_id, "--tenant", "wrong-tenant"]) == 4  # not found
