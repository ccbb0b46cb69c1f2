"""A LangGraph graph on runlog, run in its own process so a test can SIGKILL it.

The graph is LangGraph's tool-calling loop: an agent node answering from a scripted fake chat
model (LangChain's ``FakeMessagesListChatModel``, no network), ``tools_condition``, and
``RunlogToolNode``; ``RunlogSaver`` is its checkpointer. The tool ``transfer`` is an effect on a
receiver that does not deduplicate: every request it gets moves money (a Redis counter per
amount), and it keeps a ledger by idempotency key that the tool's ``reconcile`` looks up.
It is fenced: it refuses a request whose token is below the highest it has seen for the
key, and the lookup raises that floor to the asking owner's token before it answers.

The worker holds at the transfer of ``--hold-amount``: it writes the flag ``at-<amount>``
and waits ``--hold-s`` (the test's window to kill it), right after the effect landed and
before its completion is recorded (``--hold-at after``), or once the tool was called (its
STARTED durable) and before the effect (``--hold-at before``), or in the tool node before
the call's STARTED (``--hold-at node``: the step's checkpoint is durable, nothing else).
It writes ``result`` with the final answer when the graph ends.

``--setup`` only records the task (the graph stops before the agent's first step);
``--go-file`` makes the worker resume the thread (``invoke(None)``) once that file exists,
so a test releases several resumers together; ``--fresh-ids`` makes the model give a new
tool-call id each time it is asked (as real models do), ``--same-ids`` the same ``call_0``
for every call of every step. ``--ask`` makes the transfer ask a person with LangGraph's
``interrupt()`` before it moves money (after the hold ``before``); the worker then reports
the interrupt (``interrupted``) and stops, or with ``--answer`` resumes the thread with
``Command(resume=...)`` as long as the graph asks: ``<answer>`` to the transfer's question, a
decision ``{"answer": <answer>, "by": ...}`` to runlog's (an escalated call).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import redis  # noqa: E402
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage  # noqa: E402
from langchain_core.runnables import RunnableConfig  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import tools_condition  # noqa: E402
from langgraph.types import Command, interrupt  # noqa: E402

import runlog  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.integrations.langgraph import RunlogSaver, RunlogToolNode  # noqa: E402
from workers.common import fenced_effect, raise_floor  # noqa: E402

EXIT_ESCALATED = 5
EXIT_FENCED = 3


def _call(i: int, amount: int) -> dict[str, Any]:
    return {"name": "transfer", "args": {"amount": amount}, "id": f"call-{i}"}


SCRIPT: list[AIMessage] = [
    AIMessage(content="", tool_calls=[_call(0, 1)]),
    AIMessage(content="", tool_calls=[_call(1, 2), _call(2, 3)]),
    AIMessage(content="done: moved 6"),
]
AMOUNTS = (1, 2, 3)


def effects_key(prefix: str, amount: int) -> str:
    return f"{prefix}lg:effects:{amount}"


def answer(question: Any, said: str) -> Any:
    """A person's answer: runlog's question takes a decision naming who decided, the
    transfer's own question the word alone."""
    if isinstance(question, dict) and question.get("runlog") == "approval":
        return {"answer": said, "by": "ops@worker", "note": "checked the ledger"}
    return said


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--thread", required=True)
    ap.add_argument("--hold-s", type=float, default=0.0)
    ap.add_argument("--hold-at", choices=("node", "before", "after"), default="after")
    ap.add_argument("--hold-amount", type=int, default=0, help="hold only at this transfer")
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument("--no-reconcile", action="store_true", help="transfer has no lookup")
    ap.add_argument("--wait-s", type=float, default=0.0, help="RunlogSaver(wait_s=...)")
    ap.add_argument("--setup", action="store_true")
    ap.add_argument("--go-file", default="")
    ap.add_argument("--ask", action="store_true")
    ap.add_argument("--answer", default="")
    ap.add_argument("--tool-node", default="tools", help="the tool node's name in the graph")
    ap.add_argument("--finish", action="store_true", help="saver.finish_when_done(graph)")
    ids = ap.add_mutually_exclusive_group()
    ids.add_argument("--fresh-ids", action="store_true")
    ids.add_argument("--same-ids", action="store_true")
    a = ap.parse_args()
    settings = Settings()
    flags = Path(a.dir)
    prefix = settings.redis_key_prefix
    r = redis.Redis.from_url(settings.redis_url)
    ledger = f"{prefix}lg:ledger"
    floors = f"{prefix}lg:floors"

    def transfer(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> str:
        amount = int(args["amount"])
        result = f"moved {amount}"
        hold = amount == a.hold_amount
        if hold and a.hold_at == "before":
            (flags / f"{a.name}.at-{amount}").write_text(idempotency_key)
            time.sleep(a.hold_s)
        if a.ask and interrupt({"transfer": amount, "key": idempotency_key}) != "approve":
            raise runlog.ToolError(f"transfer {amount} refused")
        landed = fenced_effect(  # the receiver's effect and its ledger entry, fenced
            r,
            floors,
            idempotency_key,
            fencing_token,
            counter=effects_key(prefix, amount),
            by_key=False,
            results=ledger,
            result=result,
        )
        if not landed:
            raise runlog.ToolError(f"refused {idempotency_key}: a newer owner holds the run")
        (flags / f"{a.name}.ran-{amount}").write_text(idempotency_key)  # every effect
        if hold and a.hold_at == "after":
            (flags / f"{a.name}.at-{amount}").write_text(idempotency_key)
            time.sleep(a.hold_s)
        return result

    def lookup(
        args: dict[str, Any], *, idempotency_key: str, fencing_token: int
    ) -> runlog.Match | runlog.Absent:
        raise_floor(r, floors, idempotency_key, fencing_token)
        got = r.hget(ledger, idempotency_key)
        return runlog.Match(got.decode()) if got is not None else runlog.Absent("no entry")

    reconcile = None if a.no_reconcile else lookup
    tool = runlog.tool("transfer", risk="irreversible", reconcile=reconcile, receiver="fenced")(
        transfer
    )

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        reply = SCRIPT[turn]
        if a.fresh_ids or a.same_ids:
            calls = [
                {**tc, "id": uuid.uuid4().hex if a.fresh_ids else "call_0"}
                for tc in reply.tool_calls
            ]
            reply = AIMessage(content=reply.content, tool_calls=calls)
        model = FakeMessagesListChatModel(responses=[reply])
        return {"messages": [model.invoke(state["messages"])]}

    class ReadingSaver(RunlogSaver):
        """Keeps the id of each checkpoint it hands out: the graph's first read, when it
        resumes, is the checkpoint it began from (the race test compares)."""

        reads: list[str] = []

        def get_tuple(self, config: RunnableConfig) -> Any:
            got = super().get_tuple(config)
            self.reads.append(
                "" if got is None else str(got.config["configurable"]["checkpoint_id"])
            )
            return got

    saver = ReadingSaver(settings=settings, takeover=a.takeover, wait_s=a.wait_s)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)

    class HoldingToolNode(RunlogToolNode):
        """Holds (``--hold-at node``) once the node runs, before any call's STARTED: its
        step's checkpoint is durable (``durability="sync"``) and nothing of the calls is."""

        def __call__(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
            ai = state["messages"][-1]
            amounts = [tc["args"]["amount"] for tc in ai.tool_calls]
            if a.hold_at == "node" and a.hold_amount in amounts:
                (flags / f"{a.name}.at-{a.hold_amount}").write_text("")
                time.sleep(a.hold_s)
            return super().__call__(state, config)

    builder.add_node(a.tool_node, HoldingToolNode([tool], saver))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, {"tools": a.tool_node, END: END})
    builder.add_edge(a.tool_node, "agent")
    graph = builder.compile(checkpointer=saver, interrupt_before=["agent"] if a.setup else None)
    if a.finish:
        saver.finish_when_done(graph)
    config = {"configurable": {"thread_id": a.thread}}
    if a.go_file:
        (flags / f"{a.name}.ready").write_text("")
        while not Path(a.go_file).exists():
            time.sleep(0.005)
    with saver:
        started = saver.get_tuple(config) is not None
        first: Any = None if started else {"messages": [HumanMessage("move 1, then 2 and 3")]}
        try:
            saver.reads.clear()
            try:
                state = graph.invoke(first, config, durability="sync")
            finally:
                if a.go_file and saver.reads:  # the checkpoint this resumer's graph began from
                    (flags / f"{a.name}.read").write_text(saver.reads[0])
            while "__interrupt__" in state and a.answer:
                answers = {i.id: answer(i.value, a.answer) for i in state["__interrupt__"]}
                state = graph.invoke(Command(resume=answers), config, durability="sync")
            if "__interrupt__" in state:
                asked = [i.value for i in state["__interrupt__"]]
                (flags / f"{a.name}.result").write_text(json.dumps({"interrupted": asked}))
                return 0
        except runlog.Escalated as exc:  # an uncertain effect waits for a person
            (flags / f"{a.name}.result").write_text(json.dumps({"escalated": str(exc)}))
            return EXIT_ESCALATED
        except runlog.Fenced as exc:  # another process moved the thread on
            (flags / f"{a.name}.result").write_text(json.dumps({"fenced": str(exc)}))
            return EXIT_FENCED
    final = state["messages"][-1]
    (flags / f"{a.name}.result").write_text(json.dumps({"answer": final.content}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
