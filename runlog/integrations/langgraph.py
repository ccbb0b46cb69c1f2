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

``RunlogToolNode`` runs a graph's tools through runlog's call path: see its docstring.
``finish_when_done(graph)`` records ``RUN_FINISHED`` when the graph ends a thread.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

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
    from langgraph.errors import GraphBubbleUp, GraphInterrupt
    from langgraph.types import interrupt
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "langgraph", ("langgraph", "langchain_core")) from exc

from runlog._api import open_run, question
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import (
    DecisionConflict,
    Escalated,
    Fenced,
    RunLocked,
    RunlogError,
    ToolFailed,
    UnknownTool,
    ValidationFailed,
)
from runlog.integrations._common import SUMMARY_CHARS
from runlog.log._fold import read_run
from runlog.log._reader import LogReader
from runlog.producers._calls import attempt, execute_logical, retry_key
from runlog.producers._context import current_call
from runlog.producers._engine import Engine
from runlog.producers._handle import Run, engine_of
from runlog.producers._ops import drive
from runlog.producers._tools import Reconciler, Risk, Tool, ToolFn, is_async
from runlog.schemas._canonical import canonical_json
from runlog.schemas._models import UNDO_AND_RETRY, Event, MemoryWritten, ToolCallStarted
from runlog.schemas._vocabulary import EventType

__all__ = ["CHECKPOINT_KEY", "RunlogSaver", "RunlogToolNode"]

log = logging.getLogger(__name__)

DECIDED_KEY = "langgraph.decided"
"""The MEMORY_WRITTEN key naming an approval that a ``Command(resume=...)`` answered: the
tool node asks it again, at the same place, whenever it re-executes (LangGraph hands a
node's resume values to its ``interrupt()`` calls by their order), and ignores the answer."""

ANSWERS = ("approve", "reject", UNDO_AND_RETRY)
"""What ``Command(resume={"answer": ..., "by": ...})`` may answer runlog's question."""

G = TypeVar("G")

ERROR = "__error__"
"""LangGraph's channel of a task's error (``langgraph.constants``; its value is fixed by the
checkpoints it has written)."""

ERROR_SOURCE_NODE = "__error_source_node__"
"""Written beside ``ERROR`` when the graph routes the error to an error handler."""

PUSH = "__pregel_push"
"""The first part of the path of a task that a ``Send`` pushed (LangGraph's ``PUSH``)."""

NS_SEP = "|"
"""LangGraph's separator of nested checkpoint namespaces (``outer:task|inner:task``)."""

CHECKPOINT_KEY = "langgraph.checkpoint"
"""The MEMORY_WRITTEN key of the checkpointer's records."""

PAUSED_KEY = "langgraph.paused"
"""The MEMORY_WRITTEN key of a tool call's attempt that LangGraph paused (``interrupt()``)
before the tool made any effect: ``{"key": <idempotency key>, "attempt": <n>}``, and, when
the pause was the tool's ``interrupt()``, ``"of"`` (the call's key in the tool node, which a
retry's key differs from), ``"task"`` (the checkpoint namespace of the LangGraph task it paused,
whose resume values answer it: a task that a killed process ran and LangGraph never saved is
not the one that runs again), ``"interrupt"`` (LangGraph's id of the interrupt, so one noted
twice in one task is counted once) and ``"slot"`` (how many answers the task held when it
paused: the place among them its own answer takes, if it is ever given)."""

ASKED_KEY = "langgraph.asked"
"""The MEMORY_WRITTEN key of runlog's own question asked as a LangGraph interrupt:
``{"of": "approval:<approval id>", "task": ..., "interrupt": ..., "slot": ...}`` as in
``PAUSED_KEY``, so the place it takes among the task's questions is known."""

APPROVAL_PLACE = "approval:"
"""What ``ASKED_KEY`` names runlog's question by (never a call's key, which starts ``k``)."""

SCRATCHPAD = "__pregel_scratchpad"
"""The key of a LangGraph task's scratchpad in its config, whose ``resume`` lists the answers
the task holds (``langgraph._internal._constants.CONFIG_KEY_SCRATCHPAD``)."""


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


