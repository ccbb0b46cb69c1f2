"""``runlog start`` / ``runlog worker`` / ``runlog workers`` / ``runlog resume``: the fleet
(docs/concepts/fleet.md)."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from runlog import _api as api
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.cli._groups import EXIT_OK, EXIT_USAGE, print_json
from runlog.consumers.runner import streaming_gc
from runlog.errors import NoLiveWorker
from runlog.fleet import _registry as registry
from runlog.fleet._requests import request_start, serving
from runlog.fleet._worker import Worker, live_workers, new_worker_id
from runlog.log._clients import redis_client


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "start",
        help="request a run of a registered agent (returns its run id at once)",
        description=(
            "Records a durable start request; whichever `runlog worker` owns the run's "
            "partition starts it. A --run-id that already has a log is answered from it: "
            "the same agent's is one run (already started or finished, nothing new is "
            "requested), another agent's or another tenant's is refused (exit 1, nothing "
            "written). Warns at once when no live worker serves the agent."
        ),
    )
    p.add_argument("agent")
    p.add_argument("--input", default="null", help="the agent's input, JSON (default null)")
    p.add_argument("--tenant", default="default")
    p.add_argument("--run-id", dest="run_id", default=None)
    p.add_argument(
        "--require-worker",
        action="store_true",
        help="refuse (exit 1, nothing written) when no live worker serves the agent",
    )
    p.add_argument("--by", default=None, help="who asks (default: user@host)")
    p.set_defaults(func=_start)

    p = sub.add_parser(
        "worker",
        help="execute registered agents: dispatched by the consumer group, orphans resumed",
        description=(
            "Imports the --agents modules (their @runlog.agent functions), joins the fleet's "
            "consumer group and runs the runs of its partitions: requested ones, orphans "
            "whose worker died, and waiting ones when their timer or decision comes. "
            "SIGTERM or ^C: stop taking runs, give the partitions up at once, let each "
            "running run finish its step and hand it over to another worker (at most "
            "--drain-s, default RUNLOG_WORKER_DRAIN_S), exit."
        ),
    )
    p.add_argument("--agents", action="append", required=True, help="module to import (repeat)")
    p.add_argument("--concurrency", type=int, default=8, help="runs executed at once")
    p.add_argument("--id", dest="worker_id", default=None, help="worker id (default host:pid)")
    p.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="longest drain after SIGTERM (default: RUNLOG_WORKER_DRAIN_S, 20 s)",
    )
    p.add_argument(
        "--ready-file",
        default=None,
        help="a file made once the worker is ready and removed when it starts to drain "
        "(a Kubernetes readiness probe: `test -f FILE`)",
    )
    p.set_defaults(func=_worker)

    p = sub.add_parser(
        "workers", help="the live workers: id, host, pid, runs held, since, the agents they serve"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_workers)

    p = sub.add_parser(
        "resume",
        help="dispatch a run of the fleet now (e.g. after a fix was deployed)",
        description=(
            "Writes `open` to the run's lifecycle record: the worker that owns its partition "
            "dispatches it at once (a run held by a live worker is tried when its lease frees)."
        ),
    )
    p.add_argument("run_id")
    p.add_argument("--tenant", default="default")
    p.set_defaults(func=_resume)


def _start(args: argparse.Namespace) -> int:
    try:
        value: Any = json.loads(args.input)
    except ValueError as exc:
        print(f"runlog: --input is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    services = Services.shared(Settings())
    settings, client = services.settings, services.redis
    served = serving(client, settings, args.agent)
    if not served and args.require_worker:
        raise NoLiveWorker(
            f"no live worker serves agent {args.agent!r} (`runlog workers`): nothing requested",
            agent=args.agent,
        )
    answer = request_start(
        settings,
        client,
        args.agent,
        value,
        tenant=args.tenant,
        run_id=args.run_id,
        requested_by=args.by or f"{getpass.getuser()}@{socket.gethostname()}",
    )
    print(answer.run_id)
    if answer.status != "requested":
        print(
            f"runlog: run {answer.run_id} {answer.status}: its log decides, nothing new was "
            "requested",
            file=sys.stderr,
        )
    elif not served:
        print(
            f"runlog: warning: no live worker serves agent {args.agent!r} (`runlog workers`): "
            "the run waits until one that registers it joins",
            file=sys.stderr,
        )
    return EXIT_OK


def _worker(args: argparse.Namespace) -> int:
    settings = Settings()
    agents = registry.load(args.agents)
    wid = args.worker_id or new_worker_id()
    services = Services(settings, writer_id=wid)
    worker = Worker(
        settings, services.run_deps(), agents, concurrency=args.concurrency, worker_id=wid
    )

    ready = Path(args.ready_file) if args.ready_file else None

    def stop(_sig: int, _frame: Any) -> None:
        if ready is not None:
            ready.unlink(missing_ok=True)  # not ready while it drains
        worker.stop()

    def on_ready() -> None:
        if ready is not None:
            ready.write_text(f"{wid}\n")
        print("worker ready", flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("runlog.fleet").setLevel(logging.INFO)
    streaming_gc()  # its agents' frameworks are loaded: full collections would walk them
    print(
        f"worker {wid} agents={','.join(sorted(agents))} concurrency={args.concurrency}",
        flush=True,
    )
    try:
        worker.run(drain_s=args.drain_s, on_ready=on_ready)
    finally:
        if ready is not None:
            ready.unlink(missing_ok=True)
        services.close()
    print(f"worker {wid} stopped: {worker.stats}", flush=True)
    return EXIT_OK


def _workers(args: argparse.Namespace) -> int:
    settings = Settings()
    found = live_workers(redis_client(settings), settings)
    if args.json:
        print_json(found)
        return EXIT_OK
    if not found:
        print("no live worker (start one with `runlog worker --agents MODULE`)")
        return EXIT_OK
    print(f"{'id':40} {'host':20} {'pid':>7} {'runs held':>9}  {'since':32}  agents")
    for w in found:
        print(
            f"{w.get('id', ''):40} {w.get('host', ''):20} {w.get('pid', ''):>7} "
            f"{w.get('runs_held', ''):>9}  {w.get('since', ''):32}  {w.get('agents', '')}"
        )
    return EXIT_OK


def _resume(args: argparse.Namespace) -> int:
    status = api.resume(args.run_id, tenant=args.tenant)
    print(f"run {args.run_id} ({status}) dispatched to the fleet")
    return EXIT_OK
