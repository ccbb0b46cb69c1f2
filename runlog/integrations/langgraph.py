"""LangGraph on runlog (``pip install 'runlog[langgraph]'``): a checkpointer whose threads are runs.

``RunlogSaver`` is a ``BaseCheckpointSaver`` (sync and async):

* **Each thread is a run** (the thread id is the run id). The first write to a thread opens
  the run through ``open_run`` (its lease, its fencing token) and this saver keeps it until
  ``close()``: one writer per thread, the same rule as any runlog run.
* **Checkpoints and pending writes are events** of the run: ``MEMORY_WRITTEN`` records with
  key ``langgraph.checkpoint`` and a JSON value naming what was written (``put``, ``writes``,
  ``delete``), the checkpoint's bytes in LangGraph's own serializer. ``MEMORY_WRITTEN`` is the
  vocabulary's record of "the agent wrote state it will read back": record-only in the fold, so
  no new schema version, every released reader decodes it, and the run-state projection keeps
  nothing of it (the checkpoints are read back from the log, not from a projection).
* **Ownership is fenced.** Every ``put``/``put_writes`` is an acknowledged append behind the
  run's lease guard: a writer whose lease was taken over, or who never got it (another writer
  owns the thread), raises ``runlog.Fenced`` and its checkpoint is in no reader's view. A thread
  that fenced a saver stays refused to that saver (a new saver must open it again and read what
  the new owner wrote); nothing is ever merged.
* **Reads come from the log**: the thread's valid events folded (the acceptance rule every
  runlog reader applies) into an in-memory view; a thread this saver owns is served from that
  view (only the owner appends), any other thread is read from its log again on each call.
* **delete_thread** appends a recorded deletion; every reader of this saver folds it as "forget
  everything before": the thread reads as empty. Until runlog's erasure lands, the deleted
  checkpoints' bytes stay in the events topic (retention is infinite) and in any consumer's
  copy of it; runlog's projections and snapshots hold nothing of them.

``RunlogToolNode`` runs a graph's tools through ``run.call_tool``: see its docstring.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from runlog.integrations._common import missing_extra

try:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import BaseTool
    from langchain_core.tools import tool as lc_tool
    from langgraph.checkpoint.base import (
        BaseCheckpointSaver,
        ChannelVersions,
        Checkpoint,
        CheckpointMetadata,
        CheckpointTuple,
        get_checkpoint_id,
        get_checkpoint_metadata,
    )
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.checkpoint.serde.base import SerializerProtocol
    from langgraph.errors import GraphBubbleUp
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "langgraph", ("langgraph", "langchain_core")) from exc

from runlog.api import open_run
from runlog.bootstrap import Services
from runlog.errors import Fenced, RunLocked, ToolFailed, UnknownTool
from runlog.log.fold import read_run
from runlog.log.reader import LogReader
from runlog.producers.calls import execute_logical
from runlog.producers.ops import drive
from runlog.producers.run import Run
from runlog.producers.tools import Reconciler, Risk, Tool, ToolError, ToolFn, is_async
from runlog.schemas.canonical import canonical_json
from runlog.schemas.models import Event, MemoryWritten
from runlog.schemas.vocabulary import EventType
from runlog.settings import Settings

__all__ = ["CHECKPOINT_KEY", "RunlogSaver", "RunlogToolNode"]

CHECKPOINT_KEY = "langgraph.checkpoint"
"""The MEMORY_WRITTEN key of the checkpointer's records."""


def _typed(serde: SerializerProtocol, obj: Any) -> list[str]:
    kind, data = serde.dumps_typed(obj)
    return [kind, base64.b64encode(data).decode("ascii")]


def _untyped(serde: SerializerProtocol, pair: list[str]) -> Any:
    return serde.loads_typed((pair[0], base64.b64decode(pair[1])))


def _delta(checkpoint: Checkpoint, new_versions: ChannelVersions) -> Checkpoint:
    """The checkpoint with only the channel values this write changed: a channel's value is
    stored once per version (as LangGraph's own savers store blobs), so a record grows with
    the step, not with the thread's history."""
    values = checkpoint["channel_values"]
    return {**checkpoint, "channel_values": {k: values[k] for k in new_versions if k in values}}


@dataclass
class _Owned:
    run: Run
    view: InMemorySaver


class RunlogSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer on runlog: each thread a fenced run, checkpoints its events.

    ``wait_s`` is how long a write waits for another live owner of the thread before it is
    refused with ``Fenced`` (default 0: a thread somebody else owns is refused at once; a
    process resuming a thread whose owner died waits for that lease to expire, so give it
    about one lease TTL). ``takeover=True`` takes a thread from its owner at once (a
    supervisor that saw the owner's process exit): the old owner's next write is fenced.
    """

    def __init__(
        self,
        *,
        settings: Settings | None = None,
        tenant: str = "default",
        wait_s: float = 0.0,
        takeover: bool = False,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        self.settings = settings or Settings()
        self.tenant = tenant
        self.wait_s = wait_s
        self.takeover = takeover
        self._owned: dict[str, _Owned] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._tools: dict[str, Tool] = {}
        self._refused: dict[str, str] = {}
        self._lock = threading.RLock()

    # Lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release every thread's lease (pipelined appends are waited for)."""
        with self._lock:
            owned, self._owned = self._owned, {}
        for o in owned.values():
            o.run.close()

    def __enter__(self) -> RunlogSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RunlogSaver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # The log -----------------------------------------------------------------------------
    def _events(self, thread_id: str, end: int | None = None) -> builtins.list[Event]:
        """The thread's valid events in log order (every reader's acceptance rule)."""
        services = Services.shared(self.settings)
        reader = LogReader(self.settings)
        try:
            got = read_run(
                reader, services.redis, self.settings, self.tenant, thread_id, end=end, keep=True
            )
        finally:
            reader.close()
        fenced = {rec.offset for rec in got.folded.fenced}
        return [rec.event for rec in got.folded.kept if rec.offset not in fenced]

    def _apply(self, view: InMemorySaver, thread_id: str, ev: Event) -> None:
        if ev.type is not EventType.MEMORY_WRITTEN:
            return
        payload = ev.payload
        if not isinstance(payload, MemoryWritten) or payload.key != CHECKPOINT_KEY:
            return
        rec = json.loads(payload.value)
        kind = rec["kind"]
        if kind == "delete":
            view.delete_thread(thread_id)
            return
        config: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": rec["ns"],
                "checkpoint_id": rec["checkpoint_id"],
            }
        }
        if kind == "put":
            view.put(
                config,
                _untyped(self.serde, rec["checkpoint"]),
                _untyped(self.serde, rec["metadata"]),
                _untyped(self.serde, rec["versions"]),
            )
        elif kind == "writes":
            writes = [(ch, _untyped(self.serde, v)) for ch, v in rec["writes"]]
            view.put_writes(config, writes, rec["task_id"], rec["task_path"])
        else:
            raise ValueError(f"unknown checkpoint record kind {kind!r} in {ev.event_id}")

    def _fold(self, thread_id: str, end: int | None = None) -> InMemorySaver:
        view = InMemorySaver(serde=self.serde)
        for ev in self._events(thread_id, end):
            self._apply(view, thread_id, ev)
        return view

    def _view(self, thread_id: str) -> InMemorySaver:
        with self._lock:
            owned = self._owned.get(thread_id)
            if owned is not None:
                return owned.view
        return self._fold(thread_id)

    def _thread_lock(self, thread_id: str) -> threading.RLock:
        with self._lock:
            lock = self._locks.get(thread_id)
            if lock is None:
                lock = self._locks[thread_id] = threading.RLock()
            return lock

    def _own(self, thread_id: str) -> _Owned:
        with self._thread_lock(thread_id):
            with self._lock:
                if thread_id in self._refused:
                    raise Fenced(
                        f"thread {thread_id} is refused to this saver: {self._refused[thread_id]}",
                        run_id=thread_id,
                    )
                owned = self._owned.get(thread_id)
                tools = builtins.list(self._tools.values())
            if owned is not None:
                return owned
            try:
                run = open_run(
                    thread_id,
                    tenant=self.tenant,
                    settings=self.settings,
                    wait_s=self.wait_s,
                    takeover=self.takeover,
                    tools=tools,
                    agent="langgraph",
                    reason="langgraph checkpointer",
                )
            except RunLocked as exc:
                raise Fenced(
                    f"thread {thread_id} is owned by another writer: {exc}", run_id=thread_id
                ) from exc
            try:
                view = self._fold(thread_id, end=run.position)
            except BaseException:
                run.close()
                raise
            with self._lock:
                for t in self._tools.values():  # tools added while the run was opening
                    run.tools.setdefault(t.name, t)
                owned = self._owned[thread_id] = _Owned(run, view)
            return owned

    def _append(self, thread_id: str, record: dict[str, Any]) -> _Owned:
        with self._thread_lock(thread_id):  # the view is applied in the log's order
            return self._append_owned(thread_id, record)

    def _append_owned(self, thread_id: str, record: dict[str, Any]) -> _Owned:
        owned = self._own(thread_id)
        try:
            # A checkpoint records what a node did: kept whatever a person asked meanwhile
            # (the graph's next step, a model turn or a tool call, sees a cancellation).
            ev = owned.run._append(
                EventType.MEMORY_WRITTEN,
                key=CHECKPOINT_KEY,
                value=json.dumps(record, separators=(",", ":")),
            )
        except Fenced as exc:
            self._refuse(thread_id, str(exc))
            raise
        self._apply(owned.view, thread_id, ev)
        return owned

    def _refuse(self, thread_id: str, why: str) -> None:
        with self._lock:
            self._refused[thread_id] = why
            owned = self._owned.pop(thread_id, None)
        if owned is not None:
            owned.run.close()

    def add_tools(self, tools: Iterable[Tool]) -> None:
        """Tools the threads' runs call (``RunlogToolNode`` adds its own): given to
        ``open_run``, so a call left uncertain by a crash is settled before the graph goes on."""
        with self._lock:
            for t in tools:
                self._tools[t.name] = t
                for owned in self._owned.values():
                    owned.run.tools[t.name] = t

    def run_for(self, thread_id: str) -> Run:
        """The thread's run, owned by this saver (opened, with recovery, on first use)."""
        return self._own(thread_id).run

    # BaseCheckpointSaver ---------------------------------------------------------------------
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id = str(config["configurable"]["thread_id"])
        with self._thread_lock(thread_id):
            return self._view(thread_id).get_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        if config is None:
            with self._lock:
                threads = sorted(self._owned)
        else:
            threads = [str(config["configurable"]["thread_id"])]
        for thread_id in threads:
            cfg: RunnableConfig = {"configurable": {**(config or {}).get("configurable", {})}}
            cfg["configurable"]["thread_id"] = thread_id
            with self._thread_lock(thread_id):  # read whole: an owned view moves on with puts
                tuples = builtins.list(
                    self._view(thread_id).list(cfg, filter=filter, before=before, limit=limit)
                )
            for tup in tuples:
                yield tup
                if limit is not None:
                    limit -= 1
                    if limit <= 0:
                        return

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        record = {
            "kind": "put",
            "ns": conf.get("checkpoint_ns", ""),
            "checkpoint_id": conf.get("checkpoint_id"),
            "checkpoint": _typed(self.serde, _delta(checkpoint, new_versions)),
            "metadata": _typed(self.serde, get_checkpoint_metadata(config, metadata)),
            "versions": _typed(self.serde, dict(new_versions)),
        }
        self._append(thread_id, record)
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": record["ns"],
                "checkpoint_id": checkpoint["id"],
            }
        }

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        conf = config["configurable"]
        record = {
            "kind": "writes",
            "ns": conf.get("checkpoint_ns", ""),
            "checkpoint_id": get_checkpoint_id(config),
            "task_id": task_id,
            "task_path": task_path,
            "writes": [[ch, _typed(self.serde, v)] for ch, v in writes],
        }
        self._append(str(conf["thread_id"]), record)

    def delete_thread(self, thread_id: str) -> None:
        """Record the thread's deletion: every reader of this checkpointer sees it empty.

        The deleted checkpoints stay in the events topic (see the module's docstring)."""
        self._append(str(thread_id), {"kind": "delete"})

    def get_next_version(self, current: str | None, channel: None) -> str:
        return InMemorySaver.get_next_version(self, current, channel)  # type: ignore[arg-type]

    # Async: the same calls in a worker thread --------------------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        def collect() -> builtins.list[CheckpointTuple]:
            return list(self.list(config, filter=filter, before=before, limit=limit))

        for tup in await asyncio.to_thread(collect):
            yield tup

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)


