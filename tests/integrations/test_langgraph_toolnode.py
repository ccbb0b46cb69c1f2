"""runlog's tool node in a LangGraph graph on the real stack: a node re-executed after
``interrupt()``/resume returns the recorded result instead of repeating the effect."""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

from runlog import current_call
from runlog.integrations.langgraph import RunlogSaver, RunlogToolNode
from runlog.settings import Settings

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

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        return {"messages": [FakeMessagesListChatModel(responses=[SCRIPT[turn]]).invoke([])]}

    saver = RunlogSaver(settings=test_settings)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node(
        "tools", RunlogToolNode([transfer, confirm], saver, risk={"transfer": "irreversible"})
    )
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=saver)
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