LEGACY_SCOPE = ":langgraph:"
"""The tool node's first key scope, ``<thread>:langgraph:<tool-call id>``: a run whose log
holds a call under it keeps it (its receivers hold those keys), every other run uses
``STEP_SCOPE``."""

STEP_SCOPE = ":langgraph-step:"
"""The tool node's key scope: ``<thread>:langgraph-step:`` and a JSON array of the deletion
generation, the task's parent namespace and step, the AI message's id, the path of a task a
``Send`` pushed, and the call's position in its AI message. Never the model's tool-call id: a
model may repeat one across steps or give none, and a model asked again may give a fresh one
for the same action."""


@dataclass
class _Owned:
    run: Run
    view: InMemorySaver
    legacy_keys: bool = False
    """The run's log holds a tool-node call under ``LEGACY_SCOPE``."""
    generation: int = 0
    """How many deletions the thread's log holds: the steps start again after each."""
    paused: dict[str, int] = dataclasses.field(default_factory=dict)
    """Idempotency key -> the attempt of it that LangGraph paused before any effect."""
    decided: set[str] = dataclasses.field(default_factory=set)
    """Approvals a ``Command(resume=...)`` answered (``DECIDED_KEY``)."""
    asked: dict[str, dict[str, tuple[str, int | None]]] = dataclasses.field(default_factory=dict)
    """A LangGraph task's namespace -> the interrupts tool node calls' tools raised in it
    (``PAUSED_KEY``) and runlog's questions asked in it (``ASKED_KEY``), each with the
    call's key (``APPROVAL_PLACE`` and the approval's id for runlog's) and the slot its
    answer takes among the task's resume values (None: not noted). An interrupt's id is
    made from its task and slot, so a later question with the same id is asked in an
    unanswered one's place: the last one noted holds it. The node gives a call's answered
    ones back when it no longer runs the call's tool."""
    built_on: set[str] = dataclasses.field(default_factory=set)
    """Checkpoints this saver put since it opened the run, and their parents: the steps its
    graph ran. Writes on one of them are a late write of this graph's own step (LangGraph
    hands writes over in parallel with the next step's ``put`` unless ``durability="sync"``),
    never a stale process's."""


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
        self._graph: Any = None

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

    def _fold_owned(self, run: Run, thread_id: str) -> _Owned:
        """The thread's view as the run's log holds it up to where the run was opened, and
        what that log says of the tool node's keys and paused calls."""
        owned = _Owned(run, InMemorySaver(serde=self.serde))
        legacy_prefix = thread_id + LEGACY_SCOPE
        for ev in self._events(thread_id, engine_of(run).position):
            self._apply(owned.view, thread_id, ev)
            p = ev.payload
            if isinstance(p, MemoryWritten) and p.key == CHECKPOINT_KEY:
                owned.generation += json.loads(p.value)["kind"] == "delete"
            elif isinstance(p, MemoryWritten) and p.key == PAUSED_KEY:
                paused = json.loads(p.value)
                owned.paused[paused["key"]] = paused["attempt"]
                if paused.get("interrupt"):
                    asked = owned.asked.setdefault(paused["task"], {})
                    asked[paused["interrupt"]] = (paused["of"], paused.get("slot"))
            elif isinstance(p, MemoryWritten) and p.key == ASKED_KEY:
                q = json.loads(p.value)
                owned.asked.setdefault(q["task"], {})[q["interrupt"]] = (q["of"], q["slot"])
            elif isinstance(p, MemoryWritten) and p.key == DECIDED_KEY:
                owned.decided.add(json.loads(p.value)["approval_id"])
            elif isinstance(p, ToolCallStarted) and (p.operation_id or "").startswith(
                legacy_prefix
            ):
                owned.legacy_keys = True
        return owned

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
            if owned is not None:
                return owned
            try:
                # Without the tool node's tools: a call its owner left open is settled by
                # the node when it reaches the call again (LangGraph runs that node first),
                # where a tool may pause the graph. Settled here, outside any node, a tool's
                # interrupt() could only fail, and each failure would count as an attempt
                # of unknown outcome.
                run = open_run(
                    thread_id,
                    tenant=self.tenant,
                    settings=self.settings,
                    wait_s=self.wait_s,
                    takeover=self.takeover,
                    agent="langgraph",
                    reason="langgraph checkpointer",
                )
            except RunLocked as exc:
                raise Fenced(
                    f"thread {thread_id} is owned by another writer: {exc}", run_id=thread_id
                ) from exc
            try:
                owned = self._fold_owned(run, thread_id)
            except BaseException:
                run.close()
                raise
            with self._lock:
                for t in self._tools.values():  # after recovery: see above
                    engine_of(run).tools.setdefault(t.name, t)
                self._owned[thread_id] = owned
            return owned

    def _append(self, thread_id: str, record: dict[str, Any]) -> _Owned:
        with self._thread_lock(thread_id):  # the view is applied in the log's order
            return self._append_owned(thread_id, record)

    def _append_owned(self, thread_id: str, record: dict[str, Any]) -> _Owned:
        owned = self._own(thread_id)
        # A put names its parent; writes name the checkpoint they belong to.
        kind = record["kind"]
        if kind == "put":
            self._check_latest(owned, thread_id, record["ns"], record["checkpoint_id"])
        elif kind == "writes":
            self._check_base(owned, thread_id, record["ns"], record["checkpoint_id"])
        try:
            # A checkpoint records what a node did: kept whatever a person asked meanwhile
            # (the graph's next step, a model turn or a tool call, sees a cancellation).
            ev = engine_of(owned.run).record(
                EventType.MEMORY_WRITTEN,
                key=CHECKPOINT_KEY,
                value=json.dumps(record, separators=(",", ":")),
            )
        except Fenced as exc:
            self._refuse(thread_id, str(exc))
            raise
        self._apply(owned.view, thread_id, ev)
        owned.generation += record["kind"] == "delete"
        return owned

    @staticmethod
    def _latest(owned: _Owned, thread_id: str, ns: str) -> str | None:
        """The id of the latest checkpoint of ``ns`` in the thread's log (the view is the
        log's fold: it was read when the run was opened, and only this owner appends)."""
        cfg: RunnableConfig = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}}
        tup = owned.view.get_tuple(cfg)
        return None if tup is None else str(tup.checkpoint["id"])

    @staticmethod
    def _known(owned: _Owned, thread_id: str, record: dict[str, Any]) -> bool:
        """The checkpoint the writes belong to is in the log. LangGraph may hand over a
        step's writes before that step's checkpoint (its writes and puts run in parallel):
        writes on a checkpoint still to come cannot be stale, a later put decides."""
        cfg: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": record["ns"],
                "checkpoint_id": record["checkpoint_id"],
            }
        }
        return owned.view.get_tuple(cfg) is not None

    def _check_latest(self, owned: _Owned, thread_id: str, ns: str, based_on: str | None) -> None:
        """Optimistic concurrency on the log: a write based on a checkpoint that is no longer
        the latest (another process moved the thread on since this graph read it) is
        refused like a stale owner's append. Accepting it would fork the thread and run
        again what the newer checkpoints already did. A checkpoint without a parent (a
        graph's input on a thread it found empty, LangGraph's API for a new root) bases on
        nothing; a namespace with no checkpoint yet (a subgraph's first) takes any parent."""
        if based_on is None:
            return
        latest = self._latest(owned, thread_id, ns)
        if latest is None and ns:
            return
        if based_on != latest:
            raise Fenced(
                f"thread {thread_id}: a write based on checkpoint {based_on} is stale: the "
                f"latest checkpoint in the log is {latest} (another writer moved the thread "
                "on); read the thread again",
                run_id=thread_id,
                epoch=owned.run.epoch,
                seq=owned.run.state.seq,
            )

    def _check_base(self, owned: _Owned, thread_id: str, ns: str, checkpoint_id: str) -> None:
        """``_check_latest`` for what is based on a checkpoint without writing a child of
        it (writes, a task): accepted on the latest, on a step of this saver's own graph
        (``built_on``), or on a checkpoint not in the log yet (its ``put`` is still on its
        way and decides)."""
        if checkpoint_id in owned.built_on:
            return
        record = {"ns": ns, "checkpoint_id": checkpoint_id}
        if self._known(owned, thread_id, record):
            self._check_latest(owned, thread_id, ns, checkpoint_id)

    def check_latest(self, thread_id: str, ns: str, checkpoint_id: str | None) -> None:
        """Raise ``Fenced`` when a task started from ``checkpoint_id`` must not act: that
        checkpoint is in the thread's log, is not the latest of ``ns``, and no step of this
        saver's graph was built on it (the tool node asks before any tool runs)."""
        with self._thread_lock(thread_id):
            if checkpoint_id is not None:
                self._check_base(self._own(thread_id), thread_id, ns, checkpoint_id)

    def _refuse(self, thread_id: str, why: str) -> None:
        with self._lock:
            self._refused[thread_id] = why
            owned = self._owned.pop(thread_id, None)
        if owned is not None:
            owned.run.close()

    def finish_when_done(self, graph: G) -> G:
        """Record ``RUN_FINISHED`` when ``graph`` (compiled with this saver) ends a thread;
        returns ``graph``.

        ``succeeded`` once a checkpoint leaves nothing to run and nothing interrupted
        (LangGraph's own ``get_state(...).next`` and ``.interrupts``, so a breakpoint or an
        ``interrupt()`` is a pause, not an end); ``failed`` when a node raised an error the
        graph does not route to an error handler (runlog's own stops, ``Escalated``,
        ``Fenced`` and the like, leave the run to be resumed); ``cancelled`` when a person
        cancelled the run (``runlog cancel``). A finished thread is a finished run: a later
        write to it raises ``runlog.RunFinished``, so use this where a thread is one task
        with an end, not an open-ended conversation."""
        self._graph = graph
        return graph

    def _ended(self, thread_id: str, ns: str, checkpoint_id: str) -> None:
        """Finish the thread's run if the checkpoint just written ends the graph."""
        if self._graph is None or ns:
            return
        config: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }
        snap = self._graph.get_state(config)
        if snap.next or snap.interrupts:
            return
        if self._own(thread_id).run.state.open_calls:
            # A call nobody settled (a graph changed since it started no longer reaches it):
            # the run stays open, its call shown by ``runlog uncertain``, never "succeeded".
            log.warning("thread %s ended with open tool calls; its run stays open", thread_id)
            return
        values = snap.values if isinstance(snap.values, dict) else {}
        messages = values.get("messages") or []
        summary = str(getattr(messages[-1], "content", "")) if messages else ""
        self._finish(thread_id, "succeeded", summary[:SUMMARY_CHARS])

    def _failed(self, thread_id: str, writes: Sequence[tuple[str, Any]]) -> None:
        """Finish the thread's run failed if ``writes`` carry a node's error that ends the
        graph."""
        if self._graph is None or any(ch == ERROR_SOURCE_NODE for ch, _ in writes):
            return  # routed to the graph's error handler: the graph goes on
        for ch, exc in writes:
            if ch == ERROR and isinstance(exc, Exception):
                if isinstance(exc, RunlogError | GraphBubbleUp):
                    return  # runlog's stop or LangGraph's pause: the run is to be resumed
                self._finish(thread_id, "failed", f"{type(exc).__name__}: {exc}"[:SUMMARY_CHARS])
                return

    def _finish(self, thread_id: str, outcome: str, summary: str) -> None:
        with self._thread_lock(thread_id):
            owned = self._own(thread_id)
            try:
                owned.run.finish(outcome, summary)
            except Fenced as exc:
                self._refuse(thread_id, str(exc))
                raise

    def note_paused(
        self,
        thread_id: str,
        key: str,
        attempt: int,
        *,
        of: str,
        task: str,
        interrupt_id: str | None,
        slot: int | None = None,
    ) -> None:
        """Record that LangGraph paused attempt ``attempt`` of the call ``key`` (the tool
        node's call ``of``, in the task ``task``) inside its tool before the tool made any
        effect (``PAUSED_KEY``); ``interrupt_id`` names the tool's ``interrupt()`` that
        paused it, if one did, and ``slot`` the place its answer takes among the task's."""
        value: dict[str, Any] = {"key": key, "attempt": attempt}
        if interrupt_id is not None:
            value.update({"of": of, "task": task, "interrupt": interrupt_id, "slot": slot})
        self._note(thread_id, PAUSED_KEY, value)
        owned = self._own(thread_id)
        owned.paused[key] = attempt
        if interrupt_id is not None:
            owned.asked.setdefault(task, {})[interrupt_id] = (of, slot)

    def note_asked(
        self, thread_id: str, of: str, *, task: str, interrupt_id: str | None, slot: int | None
    ) -> None:
        """Record that runlog's question ``of`` was asked as the interrupt ``interrupt_id``
        of the task ``task`` (``ASKED_KEY``)."""
        if interrupt_id is None:
            return
        value = {"of": of, "task": task, "interrupt": interrupt_id, "slot": slot}
        self._note(thread_id, ASKED_KEY, value)
        self._own(thread_id).asked.setdefault(task, {})[interrupt_id] = (of, slot)

    def asked_by_tool(self, thread_id: str, key: str, task: str, answers: int | None) -> int:
        """How many of the task ``task``'s resume values the tool of the tool node's call
        ``key`` took: its ``interrupt()`` calls that paused the graph there and were answered
        (their slot is among the task's ``answers``; all of them where that is not known)."""
        held = self._own(thread_id).asked.get(task, {}).values()
        return sum(
            of == key and (answers is None or slot is None or slot < answers) for of, slot in held
        )

    def note_decided(self, thread_id: str, approval_id: str) -> None:
        """Record that a ``Command(resume=...)`` answered ``approval_id`` (``DECIDED_KEY``)."""
        self._note(thread_id, DECIDED_KEY, {"approval_id": approval_id})
        self._own(thread_id).decided.add(approval_id)

    def decided_by_resume(self, thread_id: str, key: str) -> builtins.list[str]:
        """The decided approvals about the call ``key`` that a ``Command(resume=...)``
        answered, in the order they were asked."""
        owned = self._own(thread_id)
        return [
            a.approval_id
            for a in owned.run.state.approvals.values()
            if a.idempotency_key == key
            and a.approval_id in owned.decided
            and a.approved is not None
        ]

    def _note(self, thread_id: str, key: str, value: dict[str, Any]) -> None:
        with self._thread_lock(thread_id):
            owned = self._own(thread_id)
            try:
                engine_of(owned.run).record(
                    EventType.MEMORY_WRITTEN,
                    key=key,
                    value=json.dumps(value, separators=(",", ":")),
                )
            except Fenced as exc:
                self._refuse(thread_id, str(exc))
                raise

    def paused_attempt(self, thread_id: str, key: str) -> int | None:
        """The attempt of ``key`` that LangGraph paused, if that is the call's latest."""
        owned = self._own(thread_id)
        call = owned.run.state.open_calls.get(key)
        if call is None or owned.paused.get(key) != call.attempt:
            return None
        return call.attempt

    def add_tools(self, tools: Iterable[Tool]) -> None:
        """Tools the threads' runs call (``RunlogToolNode`` adds its own). A call a crash
        left open is settled by the node that reaches it again, with these tools."""
        with self._lock:
            for t in tools:
                self._tools[t.name] = t
                for owned in self._owned.values():
                    engine_of(owned.run).tools[t.name] = t

    def run_for(self, thread_id: str) -> Run:
        """The thread's run, owned by this saver (opened, with recovery, on first use)."""
        return self._own(thread_id).run

    def call_scope(
        self, config: RunnableConfig, message_id: str | None, position: int, call_id: str
    ) -> str:
        """The key scope of the tool call at ``position`` in the AI message ``message_id``
        that the task running with ``config`` answers (``STEP_SCOPE``, or ``LEGACY_SCOPE``
        for a run whose log already holds calls under it)."""
        thread_id = str(config["configurable"]["thread_id"])
        owned = self._own(thread_id)
        if owned.legacy_keys:
            return f"{thread_id}{LEGACY_SCOPE}{call_id}"
        meta = config.get("metadata") or {}
        path = [str(p) for p in meta.get("langgraph_path", ())]
        # The node's name is left out, so a renamed node reaches the same keys; a task a
        # ``Send`` pushed is told apart from its siblings by its path.
        where = [
            owned.generation,
            _parent_ns(config),
            meta.get("langgraph_step"),
            message_id,
            path if path[:1] == [PUSH] else None,
            position,
        ]
        return f"{thread_id}{STEP_SCOPE}{json.dumps(where, separators=(',', ':'))}"

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
        owned = self._append(thread_id, record)
        owned.built_on.update({checkpoint["id"], record["checkpoint_id"]} - {None})
        self._ended(thread_id, record["ns"], checkpoint["id"])
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
        self._failed(str(conf["thread_id"]), writes)

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
    recorded. A call's key is bound to the thread, the task's step, node and path and the
    call's position in its AI message (``STEP_SCOPE``; never the model's tool-call id, which a
    model may repeat or omit), so a node re-executed after ``interrupt()``/resume, or in a new
    process after a crash, gets the recorded result back instead of running the tool again.
    A task started from a checkpoint another process has since moved past raises ``Fenced``
    before any tool runs. A call that started and never completed is settled when the node
    reaches it again: the tool's ``reconcile`` lookup, else its risk class
    (``safe``/``reversible`` retried with the same key, ``irreversible`` escalated to a
    person). Never re-run blindly. An escalated call pauses the graph with runlog's question
    as a LangGraph interrupt; ``Command(resume={"answer": ..., "by": ..., "note": ...})``
    records the person's decision (``ANSWERS``). A tool's own ``interrupt()`` ends its
    attempt with no effect; the re-executed node runs the next attempt (``PAUSED_KEY``).

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
        run = engine_of(self.saver.run_for(thread_id))
        # A task started from a checkpoint that another process has since moved past (two
        # resumers of one thread) must not act: the newer checkpoints did this step already.
        self.saver.check_latest(thread_id, _parent_ns(config), _task_checkpoint(config))
        out: list[ToolMessage] = []
        for position, tc in enumerate(ai.tool_calls):
            # A person's cancellation stops the graph before the call (``Cancelled``, once);
            # the run ends cancelled when the saver lets it go.
            run.check_cancelled()
            call_id = tc["id"] or ""
            name, args = tc["name"], dict(tc["args"])
            tool = self.tools.get(name)
            if tool is None:
                raise UnknownTool(f"the tool node has no tool {name!r}")
            args_json = canonical_json(args)
            scope = self.saver.call_scope(config, ai.id, position, call_id)
            key = run.idempotency_key(scope, name, args_json, 0)
            token = _BUBBLE.set([])
            ran: list[str] = []
            ran_token = _RAN.set(ran)
            try:
                # The questions a resume answered, asked again in their order so that
                # LangGraph hands each interrupt() below the answer that is its own.
                for approval_id in self.saver.decided_by_resume(thread_id, key):
                    interrupt(self._question(run, approval_id))
                while True:
                    try:
                        self._resume_paused(run, thread_id, key)
                        content = drive(
                            run,
                            execute_logical(
                                run, tool, args_json, key, call_id=call_id, operation_id=scope
                            ),
                        )
                        break
                    except Escalated as exc:
                        if exc.approval_id is None:
                            raise
                        self._ask(run, thread_id, exc.approval_id, config)
            except Fenced as exc:
                self.saver._refuse(thread_id, str(exc))
                raise
            except _Paused as paused:
                # Recorded by the call path as an interrupted attempt; the marker says it
                # made no effect, so the node re-executed on resume runs it again.
                self.saver.note_paused(
                    thread_id,
                    paused.key,
                    paused.attempt,
                    of=key,
                    task=_task_ns(config),
                    interrupt_id=_interrupt_id(paused.bubble),
                    slot=_answers(config),
                )
                raise paused.bubble from None
            except ToolFailed as exc:
                self._replay_asked(thread_id, key, config, ran)
                out.append(
                    ToolMessage(
                        content=f"Error: {exc}", name=name, tool_call_id=call_id, status="error"
                    )
                )
                continue
            finally:
                _RAN.reset(ran_token)
                _BUBBLE.reset(token)
            self._replay_asked(thread_id, key, config, ran)
            out.append(ToolMessage(content=content, name=name, tool_call_id=call_id))
        return {self.messages_key: out}

    def _replay_asked(
        self, thread_id: str, key: str, config: RunnableConfig, ran: builtins.list[str]
    ) -> None:
        """A call settled without its tool running in this execution (its result recorded
        before) lets its tool's answered interrupts take their resume values again, in its
        place: LangGraph hands a node's resume values to its ``interrupt()`` calls by their
        order, so the next call's question gets the answer that is its own. Each returns at
        once (its answer is among the task's resume values) and the answer is ignored. A
        pause nobody answered (the call was settled elsewhere meanwhile, e.g. by
        ``runlog reconcile``) took no resume value and is not asked again."""
        if ran:
            return  # the tool ran and asked again itself
        asked = self.saver.asked_by_tool(thread_id, key, _task_ns(config), _answers(config))
        for _ in range(asked):
            interrupt({"runlog": "answered", "idempotency_key": key})

    def _question(self, run: Engine, approval_id: str) -> dict[str, Any]:
        """runlog's question for ``approval_id`` as the value of a LangGraph interrupt: the
        tool, its arguments, the key, the evidence and what each answer does."""
        q = question(run.run_id, approval_id, tenant=run.tenant, settings=self.saver.settings)
        return {"runlog": "approval", "answers": list(ANSWERS), **q.to_dict()}

    def _ask(self, run: Engine, thread_id: str, approval_id: str, config: RunnableConfig) -> None:
        """Ask a person runlog's question as a LangGraph interrupt (the graph stops with it
        in ``result["__interrupt__"]``); once a ``Command(resume=...)`` answers it, record
        the answer as the person's decision. Signed with this process' decider key where
        deciders are configured; the first decision stands (one made meanwhile, e.g. with
        ``runlog approve``, is kept and this answer dropped). The question's place among
        the task's is noted (``ASKED_KEY``): a tool's unanswered question it replaces no
        longer holds that place."""
        try:
            answer = interrupt(self._question(run, approval_id))
        except GraphInterrupt as asked:
            self.saver.note_asked(
                thread_id,
                f"{APPROVAL_PLACE}{approval_id}",
                task=_task_ns(config),
                interrupt_id=_interrupt_id(asked),
                slot=_answers(config),
            )
            raise
        approved, by, note, undo = _decision(approval_id, answer)
        # Noted first: deciding goes on to settle the call, whose tool may pause the graph.
        self.saver.note_decided(thread_id, approval_id)
        with contextlib.suppress(DecisionConflict):  # the first stands: the call goes on by it
            run.decide(
                approval_id,
                approved=approved,
                decided_by=by,
                note=note,
                answer=UNDO_AND_RETRY if undo else None,
            )

    def _resume_paused(self, run: Engine, thread_id: str, key: str) -> None:
        """Run again the attempt LangGraph paused in this call's tool, or in the retry a
        person's "undo and retry" made of it: the paused attempt made no effect, so what
        allowed it (a lookup's absence, a person's approval, the call itself) still holds,
        and its next attempt runs under the same key without asking anyone again. Then
        the call path settles the call as usual (the retry's completion closes the call)."""
        call = run.state.open_calls.get(key)
        if call is None:
            return
        for candidate in (key, retry_key(run, call)):
            attempt_no = self.saver.paused_attempt(thread_id, candidate)
            if attempt_no is None:
                continue
            paused = run.state.open_calls[candidate]
            drive(
                run,
                attempt(
                    run,
                    run.tools[paused.name],
                    paused.args_json,
                    candidate,
                    call_id=paused.call_id,
                    attempt=attempt_no + 1,
                    operation_id=paused.operation_id,
                ),
            )


