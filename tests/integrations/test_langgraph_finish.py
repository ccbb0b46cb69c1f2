"""A LangGraph thread that ends is a finished run: ``RUN_FINISHED`` with the outcome the graph
ended with, and ``runlog runs`` lists it as finished, not orphaned."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import interrupt
from projections_support import env_for
from workers.common import fold_log, read_log

import runlog
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.integrations.langgraph import RunlogSaver, RunlogToolNode
from runlog.producers._engine import CANCEL_FLAG_FRESH_S
from runlog.projections._run_state import RunState


def _state(settings: Settings, thread: str) -> RunState:
    return fold_log([r.event for r in read_log(settings, thread)])


def _graph(saver: RunlogSaver, script: list[AIMessage], tools: list[Any]) -> Any:
    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        reply = script[turn]
        if isinstance(reply, Exception):
            raise reply
        return {"messages": [FakeMessagesListChatModel(responses=[reply]).invoke([])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", RunlogToolNode(tools, saver))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return saver.finish_when_done(builder.compile(checkpointer=saver))


def _call(name: str, i: int) -> dict[str, Any]:
    return {"name": name, "args": {"n": i}, "id": f"c{i}"}


@tool
def note(n: int) -> str:
    """Write a note."""
    return f"noted {n}"


def test_a_graph_that_ends_finishes_its_run_and_runs_lists_it_finished(
    test_settings: Settings,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = [AIMessage("", tool_calls=[_call("note", 1)]), AIMessage("all noted")]
    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    saver = RunlogSaver(settings=test_settings)
    with saver:
        _graph(saver, script, [note]).invoke({"messages": [HumanMessage("note 1")]}, config)
        st = _state(test_settings, thread)
        assert (st.status, st.outcome, st.summary) == ("finished", "succeeded", "all noted")
        with pytest.raises(runlog.RunFinished):  # a finished run takes no more writes
            _graph(saver, script, [note]).invoke(
                {"messages": [HumanMessage("again")]}, config, durability="sync"
            )
    for k, v in env_for(test_settings).items():
        monkeypatch.setenv(k, v)
    ProjectionRunner(test_settings, redis_client, ("state",)).catch_up(timeout_s=60)
    from runlog.cli import main

    capsys.readouterr()
    assert main(["runs", "--json"]) == 0
    listed = {r["run_id"]: r["status"] for r in json.loads(capsys.readouterr().out)["runs"]}
    assert listed[thread] == "finished"


def test_a_graph_that_raises_finishes_failed(test_settings: Settings) -> None:
    script: list[Any] = [AIMessage("", tool_calls=[_call("note", 1)]), ValueError("model down")]
    thread = f"lg-{uuid.uuid4().hex}"
    with RunlogSaver(settings=test_settings) as saver:
        graph = _graph(saver, script, [note])
        with pytest.raises(ValueError):
            graph.invoke(
                {"messages": [HumanMessage("note 1")]}, {"configurable": {"thread_id": thread}}
            )
    st = _state(test_settings, thread)
    assert (st.status, st.outcome) == ("finished", "failed")
    assert "model down" in st.summary


def test_a_cancelled_graph_finishes_cancelled_before_its_next_call(
    test_settings: Settings,
) -> None:
    thread = f"lg-{uuid.uuid4().hex}"
    ran: list[int] = []

    @tool
    def step(n: int) -> str:
        """A step that a person cancels the run during."""
        ran.append(n)
        runlog.cancel(thread, reason="wrong order", by="ops", settings=test_settings, wait_s=0)
        # An owner sees a cancellation by its next step unless it came within
        # CANCEL_FLAG_FRESH_S of that step (then by the one after): wait that out, so the
        # next call is the one that must not run.
        time.sleep(2 * CANCEL_FLAG_FRESH_S)
        return f"step {n}"

    script = [AIMessage("", tool_calls=[_call("step", 1), _call("step", 2)]), AIMessage("done")]
    with RunlogSaver(settings=test_settings) as saver:
        graph = _graph(saver, script, [step])
        with pytest.raises(runlog.Cancelled):
            graph.invoke(
                {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread}}
            )
    assert ran == [1]
    st = _state(test_settings, thread)
    assert (st.status, st.outcome) == ("finished", "cancelled")


def test_a_graph_that_pauses_is_not_finished(test_settings: Settings) -> None:
    @tool
    def ask(n: int) -> str:
        """Ask a person."""
        return str(interrupt(f"ok {n}?"))

    script = [AIMessage("", tool_calls=[_call("ask", 1)]), AIMessage("asked")]
    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    with RunlogSaver(settings=test_settings) as saver:
        graph = _graph(saver, script, [ask])
        assert "__interrupt__" in graph.invoke({"messages": [HumanMessage("ask")]}, config)
        assert _state(test_settings, thread).status != "finished"
