"""8. A durable step, side by side: runlog, LangGraph and DBOS, against the physical floor.

What a user choosing a durable-execution layer for an agent's tool calls would time: a loop
of N steps, each recorded durably before the next, each calling a tool that returns a
300-byte string. Every system runs in this process, in the same sitting, on this machine:

* ``raw_produce_flush``: one 400-byte record produced and flushed (acks=all, idempotent):
  one broker round trip, the floor of any Kafka-backed durable step;
* ``redis_get``: one Redis round trip;
* ``runlog_safe`` / ``runlog_irreversible``: ``Run.call_tool`` of a safe / an irreversible
  tool (STARTED and COMPLETED, with the barriers and ownership checks the risk class needs);
* ``runlog_aio_safe`` / ``runlog_aio_irreversible``: the same step through ``runlog.aio``
  (``await run.call_tool`` of an ``async def`` tool, one event loop);
* ``langgraph_sync`` / ``langgraph_sync_growing``: a LangGraph graph looping one node per
  step with ``SqliteSaver`` and ``durability="sync"``, state of constant size / growing by
  the 300-byte result each step (the ``peers`` extra);
* ``langgraph_runlog`` / ``langgraph_runlog_growing``: the same graph with runlog's
  checkpointer (``runlog.integrations.langgraph.RunlogSaver``) instead of ``SqliteSaver``;
* ``langgraph_postgres`` / ``langgraph_postgres_growing``: the same graph with LangGraph's
  ``PostgresSaver`` (``langgraph-checkpoint-postgres``), measured only when
  ``RUNLOG_BENCH_POSTGRES_URL`` names a Postgres server to use (the result says why not);
* ``dbos_step``: a DBOS workflow calling one ``@DBOS.step`` per step on SQLite;
* ``restate``: Restate's Rust server and a Python handler making one ``ctx.run`` per step, in
  processes of their own (``tools/benchmarks/restate_peer.py``): one run of N steps, and the
  ``fanout`` shape below as ``runs`` invocations at once, with the CPU of each process;
* ``openai_agents_*`` / ``pydantic_ai_*``: an agent framework's step (a model turn and its
  tool call), the framework alone and on runlog (``tools/benchmarks/frameworks.py``).

Per system: wall time per step (median over repeats) and process CPU per step.

``fanout``: 100 runs making irreversible calls at once, driven from one event loop
(``runlog.aio``) and from 100 threads (the sync API), and safe calls from one event loop:
events and steps per second, process CPU per event and per step. The event loop's shapes
run twice: at Python's collector defaults (a library in its host's process) and with the
thresholds a worker process sets (``runlog worker``: ``streaming_gc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import operator
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

from confluent_kafka import Producer

import runlog
from runlog._settings import Settings
from runlog.consumers.runner import streaming_gc
from runlog.log._clients import async_redis_client, redis_client
from runlog.producers._async_run import open_async
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.producers._tools import Risk
from runlog.producers._writer import producer_config
from tools.benchmarks import frameworks, restate_peer
from tools.benchmarks.common import TENANT, summary

RESULT = "r" * 300
RECORD = b"x" * 400

Loop = Callable[[int], None]


def _timed(loop: Loop, n: int) -> tuple[float, float]:
    """``(wall seconds per step, process CPU seconds per step)`` of ``loop(n)``."""
    w0, c0 = time.perf_counter(), time.process_time()
    loop(n)
    return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n


def _raw(settings: Settings) -> Iterator[Loop]:
    producer = Producer(producer_config(settings, {"linger.ms": "0"}))
    key = uuid.uuid4().hex.encode()

    def loop(n: int) -> None:
        for _ in range(n):
            producer.produce(settings.events_topic, value=RECORD, key=key)
            producer.flush(30)

    yield loop


def _redis(settings: Settings) -> Iterator[Loop]:
    client = redis_client(settings)
    client.set("runlog-bench-get", "x")

    def loop(n: int) -> None:
        for _ in range(n):
            client.get("runlog-bench-get")

    try:
        yield loop
    finally:
        client.close()


def _runlog_aio(deps: RunDeps, settings: Settings, risk: Risk) -> Iterator[Loop]:
    async def lookup(args: dict[str, Any], *, idempotency_key: str) -> str:
        return RESULT

    tool = runlog.tool("lookup", risk=risk)(lookup)
    ev = asyncio.new_event_loop()
    aredis = async_redis_client(settings)
    run = ev.run_until_complete(
        open_async(deps, aredis, None, tenant=TENANT, tools=[tool], recover=False)
    )

    async def steps(n: int) -> None:
        for i in range(n):
            await run.call_tool("lookup", {"i": i, "u": uuid.uuid4().hex})

    def loop(n: int) -> None:
        ev.run_until_complete(steps(n))

    try:
        yield loop
    finally:
        ev.run_until_complete(run.close())
        ev.run_until_complete(aredis.aclose())
        ev.close()


def fanout(deps: RunDeps, settings: Settings, *, runs: int, calls: int) -> dict[str, Any]:
    """``runs`` runs each making ``calls`` irreversible calls at once: from one event loop
    and from one thread per run; and ``event_loop_safe``, safe calls from one event loop.
    Events/s, steps (calls)/s and process CPU (ms) per event and per step of each."""

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        return RESULT

    async def apay(args: dict[str, Any], *, idempotency_key: str) -> str:
        return RESULT

    steps = runs * calls
    events = steps * 2  # STARTED and COMPLETED, of either risk

    def figures(wall: float, cpu: float) -> dict[str, float]:
        return {
            "events_per_s": events / wall,
            "cpu_ms_per_event": cpu / events * 1000,
            "steps_per_s": steps / wall,
            "cpu_ms_per_step": cpu / steps * 1000,
        }

    out: dict[str, Any] = {"runs": runs, "calls_per_run": calls}

    # Threads: every run opened first, then released together.
    tool = runlog.tool("pay", risk="irreversible")(pay)
    opened = [
        open_run_with(deps, None, tenant=TENANT, tools=[tool], recover=False) for _ in range(runs)
    ]
    gate = threading.Barrier(runs + 1)

    def work(run: Any) -> None:
        gate.wait()
        for i in range(calls):
            run.call_tool("pay", {"i": i})

    threads = [threading.Thread(target=work, args=(r,)) for r in opened]
    for t in threads:
        t.start()
    w0, c0 = time.perf_counter(), time.process_time()
    gate.wait()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    for r in opened:
        r.close()
    out["threads"] = figures(wall, cpu)

    async def main(risk: Risk) -> tuple[float, float]:
        atool = runlog.tool("pay", risk=risk)(apay)
        aredis = async_redis_client(settings)
        aruns = await asyncio.gather(
            *(
                open_async(deps, aredis, None, tenant=TENANT, tools=[atool], recover=False)
                for _ in range(runs)
            )
        )

        async def awork(run: Any) -> None:
            for i in range(calls):
                await run.call_tool("pay", {"i": i})

        w0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(awork(r) for r in aruns))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        await asyncio.gather(*(r.close() for r in aruns))
        await aredis.aclose()
        return wall, cpu

    out["event_loop"] = figures(*asyncio.run(main("irreversible")))
    out["event_loop_safe"] = figures(*asyncio.run(main("safe")))
    # A worker process (``runlog worker``) runs with the collector thresholds of a runlog
    # process (``streaming_gc``); this one holds the peers measured before (their modules,
    # their state), which a full collection at Python's defaults walks at every step's cost.
    was = gc.get_threshold()
    streaming_gc()
    try:
        out["event_loop_worker_gc"] = figures(*asyncio.run(main("irreversible")))
        out["event_loop_safe_worker_gc"] = figures(*asyncio.run(main("safe")))
    finally:
        gc.set_threshold(*was)
    return out


def _runlog(deps: RunDeps, risk: str) -> Iterator[Loop]:
    tool = runlog.tool("lookup", risk=risk)(lambda args, *, idempotency_key: RESULT)  # type: ignore[arg-type]
    with open_run_with(deps, None, tenant=TENANT, tools=[tool], recover=False) as run:

        def loop(n: int) -> None:
            for i in range(n):
                run.call_tool("lookup", {"i": i, "u": uuid.uuid4().hex})

        yield loop


class Constant(TypedDict):
    """LangGraph state of constant size: the last result replaces the previous one."""

    i: int
    n: int
    last: str


class Growing(TypedDict):
    """LangGraph state that grows by each step's result (a transcript, say)."""

    i: int
    n: int
    results: Annotated[list[str], operator.add]