def _decision(approval_id: str, answer: Any) -> tuple[bool, str, str, bool]:
    """``(approved, decided_by, note, undo_and_retry)`` from a resume value
    ``{"answer": "approve" | "reject" | "undo_and_retry", "by": <who>, "note": <why>}``."""
    if not isinstance(answer, Mapping) or answer.get("answer") not in ANSWERS:
        raise ValidationFailed(
            f"approval {approval_id}: resume with {{'answer': one of {ANSWERS}, 'by': <who>, "
            f"'note': <why>}}, not {answer!r}"
        )
    by = answer.get("by")
    if not isinstance(by, str) or not by.strip():
        raise ValidationFailed(f"approval {approval_id}: the resume value names no decider ('by')")
    kind = answer["answer"]
    return kind != "reject", by, str(answer.get("note") or ""), kind == UNDO_AND_RETRY


class _Paused(BaseException):
    """LangGraph paused the graph inside a tool (``interrupt()``) before the tool made an
    effect. A BaseException, so that the call path records the attempt as interrupted and
    stops there (an Exception would count as an attempt of unknown outcome and be retried
    at once, where the tool could only pause again)."""

    def __init__(self, bubble: GraphBubbleUp, key: str, attempt: int) -> None:
        super().__init__(f"{type(bubble).__name__}: the tool paused the graph")
        self.bubble, self.key, self.attempt = bubble, key, attempt