class RunlogToolNode:
    """A drop-in for LangGraph's ``ToolNode`` whose tools run through runlog's call path.

    ``RunlogToolNode(tools, saver)`` runs the tool calls of the state's last AI message in
    the thread's run (the run ``saver`` owns for the thread): STARTED durable before the
    tool runs, the idempotency key and fencing token in ``runlog.current_call()``, the result
    recorded. A call's key is bound to the thread and the model's tool-call id (ordinal 0), so
    a node re-executed after ``interrupt()``/resume, or in a new process after a crash, gets
    the recorded result back instead of running the tool again. A call that started and never
    completed is settled when the run is opened, before any tool runs: the tool's
    ``reconcile`` lookup, else its risk class (``safe``/``reversible`` retried with the same
    key, ``irreversible`` escalated to a person: ``runlog.Escalated`` is raised and the graph
    stops). Never re-run blindly.

    ``tools`` are runlog tools (``@runlog.tool(risk=..., reconcile=...)``) or LangChain tools
    (``@langchain_core.tools.tool``), whose risk and lookup come from ``risk=`` and
    ``reconcile=`` by name (default ``safe``). A proven failure (``runlog.ToolFailed``)
    becomes an error ``ToolMessage``, as ``ToolNode`` reports a tool's exception.
    """

    def __init__(
        self,
        tools: Sequence[Any],
        saver: RunlogSaver,
        *,
        risk: Mapping[str, Risk] | None = None,
        reconcile: Mapping[str, Reconciler] | None = None,
        messages_key: str = "messages",
    ) -> None:
        self.saver = saver
        self.messages_key = messages_key
        self.tools: dict[str, Tool] = {}
        for t in tools:
            rt = t if isinstance(t, Tool) else _runlog_tool(t, risk or {}, reconcile or {})
            self.tools[rt.name] = dataclasses.replace(rt, fn=_interruptible(rt.fn))
        saver.add_tools(self.tools.values())

    def __call__(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        messages = state[self.messages_key] if isinstance(state, dict) else state
        ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        if ai is None or not ai.tool_calls:
            return {self.messages_key: []}
        thread_id = str(config["configurable"]["thread_id"])
        run = self.saver.run_for(thread_id)
        out: list[ToolMessage] = []
        for tc in ai.tool_calls:
            call_id = tc["id"] or ""
            name, args = tc["name"], dict(tc["args"])
            tool = self.tools.get(name)
            if tool is None:
                raise UnknownTool(f"the tool node has no tool {name!r}")
            args_json = canonical_json(args)
            scope = f"{thread_id}:langgraph:{call_id}"
            key = run.idempotency_key(scope, name, args_json, 0)
            stash: list[GraphBubbleUp] = []
            token = _BUBBLE.set(stash)
            try:
                content = drive(
                    run,
                    execute_logical(run, tool, args_json, key, call_id=call_id, operation_id=scope),
                )
            except Fenced as exc:
                self.saver._refuse(thread_id, str(exc))
                raise
            except ToolFailed as exc:
                if stash:  # interrupt(): recorded as "nothing happened", raised to LangGraph
                    raise stash[0] from None
                out.append(
                    ToolMessage(
                        content=f"Error: {exc}", name=name, tool_call_id=call_id, status="error"
                    )
                )
                continue
            finally:
                _BUBBLE.reset(token)
            out.append(ToolMessage(content=content, name=name, tool_call_id=call_id))
        return {self.messages_key: out}


_BUBBLE: ContextVar[list[GraphBubbleUp] | None] = ContextVar(
    "runlog_langgraph_bubble", default=None
)


def _interruptible(fn: ToolFn) -> ToolFn:
    """``fn`` with LangGraph's control flow (``interrupt()``, ``Command`` bubbling up) turned
    into a proven failure for runlog (the tool stopped before any effect: its key stays open,
    so the resumed node runs it again) and handed back to the node to raise."""
    if is_async(fn):
        return fn  # an async tool's interrupt() is recorded as its exception says

    def call(args: dict[str, Any], *, idempotency_key: str) -> Any:
        try:
            return fn(args, idempotency_key=idempotency_key)
        except GraphBubbleUp as exc:
            stash = _BUBBLE.get()
            if stash is None:
                raise
            stash.append(exc)
            raise ToolError(f"{type(exc).__name__}: the tool paused the graph") from exc

    return call


def _runlog_tool(t: Any, risk: Mapping[str, Risk], reconcile: Mapping[str, Reconciler]) -> Tool:
    lc = t if isinstance(t, BaseTool) else lc_tool(t)

    def invoke(args: dict[str, Any], *, idempotency_key: str) -> str:
        result = lc.invoke(args)
        return result if isinstance(result, str) else json.dumps(result, default=str)

    return Tool(
        name=lc.name,
        fn=invoke,
        risk=risk.get(lc.name, "safe"),
        reconcile=reconcile.get(lc.name),
    )
