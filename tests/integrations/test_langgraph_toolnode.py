"""runlog's tool node in a LangGraph graph on the real stack: a node re-executed after
``interrupt()``/resume returns the recorded result instead of repeating the effect."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

import runlog
from runlog import current_call
from runlog._settings import Settings
from runlog.integrations.langgraph import PAUSED_KEY, RunlogSaver, RunlogToolNode
from runlog.producers._calls import execute_logical
from runlog.producers._handle import engine_of
from runlog.producers._ops import drive
from runlog.schemas._canonical import canonical_json
from runlog.schemas._models import MemoryWritten

SCRIPT = [
    AIMessage(
        content="",
        tool_calls=[
            {"name": "transfer", "args": {"amount": 5}, "id": "c-transfer"},
            {"name": "confirm", "args": {"question": "ok?"}, "id": "c-confirm"},
        ],
    ),
    AIMessage(content="done"),
]


def _one_message(*calls: tuple[str, dict[str, Any], str]) -> list[AIMessage]:
    """A model's turns: one AI message with these tool calls (name, arguments, id), then
    its answer."""
    asked = [{"name": name, "args": args, "id": call_id} for name, args, call_id in calls]
    return [AIMessage(content="", tool_calls=asked), AIMessage(content="done")]


def _asking_pay(ledger: Path) -> Any:
    """A tool that pays once a person said from which account (a line of ``ledger``)."""

    @tool
    def pay(amount: int) -> str:
        """Pay, once a person said from which account."""
        account = interrupt(f"account for {amount}?")
        with ledger.open("a") as f:
            f.write(f"{amount} from {account}\n")
        return f"paid {amount} from {account}"

    return pay


def _tool_loop(saver: RunlogSaver, script: list[AIMessage], tools: list[Any], **node: Any) -> Any:
    """LangGraph's tool-calling loop, compiled with ``saver``: an agent node answering turn
    by turn from ``script`` and runlog's tool node with ``tools`` (``node``: its options)."""

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        return {"messages": [FakeMessagesListChatModel(responses=[script[turn]]).invoke([])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", RunlogToolNode(tools, saver, **node))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=saver)


def test_node_reexecuted_after_interrupt_does_not_repeat_the_effect(
    test_settings: Settings,
) -> None:
    received: list[str] = []  # the receiver: it does not deduplicate

    @tool
    def transfer(amount: int) -> str:
        """Move money."""
        call = current_call()
        assert call is not None  # the key reaches the tool
        received.append(call.idempotency_key)
        return f"moved {amount}"

    @tool
    def confirm(question: str) -> str:
        """Ask a person."""
        return str(interrupt(question))

    saver = RunlogSaver(settings=test_settings)
    graph = _tool_loop(saver, SCRIPT, [transfer, confirm], risk={"transfer": "irreversible"})
    config: Any = {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}
    with saver:
        first = graph.invoke({"messages": [HumanMessage("pay 5")]}, config)
        assert "__interrupt__" in first
        assert len(received) == 1
        final = graph.invoke(Command(resume="yes"), config)
    assert len(received) == 1  # the re-executed node got the recorded result
    tool_results = {m.name: m.content for m in final["messages"] if m.type == "tool"}
    assert tool_results == {"transfer": "moved 5", "confirm": "yes"}
    assert final["messages"][-1].content == "done"


def _charge_graph(saver: RunlogSaver, script: list[AIMessage], received: list[str]) -> Any:
    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        call = current_call()
        assert call is not None
        received.append(call.idempotency_key)
        return f"charge #{len(received)}"

    return _tool_loop(saver, script, [charge], risk={"charge": "irreversible"})


@pytest.mark.parametrize("call_id", ["call_0", None])
def test_repeated_or_missing_tool_call_ids_never_share_a_key(
    test_settings: Settings, call_id: str | None
) -> None:
    """A model that reuses one tool-call id at every step, or gives none: two charges of one
    step and the charges of two steps are each an action of their own."""
    seven = {"name": "charge", "args": {"amount": 7}, "id": call_id}
    script = [
        AIMessage(content="", tool_calls=[seven]),
        AIMessage(content="", tool_calls=[seven, seven]),
        AIMessage(content="charged three times"),
    ]
    received: list[str] = []
    saver = RunlogSaver(settings=test_settings)
    graph = _charge_graph(saver, script, received)
    config: Any = {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}
    with saver:
        final = graph.invoke({"messages": [HumanMessage("charge 7, then 7 twice")]}, config)
    assert len(received) == len(set(received)) == 3
    results = [m.content for m in final["messages"] if m.type == "tool"]
    assert results == ["charge #1", "charge #2", "charge #3"]


def test_a_run_keyed_by_tool_call_id_keeps_its_keys(test_settings: Settings) -> None:
    """A thread whose log already holds a call keyed by the model's tool-call id (how the
    tool node keyed calls before the step was part of the key) keeps that key: the call it
    completed is not run again when the node re-executes."""
    call = {"name": "charge", "args": {"amount": 7}, "id": "c-1"}
    script = [AIMessage(content="", tool_calls=[call]), AIMessage(content="done")]
    received: list[str] = []
    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    saver = RunlogSaver(settings=test_settings)
    graph = _charge_graph(saver, script, received)
    stop = graph.builder.compile(checkpointer=saver, interrupt_before=["tools"])
    with saver:
        stop.invoke({"messages": [HumanMessage("charge 7")]}, config)
        # The call as the earlier tool node ran it, before its node's writes were saved.
        run = engine_of(saver.run_for(thread))
        old_scope = f"{thread}:langgraph:c-1"
        args_json = canonical_json({"amount": 7})
        key = run.idempotency_key(old_scope, "charge", args_json, 0)
        done = drive(
            run,
            execute_logical(
                run, run.tools["charge"], args_json, key, call_id="c-1", operation_id=old_scope
            ),
        )
        assert received == [key] and done == "charge #1"
    with RunlogSaver(settings=test_settings) as again:
        final = _charge_graph(again, script, received).invoke(None, config)
    assert received == [key]  # answered from the record, not charged again
    assert [m.content for m in final["messages"] if m.type == "tool"] == ["charge #1"]


def test_two_calls_that_each_ask_a_person_get_their_own_answers(
    test_settings: Settings,
) -> None:
    """Two calls of one AI message each ask with ``interrupt()``: the node is re-executed once
    per answer, and LangGraph hands a node's answers to its ``interrupt()`` calls by order, so
    the call answered first must not take the second call's answer when it is not run again."""
    moved: list[str] = []

    @tool
    def pay(amount: int) -> str:
        """Pay, once a person said which account."""
        account = interrupt(f"from which account do we pay {amount}?")
        moved.append(f"{amount} from {account}")
        return f"paid {amount} from {account}"

    script = _one_message(("pay", {"amount": 5}, "c-5"), ("pay", {"amount": 7}, "c-7"))

    saver = RunlogSaver(settings=test_settings)
    graph = _tool_loop(saver, script, [pay], risk={"pay": "irreversible"})
    config: Any = {"configurable": {"thread_id": f"lg-{uuid.uuid4().hex}"}}
    with saver:
        state = graph.invoke({"messages": [HumanMessage("pay 5 and 7")]}, config)
        (first,) = state["__interrupt__"]
        state = graph.invoke(Command(resume={first.id: "savings"}), config)
        (second,) = state["__interrupt__"]
        assert second.value == "from which account do we pay 7?"
        final = graph.invoke(Command(resume={second.id: "checking"}), config)
    assert moved == ["5 from savings", "7 from checking"]
    assert [m.content for m in final["messages"] if m.type == "tool"] == [
        "paid 5 from savings",
        "paid 7 from checking",
    ]


# Three calls of one AI message that ask a person a different number of times ------------
THREE_CALLS = _one_message(
    ("pay", {"amount": 5}, "c-5"),
    ("balance", {"account": "savings"}, "c-b"),
    ("pay", {"amount": 7}, "c-7"),
)


def _three_calls_graph(saver: RunlogSaver, ledger: Path) -> Any:
    """The first call asks twice, the second not at all, the third once; each effect is a
    line of ``ledger`` (shared by the processes of a test)."""

    @tool
    def pay(amount: int) -> str:
        """Pay, once a person said from which account (and, for 5, with which memo)."""
        account = interrupt(f"account for {amount}?")
        memo = interrupt(f"memo for {amount}?") if amount == 5 else "-"
        with ledger.open("a") as f:
            f.write(f"{amount} from {account} memo {memo}\n")
        return f"paid {amount}"

    @tool
    def balance(account: str) -> str:
        """Look up a balance."""
        with ledger.open("a") as f:
            f.write(f"balance of {account}\n")
        return "100"

    return _tool_loop(saver, THREE_CALLS, [pay, balance], risk={"pay": "irreversible"})


def _killed_after_noting_the_first_pause(
    settings_dump: dict[str, Any], thread: str, ledger: str
) -> None:
    """A process that starts the thread and is SIGKILLed right after the tool node noted the
    first pause, before LangGraph saved the interrupt."""
    original = RunlogSaver.note_paused

    def note_then_die(self: RunlogSaver, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    RunlogSaver.note_paused = note_then_die  # type: ignore[method-assign]
    saver = RunlogSaver(settings=Settings(**settings_dump))
    config: Any = {"configurable": {"thread_id": thread}}
    _three_calls_graph(saver, Path(ledger)).invoke({"messages": [HumanMessage("pay")]}, config)


def test_answers_reach_their_own_questions_across_processes_and_a_kill_after_a_pause(
    test_settings: Settings, tmp_path: Path
) -> None:
    """A process is killed right after the node noted the first pause and before LangGraph
    saved it; the thread is resumed (``invoke(None)``) and each answer is then given to a
    fresh saver (a new process reading the thread's log). The first pause is noted twice,
    yet counted once: every answer reaches its own question and each payment is made once."""
    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    ledger = tmp_path / "ledger"
    child = mp.get_context("spawn").Process(
        target=_killed_after_noting_the_first_pause,
        args=(test_settings.model_dump(), thread, str(ledger)),
    )
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL

    def saver() -> RunlogSaver:
        return RunlogSaver(settings=test_settings, wait_s=30)  # the dead owner's lease

    with saver() as s:
        state = _three_calls_graph(s, ledger).invoke(None, config)
        notes = [
            json.loads(ev.payload.value)
            for ev in s._events(thread)
            if isinstance(ev.payload, MemoryWritten) and ev.payload.key == PAUSED_KEY
        ]
    # Noted by the killed process and again by the node that re-executed the step: the same
    # interrupt of the same task (counted once), or, where LangGraph had not saved the step
    # the killed process began, one of a task that never runs again (not counted).
    assert len(notes) == 2 and notes[0]["of"] == notes[1]["of"], notes
    first, second = notes
    assert first["task"] != second["task"] or first["interrupt"] == second["interrupt"], notes
    answers = {"account for 5?": "savings", "memo for 5?": "rent", "account for 7?": "checking"}
    questions: list[str] = []
    while "__interrupt__" in state:
        (asked,) = state["__interrupt__"]
        questions.append(asked.value)
        assert len(questions) <= 3, questions
        with saver() as s:
            state = _three_calls_graph(s, ledger).invoke(
                Command(resume={asked.id: answers[asked.value]}), config
            )
    assert questions == ["account for 5?", "memo for 5?", "account for 7?"]
    assert ledger.read_text().splitlines() == [
        "5 from savings memo rent",
        "balance of savings",
        "7 from checking memo -",
    ]
    assert [m.content for m in state["messages"] if m.type == "tool"] == [
        "paid 5",
        "100",
        "paid 7",
    ]


def test_a_pause_settled_elsewhere_before_its_answer_asks_nothing_again(
    test_settings: Settings, tmp_path: Path
) -> None:
    """The first call's tool asks and nobody answers; the call is settled outside the graph
    meanwhile (its lookup finds the payment). When the node reaches the call again it returns
    the settled result, gives back no answer for the unanswered pause and asks nothing in its
    place: the graph's next question is the second call's own."""
    ledger = tmp_path / "ledger"

    def found(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Match("paid 5 before") if args["amount"] == 5 else runlog.Absent("no")

    pay = _asking_pay(ledger)

    script = _one_message(("pay", {"amount": 5}, "c-5"), ("pay", {"amount": 7}, "c-7"))

    def graph(saver: RunlogSaver) -> Any:
        risk: Any = {"pay": "irreversible"}
        return _tool_loop(saver, script, [pay], risk=risk, reconcile={"pay": found})

    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    with RunlogSaver(settings=test_settings) as saver:
        state = graph(saver).invoke({"messages": [HumanMessage("pay")]}, config)
    assert [i.value for i in state["__interrupt__"]] == ["account for 5?"]
    settled = runlog.reconcile(
        thread,
        by="ops",
        tools=[runlog.tool("pay", risk="irreversible", reconcile=found)(lambda a, **_: "")],
        settings=test_settings,
    )
    assert settled.settled, settled
    with RunlogSaver(settings=test_settings) as saver:
        state = graph(saver).invoke(None, config)
        (asked,) = state["__interrupt__"]
        assert asked.value == "account for 7?"
        state = graph(saver).invoke(Command(resume={asked.id: "checking"}), config)
    assert "__interrupt__" not in state
    assert ledger.read_text().splitlines() == ["7 from checking"]
    assert [m.content for m in state["messages"] if m.type == "tool"] == [
        "paid 5 before",
        "paid 7 from checking",
    ]


def test_runlog_question_in_an_unanswered_pauses_place_gets_its_own_answer(
    test_settings: Settings, tmp_path: Path
) -> None:
    """The first call's tool asks and nobody answers; the call is settled elsewhere. The
    second call's outcome is then lost (its tool raised), so runlog asks a person in the
    place the first call's question had: the person's decision reaches runlog's question, the
    first call does not take it back, and nothing is asked twice."""
    ledger = tmp_path / "ledger"

    def found(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Match("paid 5 before")

    pay = _asking_pay(ledger)

    @tool
    def wire(amount: int) -> str:
        """Wire money; the bank's answer is lost."""
        with ledger.open("a") as f:
            f.write(f"wired {amount}\n")
        raise RuntimeError("the bank did not answer")

    script = _one_message(("pay", {"amount": 5}, "c-5"), ("wire", {"amount": 9}, "c-9"))

    def graph(saver: RunlogSaver) -> Any:
        risk: Any = {"pay": "irreversible", "wire": "irreversible"}
        return _tool_loop(saver, script, [pay, wire], risk=risk, reconcile={"pay": found})

    thread = f"lg-{uuid.uuid4().hex}"
    config: Any = {"configurable": {"thread_id": thread}}
    with RunlogSaver(settings=test_settings) as saver:
        state = graph(saver).invoke({"messages": [HumanMessage("pay")]}, config)
    assert [i.value for i in state["__interrupt__"]] == ["account for 5?"]
    tools = [runlog.tool("pay", risk="irreversible", reconcile=found)(lambda a, **_: "")]
    assert runlog.reconcile(thread, by="ops", tools=tools, settings=test_settings).settled
    asked: list[Any] = []
    with RunlogSaver(settings=test_settings) as saver:
        state = graph(saver).invoke(None, config)
        while "__interrupt__" in state:
            (question,) = state["__interrupt__"]
            asked.append(question.value)
            assert len(asked) <= 2, asked
            decision = {"answer": "reject", "by": "ann", "note": "the bank says no"}
            state = graph(saver).invoke(Command(resume={question.id: decision}), config)
    assert [(q["runlog"], q["tool"]) for q in asked] == [("approval", "wire")]
    assert ledger.read_text().splitlines() == ["wired 9"]  # not run again
    with RunlogSaver(settings=test_settings) as saver:
        approvals = engine_of(saver.run_for(thread)).state.approvals.values()
        decided = [(a.approved, a.decided_by) for a in approvals if a.approved is not None]
    assert decided == [(False, "ann")]