def _parent_ns(config: RunnableConfig) -> str:
    """The checkpoint namespace the task runs in: its own namespace without its last part
    (``node:task-id``), which names the task and not the graph."""
    ns = str(config.get("configurable", {}).get("checkpoint_ns", ""))
    return ns.rpartition(NS_SEP)[0]


def _answers(config: RunnableConfig) -> int | None:
    """How many answers (resume values) the task running with ``config`` holds, or None
    where this LangGraph's scratchpad does not say."""
    resume = getattr(config.get("configurable", {}).get(SCRATCHPAD), "resume", None)
    return len(resume) if isinstance(resume, list) else None


def _task_ns(config: RunnableConfig) -> str:
    """The checkpoint namespace of the task itself (``node:task-id``, under its parents'),
    which LangGraph's ids of the task's interrupts are made from."""
    return str(config.get("configurable", {}).get("checkpoint_ns", ""))


def _task_checkpoint(config: RunnableConfig) -> str | None:
    """The id of the checkpoint the task was started from."""
    found = config.get("configurable", {}).get("checkpoint_map", {}).get(_parent_ns(config))
    return None if found is None else str(found)


_BUBBLE: ContextVar[list[GraphBubbleUp] | None] = ContextVar(
    "runlog_langgraph_bubble", default=None
)
"""Set while the tool node runs its calls: a tool's pause is the node's to record."""

