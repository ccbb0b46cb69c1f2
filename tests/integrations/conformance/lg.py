"""The conformance adapter of the LangGraph integration: the public ``RunlogSaver`` as the
graph's checkpointer and ``RunlogToolNode`` as its tool node.

The graph is LangGraph's tool-calling loop (agent node, ``tools_condition``, tool node); the
agent node answers from LangChain's ``FakeMessagesListChatModel`` with the script's step at
the turn the thread has reached (its AI messages so far). A missing call id is ``None``.
A graph that stops for a person is reported as runlog's ``Escalated`` whether it raised it
or returned LangGraph's ``__interrupt__``.
"""

from __future__ import annotations

import time
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

import runlog
from runlog.integrations.langgraph import RunlogSaver, RunlogToolNode

from .driver import Receiver, Spec


class LgAdapter:
    def execute(self, spec: Spec, receiver: Receiver) -> dict[str, Any]:
        script = spec.script

        def charge(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
            receiver.charge(spec.run_id, script, idempotency_key, fencing_token)
            return f"charged {args['cents']} for order {args['order']}"

        def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
            result = f"charged {args['cents']} for order {args['order']}"
            return receiver.lookup(spec.run_id, idempotency_key, fencing_token, result)

        reconcile = lookup if script.lookup else None
        fenced = runlog.tool("charge", risk="irreversible", reconcile=reconcile, receiver="fenced")
        tools = [fenced(charge)]
        if script.definition == "v3":
            tools.clear()
        if script.definition != "v1":
            tools.append(runlog.tool("note")(lambda args, *, idempotency_key: args["text"]))

        def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
            time.sleep(script.pace_s)
            turn = sum(isinstance(m, AIMessage) for m in state["messages"])
            if turn >= script.steps:
                answer = AIMessage(content=f"done after {turn} charges")
            else:
                call = {"name": "charge", "args": script.args(turn), "id": script.call_id(turn)}
                answer = AIMessage(content="", tool_calls=[call])
            model = FakeMessagesListChatModel(responses=[answer])
            return {"messages": [model.invoke(state["messages"])]}

        wait_s = 0.0 if spec.wait_s is None else spec.wait_s
        saver = RunlogSaver(settings=spec.settings, takeover=spec.takeover, wait_s=wait_s)
        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("tools", RunlogToolNode(tools, saver))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        graph = saver.finish_when_done(builder.compile(checkpointer=saver))
        config: Any = {"configurable": {"thread_id": spec.run_id}}
        with saver:
            started = saver.get_tuple(config) is not None
            prompt = None if started else {"messages": [HumanMessage("charge the orders")]}
            state = graph.invoke(prompt, config, durability="sync")
        if state.get("__interrupt__"):
            raise runlog.Escalated(f"thread {spec.run_id} waits for a person", run_id=spec.run_id)
        return {"outcome": "finished", "output": str(state["messages"][-1].content)}


ADAPTER = LgAdapter()