POSTGRES_URL_ENV = "RUNLOG_BENCH_POSTGRES_URL"


def postgres_url() -> tuple[str | None, str]:
    """The Postgres server the LangGraph ``PostgresSaver`` rows use, or why there is none."""
    if importlib.util.find_spec("langgraph.checkpoint.postgres") is None:
        return None, "not measured: pip install langgraph-checkpoint-postgres 'psycopg[binary]'"
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        return None, f"not measured: set {POSTGRES_URL_ENV} to a Postgres server to use"
    return url, ""


@contextlib.contextmanager
def _postgres_saver(url: str) -> Iterator[Any]:
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()
        yield saver


def _langgraph(
    growing: bool, settings: Settings | None = None, postgres: str | None = None
) -> Iterator[Loop]:
    """The LangGraph loop on ``SqliteSaver``, on runlog's checkpointer with ``settings``, or
    on ``PostgresSaver`` with a ``postgres`` URL."""
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    from runlog.integrations.langgraph import RunlogSaver

    def step_constant(state: Constant) -> dict[str, Any]:
        return {"i": state["i"] + 1, "last": RESULT}

    def step_growing(state: Growing) -> dict[str, Any]:
        return {"i": state["i"] + 1, "results": [RESULT]}

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        conn = sqlite3.connect(str(Path(tmp) / "lg.sqlite"), check_same_thread=False)
        saver: Any
        if postgres is not None:
            saver = stack.enter_context(_postgres_saver(postgres))
        elif settings is not None:
            saver = RunlogSaver(settings=settings)
        else:
            saver = SqliteSaver(conn)
        graph: Any = StateGraph(Growing if growing else Constant)
        graph.add_node("step", step_growing if growing else step_constant)
        graph.add_edge(START, "step")
        graph.add_conditional_edges("step", lambda s: END if s["i"] >= s["n"] else "step")
        app = graph.compile(checkpointer=saver)

        def loop(n: int) -> None:
            config = {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": n + 10}
            start: dict[str, Any] = {"i": 0, "n": n}
            if growing:
                start["results"] = []
            else:
                start["last"] = ""
            app.invoke(start, config, durability="sync")

        try:
            yield loop
        finally:
            if isinstance(saver, RunlogSaver):
                saver.close()
            conn.close()


def _dbos() -> Iterator[Loop]:
    from dbos import DBOS

    with tempfile.TemporaryDirectory() as tmp:
        DBOS(
            config={
                "name": f"runlog-bench-{os.getpid()}",
                "system_database_url": f"sqlite:///{Path(tmp) / 'dbos.sqlite'}",
                "log_level": "WARNING",
            }
        )

        @DBOS.step()  # type: ignore[untyped-decorator,misc,unused-ignore]  # untyped without the peers extra
        def lookup(i: int) -> str:
            return RESULT

        @DBOS.workflow()  # type: ignore[untyped-decorator,misc,unused-ignore]
        def loop_workflow(n: int) -> int:
            for i in range(n):
                lookup(i)
            return n

        DBOS.launch()

        def loop(n: int) -> None:
            loop_workflow(n)

        try:
            yield loop
        finally:
            DBOS.destroy()


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def peers_installed() -> bool:
    return all(_installed(m) for m in ("dbos", "langgraph.checkpoint.sqlite"))


def measure(
    deps: RunDeps,
    settings: Settings,
    *,
    n: int,
    repeats: int,
    fanout_runs: int = 100,
    fanout_calls: int = 10,
) -> dict[str, Any]:
    systems: dict[str, Callable[[], contextlib.AbstractContextManager[Loop]]] = {
        "raw_produce_flush": contextlib.contextmanager(lambda: _raw(settings)),
        "redis_get": contextlib.contextmanager(lambda: _redis(settings)),
        "runlog_safe": contextlib.contextmanager(lambda: _runlog(deps, "safe")),
        "runlog_irreversible": contextlib.contextmanager(lambda: _runlog(deps, "irreversible")),
        "runlog_aio_safe": contextlib.contextmanager(lambda: _runlog_aio(deps, settings, "safe")),
        "runlog_aio_irreversible": contextlib.contextmanager(
            lambda: _runlog_aio(deps, settings, "irreversible")
        ),
    }
    out: dict[str, Any] = {"steps_per_repeat": n, "systems": {}}
    missing = [m for m in ("langgraph.checkpoint.sqlite", "dbos") if not _installed(m)]
    if "langgraph.checkpoint.sqlite" not in missing:
        systems["langgraph_sync"] = contextlib.contextmanager(lambda: _langgraph(False))
        systems["langgraph_sync_growing"] = contextlib.contextmanager(lambda: _langgraph(True))
        # The same graph with runlog's checkpointer: each thread a fenced run, each
        # checkpoint an acknowledged append (runlog.integrations.langgraph).
        systems["langgraph_runlog"] = contextlib.contextmanager(lambda: _langgraph(False, settings))
        systems["langgraph_runlog_growing"] = contextlib.contextmanager(
            lambda: _langgraph(True, settings)
        )
        pg, why_not = postgres_url()
        if pg is not None:
            systems["langgraph_postgres"] = contextlib.contextmanager(
                lambda: _langgraph(False, postgres=pg)
            )
            systems["langgraph_postgres_growing"] = contextlib.contextmanager(
                lambda: _langgraph(True, postgres=pg)
            )
        else:
            out["postgres"] = why_not
    if "dbos" not in missing:
        systems["dbos_step"] = contextlib.contextmanager(_dbos)
    if missing:
        out["peers"] = f"not measured: {', '.join(missing)} (pip install -e '.[peers]')"
    # Agent frameworks alone and on runlog (benchmarks/frameworks.py), where installed.
    systems.update(frameworks.systems(settings))
    walls: dict[str, list[float]] = {k: [] for k in systems}
    cpus: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(repeats):
        for name, make in systems.items():
            with make() as loop:
                loop(min(20, n))  # warm up: connections, schema lookups, first compile
                wall, cpu = _timed(loop, n)
            walls[name].append(wall * 1000)
            cpus[name].append(cpu * 1000)
    for name in systems:
        out["systems"][name] = {
            "ms_per_step": summary(walls[name]),
            "cpu_ms_per_step": summary(cpus[name]),
        }
    out["fanout"] = fanout(deps, settings, runs=fanout_runs, calls=fanout_calls)
    # Restate's server and SDK process beside this one, both shapes (or why not).
    out["restate"] = restate_peer.measure(
        n=n, repeats=repeats, runs=fanout_runs, steps_per_run=fanout_calls
    )
    return out