_RAN: ContextVar[list[str] | None] = ContextVar("runlog_langgraph_ran", default=None)
"""Set while the tool node runs one call: the keys under which its tool was run."""


def _interrupt_id(bubble: GraphBubbleUp) -> str | None:
    """LangGraph's id of the ``interrupt()`` that raised ``bubble`` (None for a ``Command``
    bubbling up, which takes no resume value)."""
    if not isinstance(bubble, GraphInterrupt) or not bubble.args or not bubble.args[0]:
        return None
    return str(bubble.args[0][0].id)


def _interruptible(fn: ToolFn) -> ToolFn:
    """``fn`` with LangGraph's control flow (``interrupt()``, ``Command`` bubbling up) inside
    the tool node turned into ``_Paused``: the attempt made no effect and the node raises
    LangGraph's signal once the pause is recorded."""
    if is_async(fn):
        return fn  # an async tool's interrupt() is recorded as its exception says

    def call(args: dict[str, Any], *, idempotency_key: str, **fence: Any) -> Any:
        ran = _RAN.get()
        if ran is not None:
            ran.append(idempotency_key)
        try:
            return fn(args, idempotency_key=idempotency_key, **fence)
        except GraphBubbleUp as exc:
            ctx = current_call()
            if _BUBBLE.get() is None or ctx is None:
                raise
            raise _Paused(exc, idempotency_key, ctx.attempt) from exc

    # ``Tool`` reads the fence's arguments ``fn`` takes through ``__wrapped__``, so
    # ``fence`` holds exactly those.
    call.__wrapped__ = fn  # type: ignore[attr-defined]
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
