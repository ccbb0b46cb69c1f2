"""A LangGraph graph with runlog's tool node and checkpointer, SIGKILLed at every tool call
and resumed: every effect lands once on a receiver that does not deduplicate."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from workers.common import ROOT, Worker, fold_log, read_log, worker_env
from workers.lg_worker import AMOUNTS, EXIT_FENCED, effects_key

import runlog
from runlog._settings import Settings
from runlog.integrations.langgraph import RunlogSaver
from runlog.projections._run_state import RunState
from runlog.schemas._vocabulary import EventType

LG_WORKER = Path(__file__).resolve().parents[1] / "workers" / "lg_worker.py"


def state_of(settings: Settings, thread: str) -> RunState:
    """The thread's run as its log folds."""
    return fold_log([r.event for r in read_log(settings, thread)])


def start(settings: Settings, tmp: Path, name: str, thread: str, *args: str) -> Worker:
    cmd = [sys.executable, str(LG_WORKER), "--dir", str(tmp), "--name", name, "--thread", thread]
    proc = subprocess.Popen(
        [*cmd, *args],
        env=worker_env(settings),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Worker(proc, tmp, name)


@pytest.mark.parametrize("hold_at", ["node", "before", "after"])
def test_killed_at_every_tool_call_each_effect_once(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path, hold_at: str
) -> None:
    """Killed at each tool call: in the tool node after the step's checkpoint is durable and
    before the call's STARTED (``node``: nothing of the call is recorded, the resumed node
    makes it), after its STARTED is durable and before the effect
    (``before``: the lookup finds nothing, the call is retried with its key), or right after
    the effect landed and before its completion was recorded (``after``: the lookup finds
    it, the call completes from the evidence)."""
    thread = f"lg-{uuid.uuid4().hex}"
    prefix = test_settings.redis_key_prefix
    hold = ("--hold-s", "30", "--hold-at", hold_at, "--takeover")
    for i, amount in enumerate(AMOUNTS):
        w = start(test_settings, tmp_path, f"w{i}", thread, *hold, "--hold-amount", str(amount))
        w.wait_flag(f"at-{amount}", timeout=60)
        w.kill()
        assert w.proc.returncode == -signal.SIGKILL
    last = start(test_settings, tmp_path, "last", thread, "--hold-at", hold_at, "--takeover")
    rc, result = last.finish(timeout=90)
    assert rc == 0, result["_stderr"][-4000:]
    assert result["answer"] == "done: moved 6"
    for amount in AMOUNTS:
        assert redis_client.get(effects_key(prefix, amount)) == b"1", amount
    if hold_at == "after":  # every effect was found by the lookup: none ran again
        assert not list(tmp_path.glob("last.ran-*"))
    elif hold_at == "node":  # killed before each STARTED: the resumed node runs the call
        ran = sorted(p.name for p in tmp_path.glob("*.ran-*"))
        assert ran == ["last.ran-2", "last.ran-3", "w1.ran-1"]
    else:  # each resumed worker retried the call it was killed in, with its key
        assert [p.name for p in tmp_path.glob("last.ran-*")] == ["last.ran-3"]
    # The thread's history, read back from the log by a fresh saver, has each tool result once.
    with RunlogSaver(settings=test_settings) as reader:
        tup = reader.get_tuple({"configurable": {"thread_id": thread}})
    assert tup is not None
    messages = tup.checkpoint["channel_values"]["messages"]
    tool_results = [m.content for m in messages if m.type == "tool"]
    assert tool_results == ["moved 1", "moved 2", "moved 3"]


def test_an_uncertain_irreversible_call_without_a_lookup_asks_a_person_not_rerun(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Escalated, the call reaches the graph as a LangGraph interrupt carrying runlog's
    question (tool, arguments, key, evidence, what each answer does); the graph pauses and
    the tool is not run again. A ``Command(resume=...)`` rejecting it is recorded as the
    person's decision: the call is closed, never run again."""
    thread = f"lg-{uuid.uuid4().hex}"
    hold = ("--hold-s", "30", "--hold-amount", "1", "--no-reconcile", "--takeover")
    w = start(test_settings, tmp_path, "w0", thread, *hold)
    w.wait_flag("at-1", timeout=60)
    w.kill()
    again = start(test_settings, tmp_path, "again", thread, "--no-reconcile", "--takeover")
    rc, result = again.finish(timeout=90)
    assert rc == 0, result["_stderr"][-4000:]
    (asked,) = result["interrupted"]
    assert asked["runlog"] == "approval" and asked["kind"] == "uncertain_call"
    assert asked["tool"] == "transfer" and json.loads(asked["args_json"]) == {"amount": 1}
    assert asked["idempotency_key"] == w.flag("at-1").read_text()
    assert asked["approve"] and asked["reject"] and asked["attempts"]
    assert set(asked["answers"]) == {"approve", "reject", "undo_and_retry"}
    assert redis_client.get(effects_key(test_settings.redis_key_prefix, 1)) == b"1"
    assert not list(tmp_path.glob("again.ran-*"))  # not re-run blindly
    no = start(test_settings, tmp_path, "no", thread, "--no-reconcile", "--takeover",
               "--answer", "reject")  # fmt: skip
    rc, result = no.finish(timeout=90)
    assert rc == 0, result["_stderr"][-4000:]
    assert redis_client.get(effects_key(test_settings.redis_key_prefix, 1)) == b"1"
    assert not list(tmp_path.glob("no.ran-1"))
    decided = [
        ev.payload
        for ev in (r.event for r in read_log(test_settings, thread))
        if ev.type is EventType.APPROVAL_DECIDED
    ]
    assert [(d.approved, d.decided_by) for d in decided] == [(False, "ops@worker")]
    st = state_of(test_settings, thread)
    assert not st.open_calls and not st.pending_approvals


def test_two_resumers_released_together_refund_once(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two processes resume one thread (``invoke(None)``) at once, each with ``wait_s``: both
    read the same checkpoint and run the model, whose tool-call ids are fresh each time. The
    one that writes second writes on a checkpoint the other has moved past: it is fenced, so
    no transfer runs twice."""
    thread = f"lg-{uuid.uuid4().hex}"
    setup = start(test_settings, tmp_path, "setup", thread, "--setup")
    rc, result = setup.finish(timeout=60)
    assert rc == 0, result["_stderr"][-4000:]
    go = tmp_path / "go"
    args = ("--go-file", str(go), "--fresh-ids", "--wait-s", "30")
    resumers = [start(test_settings, tmp_path, f"r{i}", thread, *args) for i in range(2)]
    for r in resumers:
        r.wait_flag("ready", timeout=60)
    go.write_text("")  # the barrier: both resume now
    outcomes = [r.finish(timeout=120) for r in resumers]
    codes = [rc for rc, _ in outcomes]
    began = [(tmp_path / f"r{i}.read").read_text() for i in range(2)]
    for amount in AMOUNTS:
        assert redis_client.get(effects_key(test_settings.redis_key_prefix, amount)) == b"1"
    with RunlogSaver(settings=test_settings) as reader:
        tup = reader.get_tuple({"configurable": {"thread_id": thread}})
    assert tup is not None
    # One resumer's graph moves the thread to its end. The other's began from a checkpoint
    # that one moved past (both from the first, when they raced): it is fenced at its first
    # write. On a loaded machine it may begin only after the thread ended (its graph reads
    # the final checkpoint and has nothing to do): then it ends well.
    final = str(tup.config["configurable"]["checkpoint_id"])
    why = (began, final, [o[1]["_stderr"][-3000:] for o in outcomes])
    assert sorted(codes) in ([0, 0], [0, EXIT_FENCED]), why
    movers = [i for i in range(2) if codes[i] == 0 and began[i] != final]
    assert len(movers) == 1, why
    (other,) = {0, 1} - set(movers)
    assert codes[other] == (0 if began[other] == final else EXIT_FENCED), why
    messages = tup.checkpoint["channel_values"]["messages"]
    assert [m.content for m in messages if m.type == "tool"] == ["moved 1", "moved 2", "moved 3"]


@pytest.mark.parametrize("settle", ["lookup", "runlog-decide", "graph-resume"])
def test_a_tool_that_asks_a_person_killed_after_its_start_moves_money_once(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path, settle: str
) -> None:
    """The transfer asks a person with ``interrupt()`` before it moves money. Killed after its
    STARTED and before it asked: the resumed graph asks (the call is settled in the node,
    where the tool may pause the graph; its pause made no effect), and once the person
    approves, the money moves once. Without a lookup the uncertain call goes to a person
    first: the graph asks runlog's question, answered by ``runlog.decide`` (what ``runlog
    approve`` does) beside the graph, or by ``Command(resume=...)``; the approval is not used
    up by the tool's question."""
    thread = f"lg-{uuid.uuid4().hex}"
    prefix = test_settings.redis_key_prefix
    ask = ("--ask", "--takeover", *(() if settle == "lookup" else ("--no-reconcile",)))
    w = start(test_settings, tmp_path, "w0", thread, *ask, "--hold-s", "30", "--hold-at",
              "before", "--hold-amount", "1")  # fmt: skip
    w.wait_flag("at-1", timeout=60)
    w.kill()
    if settle != "lookup":  # runlog's question reaches the graph
        rc, result = start(test_settings, tmp_path, "w1", thread, *ask).finish(timeout=90)
        assert rc == 0, result["_stderr"][-4000:]
        assert [q["runlog"] for q in result["interrupted"]] == ["approval"]
        pending = state_of(test_settings, thread).pending_approvals
        assert len(pending) == 1
        (approval_id,) = pending
    if settle == "runlog-decide":
        runlog.decide(thread, approval_id, approved=True, decided_by="ops", settings=test_settings)
    if settle != "graph-resume":
        rc, result = start(test_settings, tmp_path, "w2", thread, *ask).finish(timeout=90)
        assert rc == 0, result["_stderr"][-4000:]
        assert [q["transfer"] for q in result["interrupted"]] == [1]  # the tool asks
        assert redis_client.get(effects_key(prefix, 1)) is None
    last = start(test_settings, tmp_path, "w3", thread, *ask, "--answer", "approve")
    rc, result = last.finish(timeout=120)
    assert rc == 0, result["_stderr"][-4000:]
    assert result["answer"] == "done: moved 6"
    for amount in AMOUNTS:
        assert redis_client.get(effects_key(prefix, amount)) == b"1", amount
    st = state_of(test_settings, thread)
    assert st.status != "escalated" and not st.open_calls and not st.pending_approvals
    if settle != "lookup":  # one decision, by whoever answered first
        (decision,) = [a for a in st.approvals.values() if a.approved is not None]
        assert decision.decided_by == ("ops" if settle == "runlog-decide" else "ops@worker")


def test_a_resumer_whose_graph_renamed_the_tool_node_neither_repeats_nor_claims_success(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A changed graph definition: killed inside a transfer, the thread is resumed by a graph
    whose tool node has another name. LangGraph cannot reach the old node's pending step, so
    the graph ends there; the transfer is not made again, and the run is not recorded as
    succeeded: it stays open with its uncertain call, for a person or the old graph."""
    thread = f"lg-{uuid.uuid4().hex}"
    prefix = test_settings.redis_key_prefix
    w = start(test_settings, tmp_path, "w0", thread, "--hold-s", "30", "--hold-amount", "1",
              "--hold-at", "before", "--takeover")  # fmt: skip
    w.wait_flag("at-1", timeout=60)
    w.kill()
    changed = start(test_settings, tmp_path, "changed", thread, "--tool-node", "act",
                    "--takeover", "--finish")  # fmt: skip
    rc, result = changed.finish(timeout=90)
    assert rc == 0, result["_stderr"][-4000:]
    assert redis_client.get(effects_key(prefix, 1)) is None  # not run by the changed graph
    st = state_of(test_settings, thread)
    assert st.status != "finished" and len(st.open_calls) == 1
    # The graph that started it settles it: the lookup finds nothing, the call runs once.
    last = start(test_settings, tmp_path, "last", thread, "--takeover", "--finish")
    rc, result = last.finish(timeout=90)
    assert rc == 0, result["_stderr"][-4000:]
    assert result["answer"] == "done: moved 6"
    for amount in AMOUNTS:
        assert redis_client.get(effects_key(prefix, amount)) == b"1", amount
    st = state_of(test_settings, thread)
    assert (st.status, st.outcome) == ("finished", "succeeded") and not st.open_calls
