"""Effects that happened are recorded whatever they returned; finishing is idempotent.

Each test kills a real worker process (SIGKILL) at a flag and resumes the run in a new
one, against the real Kafka and Redis; effects are counted in the Redis ledger.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import redis
from confluent_kafka import KafkaError
from workers.common import (
    EFFECTS_WORKER,
    EXIT_FINISHED,
    EXIT_OK,
    Ledger,
    Worker,
    assert_log_sound,
    payloads,
    read_log,
    services_for,
    start_worker,
    times_out_first,
    valid_types,
)
from workers.effects_worker import result_text

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._handle import engine_of
from runlog.producers._writer import DeliveryFailed
from runlog.schemas import _models as m
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

CUT = re.compile(r"\[runlog: cut (\d+) of (\d+) bytes; sha256 ([0-9a-f]{64}) of the whole text")


# An effects_worker.py process (same harness as agent_worker.py's).
start = functools.partial(start_worker, script=EFFECTS_WORKER)


def _events(settings: Settings, run_id: str) -> list[m.Event]:
    return [r.event for r in read_log(settings, run_id)]


def _ok(code: int, result: dict[str, object], expected: int = EXIT_OK) -> None:
    assert code == expected, f"exit {code}: {result.get('_stdout')}\n{result.get('_stderr')}"


def _kill_at(worker: Worker, flag: str, timeout: float = 30.0) -> None:
    """SIGKILL ``worker`` once it reaches ``flag``; if it dies on its own first, the test
    goes on with what it left in the log (the point is what the next owner does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.flag(flag).exists():
            worker.kill()
            return
        if worker.proc.poll() is not None:
            worker.proc.communicate()
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {worker.name} did not reach {flag!r} in {timeout}s")


def _whole(kind: str) -> bytes:
    return result_text(kind).encode("utf-8", "surrogatepass")


def _assert_cut(content: str, kind: str) -> None:
    whole = _whole(kind)
    if kind == "surrogate":
        # Small enough to keep whole: only the lone surrogate is escaped.
        assert content == "receipt \\ud800 with a lone surrogate"
        return
    found = CUT.search(content)
    assert found, f"no cut marker in the completion: {content[-300:]!r}"
    cut, total, digest = int(found[1]), int(found[2]), found[3]
    assert total == len(whole) and digest == hashlib.sha256(whole).hexdigest()
    kept = content[: found.start()].rstrip("\n").encode()
    assert cut == total - len(kept) and whole.startswith(kept)


@pytest.mark.parametrize("kind", ["large", "surrogate"])
def test_a_large_or_unencodable_result_is_recorded_once_and_never_rerun(
    kind: str, fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    """Live path: the completion of a 2 MB / lone-surrogate result is recorded (cut or
    escaped, with digest and length); the worker is killed after it and re-executed from
    the top: the fetch is not run again."""
    rid = new_run_id()
    args = ["--run-id", rid, "--result", kind, "--sink", "--risk", "safe"]
    first = start(fast, tmp_path, "first", *args, "--hold-after")
    _kill_at(first, "after-calls")
    assert ledger.total() == 1

    second = start(fast, tmp_path, "second", *args)
    code, result = second.finish()
    assert ledger.total() == 1, f"the resumed run fetched again: {ledger.per_key()}"
    _ok(code, result)
    events = _events(fast, rid)
    assert_log_sound(events)
    (done,) = payloads(events, EventType.TOOL_CALL_COMPLETED)
    assert done.source == "live" and not done.is_error
    _assert_cut(done.content, kind)
    if kind == "large":
        # The sink kept the whole result where the marker says.
        (key,) = ledger.per_key()
        assert f"kept at redis:{fast.redis_key_prefix}:blob:{key}" in done.content
        assert redis_client.get(f"{fast.redis_key_prefix}:blob:{key}") == _whole(kind)
    assert valid_types(events)[-1] == "run_finished"


@pytest.mark.parametrize("kind", ["large", "surrogate"])
def test_a_reconciled_large_or_unencodable_result_completes_the_call(
    kind: str, fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    """Recovery path: killed after the effect, before its completion; the lookup's Match
    carries the same 2 MB / lone-surrogate text and completes the call once."""
    rid = new_run_id()
    # Irreversible: its STARTED is durable before the tool runs (a safe call's is pipelined,
    # and a safe call whose STARTED was lost is simply run again).
    args = ["--run-id", rid, "--result", kind, "--reconcile", "ledger", "--risk", "irreversible"]
    first = start(fast, tmp_path, "first", *args, "--mode", "block-after")
    _kill_at(first, "effect")

    second = start(fast, tmp_path, "second", *args)
    code, result = second.finish()
    _ok(code, result)
    assert ledger.total() == 1
    events = _events(fast, rid)
    assert_log_sound(events)
    (done,) = payloads(events, EventType.TOOL_CALL_COMPLETED)
    assert done.source == "reconciliation"
    _assert_cut(done.content, kind)
    assert result["status"] == "finished"


def test_finish_after_a_kill_just_after_run_finished_returns_the_recorded_event(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    """The README's worker shape (calls, then finish) killed just after its RUN_FINISHED
    was acknowledged, re-executed from the top: same outcome returns the recorded event;
    another outcome raises RunFinished. Nothing is appended either way."""
    rid = new_run_id()
    first = start(fast, tmp_path, "first", "--run-id", rid, "--scenario", "finish", "--hold-after")
    recorded = json.loads(first.wait_flag("finished"))
    first.kill()
    before = _events(fast, rid)

    again = start(fast, tmp_path, "again", "--run-id", rid, "--scenario", "finish")
    code, result = again.finish()
    _ok(code, result)
    assert json.loads((tmp_path / "again.finished").read_text()) == recorded
    other = start(
        fast, tmp_path, "other", "--run-id", rid, "--scenario", "finish", "--outcome", "failed"
    )
    code, result = other.finish()
    _ok(code, result, EXIT_FINISHED)
    assert result["outcome_recorded"] == "succeeded"
    assert _events(fast, rid) == before
    assert ledger.total() == 1


def test_a_guardrail_trip_is_recorded_once_when_the_worker_dies_before_its_model_turn(
    fast: Settings, tmp_path: Path
) -> None:
    rid = new_run_id()
    first = start(
        fast, tmp_path, "first", "--run-id", rid, "--scenario", "guardrail", "--hold-after"
    )
    first.wait_flag("guardrail-recorded")
    first.kill()
    second = start(fast, tmp_path, "second", "--run-id", rid, "--scenario", "guardrail")
    code, result = second.finish()
    _ok(code, result)
    events = _events(fast, rid)
    assert_log_sound(events)
    trips = payloads(events, EventType.GUARDRAIL_TRIGGERED)
    assert [(t.guardrail, t.detail) for t in trips] == [("secrets", "model mentioned a password")]
    types = valid_types(events)
    assert types.index("guardrail_triggered") < types.index("model_turn")
    assert types[-1] == "run_finished"


def test_a_retry_records_the_operation_id_of_its_first_attempt(
    fast: Settings, ledger: Ledger
) -> None:
    sync, _ = times_out_first("sync", 1, "synced")
    with runlog.open_run(settings=fast, tools=[sync]) as run:
        assert run.call_tool("sync", {"n": 1}, operation_id="order-42") == "synced"
        rid = run.run_id
    started = payloads(_events(fast, rid), EventType.TOOL_CALL_STARTED)
    assert [(p.attempt, p.operation_id) for p in started] == [(1, "order-42"), (2, "order-42")]


def test_a_fatal_producer_error_replaces_the_producer_and_inflight_appends_are_unknown(
    fast: Settings,
) -> None:
    """SIMULATED: librdkafka offers Python no way to force a real fatal idempotence error,
    so the test delivers a fatal ``KafkaError`` to the writer's ``error_cb`` (the entry
    librdkafka itself calls). What is real: the old producer still holds an append that
    cannot complete (its topic does not exist), and every later append goes to the broker."""
    writer = Services.shared(fast).writer
    stuck = writer.send(f"{fast.topic_prefix}.no-such-topic", b"k", b"v", [])
    with runlog.open_run(settings=fast) as a:
        a.append(EventType.USER_MESSAGE, content="before")
        writer._on_error(KafkaError(KafkaError._FATAL, "simulated fatal error", fatal=True))
        with pytest.raises(DeliveryFailed) as lost:
            stuck.result(timeout=10)
        assert lost.value.unknown, "an append in flight at a fatal error may have been written"
        a.append(EventType.USER_MESSAGE, content="after")  # the same process goes on
        rid = a.run_id
    with runlog.open_run(settings=fast) as b:
        b.append(EventType.USER_MESSAGE, content="a new run")
    assert writer.replaced == 1
    contents = [p.content for p in payloads(_events(fast, rid), EventType.USER_MESSAGE)]
    assert contents == ["before", "after"]


def test_finish_is_idempotent_when_the_run_resumes_from_a_snapshot(
    test_settings: Settings,
) -> None:
    """A snapshot taken at RUN_FINISHED holds no events; the recorded finish is then read
    from the log, not appended again."""
    snap = test_settings.model_copy(update={"snapshot_interval": 1})
    with services_for(snap):
        with runlog.open_run(settings=snap) as run:
            run.append(EventType.USER_MESSAGE, content="hello")
            first = run.finish("succeeded", "done")
            rid = run.run_id
        with runlog.open_run(rid, settings=snap) as again:
            assert engine_of(again).since_turn is None, "expected a resumption from the snapshot"
            assert again.finish("succeeded").event_id == first.event_id
            with pytest.raises(runlog.RunFinished):
                again.finish("failed")
    assert valid_types(_events(snap, rid)) == ["run_started", "user_message", "run_finished"]
