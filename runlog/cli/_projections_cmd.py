"""Projection services and their queries.

``runlog project state|uncertain|audit|all|notify`` runs the services; ``runlog state RUN_ID``,
``runlog uncertain``, ``runlog audit RUN_ID``, ``runlog quarantine`` and ``runlog metrics``
read them; ``runlog rebuild PROJECTION`` refolds one from offset zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import print_json
from runlog.cli._progress import progress_bar
from runlog.consumers import _projection_metrics as projection_metrics
from runlog.consumers import _queries as queries
from runlog.consumers._notify import hook_from_settings
from runlog.consumers.runner import ProjectionRunner, rebuild, streaming_gc
from runlog.consumers.stores import KNOWN, NOTIFY, PROJECTIONS
from runlog.errors import ConfigError, UnknownRun
from runlog.log._clients import redis_client
from runlog.log._holders import status_now
from runlog.projections._run_state import RunState

# ``all`` is every projection a deployment needs: the approvals a person is asked for
# (``notify``) included, or ``runlog approvals`` stays empty.
_ALL = (*PROJECTIONS, *((NOTIFY,) if NOTIFY not in PROJECTIONS else ()))
# Each registered projection (those ``all`` runs first, then the ones that run on their own).
_CHOICES = (*_ALL, "all", *(name for name in KNOWN if name not in _ALL))
_STATUS = "status"


def _names(choice: str) -> tuple[str, ...]:
    return _ALL if choice == "all" else (choice,)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "project",
        help="run projection services (state, uncertain calls, audit) until SIGTERM/SIGINT",
        description=(
            "Consume the events topic as a consumer-group member and keep a projection in "
            "Redis, exactly once per record. `all` runs the three projections off one "
            "consumer (one fetch and one decode per record, a separate position each). "
            "`notify` keeps the approvals waiting for a person and delivers one "
            "notification per approval requested to --webhook."
        ),
    )
    p.add_argument(
        "projection",
        choices=(*_CHOICES, _STATUS),
        help="a projection, all of them, or status: each projection's position, lag, "
        "quarantined records and runs folded without a key (sealed: no key)",
    )
    p.add_argument("--json", action="store_true", help="status only: as JSON")
    p.add_argument(
        "--webhook",
        default=None,
        metavar="URL",
        help="notify only: POST a notification per approval requested to URL (default "
        "RUNLOG_NOTIFY_WEBHOOK_URL; neither: they are queued and listed, not delivered)",
    )
    p.add_argument("--group", default=None, help="consumer group (default: derived)")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at 127.0.0.1:PORT/metrics",
    )
    p.set_defaults(func=_project)

    for name, help_, func in (
        ("state", "a run's state projection", _state),
        ("audit", "a run's audit trail", _audit),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run_id")
        p.add_argument(
            "--tenant",
            default="default",
            help="the run's tenant (another tenant's run is not found, exit 4)",
        )
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)

    p = sub.add_parser("uncertain", help="the uncertain-call queue, with ages and overdue calls")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--tenant",
        default=None,
        help="only this tenant's calls (default: every tenant's); the counters, kept for all "
        "tenants, are then not shown",
    )
    p.add_argument(
        "--deadline",
        action="append",
        default=[],
        type=_deadline,
        metavar="RISK=SECONDS",
        help="overdue deadline per risk class (default irreversible=900 reversible=3600 "
        "safe=14400)",
    )
    p.set_defaults(func=_uncertain)

    p = sub.add_parser("quarantine", help="records the projections could not decode")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_quarantine)

    p = sub.add_parser(
        "rebuild",
        help="delete a projection and refold it from offset zero to today's end of the log",
        description="Running services of the projection are fenced: they pause while the "
        "rebuild runs and continue from the rebuilt positions when it is done. A rebuild "
        "that dies leaves the projection marked incomplete: the services do not resume on "
        "it, the first one to see it completes the rebuild from zero (as does this command).",
    )
    p.add_argument("projection", choices=_CHOICES)
    p.set_defaults(func=_rebuild)

    p = sub.add_parser("metrics", help="projection lag, applied/quarantined records, queue gauges")
    p.add_argument("--json", action="store_true", help="JSON (default: Prometheus text)")
    p.add_argument("--projection", choices=_CHOICES, default="all")
    p.set_defaults(func=_metrics)


def _redis(settings: Settings) -> Any:

    return redis_client(settings)


def _warn_incomplete(client: Any, settings: Settings, names: tuple[str, ...]) -> None:
    """Say so on stderr when what is about to be shown is a dead rebuild's half-work."""
    for name in queries.incomplete(client, settings, names):
        print(
            f"runlog: WARNING: the {name} projection is incomplete (a rebuild died before it "
            "finished); a running `runlog project` completes it, or run `runlog rebuild "
            f"{name}`",
            file=sys.stderr,
        )


def _project(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    if args.projection == _STATUS:
        return _status(settings, client, args.json)
    if args.json:
        raise ConfigError("--json goes with `runlog project status`")
    logging.getLogger().setLevel(logging.INFO)  # a service's log: what it did, as it goes
    streaming_gc()
    names = _names(args.projection)
    hook = None
    if args.webhook is not None and NOTIFY not in names:
        raise ConfigError("--webhook goes with `runlog project notify` (or `all`)")
    if NOTIFY in names:
        hook = hook_from_settings(settings, args.webhook)
        if hook is None:
            logging.getLogger("runlog.project").warning(
                "no webhook (--webhook or RUNLOG_NOTIFY_WEBHOOK_URL): notifications are "
                "queued and listed by `runlog approvals`, not delivered"
            )
    runner = ProjectionRunner(
        settings, client, names, group=args.group, batch_size=args.batch_size, notify=hook
    )

    def on_signal(signum: int, _frame: Any) -> None:
        logging.getLogger("runlog.project").info("signal %s: stopping after this batch", signum)
        runner.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = None
    marks = None
    if args.metrics_port is not None:
        marks = projection_metrics.Watermarks(settings)

        def produce() -> projection_metrics.Families:
            assert marks is not None
            snap = projection_metrics.collect(client, settings, names, marks.high)
            stats = {"applied": dict(runner.stats.applied), "lag": dict(runner.stats.lag)}
            return projection_metrics.families(snap, stats)

        server, _ = projection_metrics.serve(args.metrics_port, produce)
    try:
        runner.run()
    finally:
        if server is not None:
            server.shutdown()
        if marks is not None:
            marks.close()
        client.close()
    return 0


def _state(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    _warn_incomplete(client, settings, ("state",))
    view = queries.get_state(client, settings, args.run_id, tenant=args.tenant)
    if view is None:  # not in the state projection: not found, as another tenant's run
        raise UnknownRun(f"run {args.run_id} is not in the state projection", run_id=args.run_id)
    told = status_now(client, settings, RunState.from_dict(view["state"]))
    if args.json:
        print_json({**view, **told.to_dict()})
        return 0
    st = view["state"]
    print(f"run        {st['run_id']}  (tenant {st['tenant']})")
    print(f"status     {told.text()}  outcome={st['outcome']}")
    print(f"seq/epoch  {st['seq']} / {st['epoch']}  (max epoch seen {st['max_epoch_seen']})")
    print(f"turns      {st['turns']}  tokens in/out {st['input_tokens']}/{st['output_tokens']}")
    print(f"cost       ${st['cost_usd']:.6f}")
    print(
        f"calls      completed {len(st['completed_calls'])}  open {len(st['open_calls'])}"
        f"  retries {st['retries']}  denials {st['denials']}"
    )
    print(f"compactions {st['compactions']}  resumptions {st['resumptions']}")
    print(f"fenced     {st['fenced_writes']} write(s) rejected by the ownership rule")
    print(f"last event {st['last_event_at']}")
    print(f"log        partition {view['partition']} first offset {view['first_offset']}")
    if view.get("sealed"):
        print(
            f"sealed     {view['sealed']}: the projection service had no key store; its "
            "content reads erased here (the log still holds it sealed)"
        )
    if view["quarantined"]:
        print(f"QUARANTINED {len(view['quarantined'])} record(s):")
        for q in view["quarantined"]:
            print(f"    partition {q['partition']} offset {q['offset']}: {q['error']}")
    return 0


def _deadline(item: str) -> tuple[str, float]:
    """``--deadline RISK=SECONDS``; argparse reports a malformed one as a usage error."""
    risk, sep, secs = item.partition("=")
    if not sep or risk not in ("safe", "reversible", "irreversible"):
        raise argparse.ArgumentTypeError(f"wants RISK=SECONDS with a risk class, not {item!r}")
    try:
        return risk, float(secs)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{item!r}: {secs!r} is not a number") from exc


def _uncertain(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    _warn_incomplete(client, settings, ("uncertain",))
    rep = queries.uncertain_report(
        client, settings, deadlines_s=dict(args.deadline), tenant=args.tenant
    )
    if args.json:
        print_json(rep.to_dict())
        return 0
    c = rep.counters
    if args.tenant is not None:
        print(f"tenant {args.tenant}: still open {len(rep.open)}")
    else:
        print(
            f"opened {c.get('opened', 0)}  reconciled {c.get('reconciled', 0)}  "
            f"retried {c.get('retried', 0)}  decided {c.get('decided', 0)}  "
            f"failed {c.get('failed', 0)}  escalated {c.get('escalated', 0)}  "
            f"still open {len(rep.open)}"
        )
    for risk, age in sorted(rep.oldest_age_s.items()):
        print(f"oldest {risk}: {age:.0f}s")
    for call in rep.open:
        flag = "OVERDUE " if call["overdue"] else ""
        print(
            f"{flag}{call['status']:<9} {call['risk']:<12} age {call['age_s']:>8.0f}s  "
            f"{call['run_id']} {call['tool']} key={call['idempotency_key']} "
            f"attempts={call['attempts']} evidence={call['last_evidence'] or '-'}"
        )
    return 0


def _audit(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    _warn_incomplete(client, settings, ("audit",))
    entries = queries.get_audit(client, settings, args.run_id, tenant=args.tenant)
    if not entries:  # not in the audit projection: not found, as another tenant's run
        raise UnknownRun(f"no audit entries for run {args.run_id}", run_id=args.run_id)
    if args.json:
        print_json(entries)
        return 0
    for e in entries:
        rest = {
            k: v
            for k, v in e.items()
            if k not in ("kind", "at", "seq", "epoch", "partition", "offset")
            and v not in (None, "")
        }
        detail = " ".join(f"{k}={v}" for k, v in sorted(rest.items()))
        print(f"{e.get('at', '-')} seq={e.get('seq', '-')} {e['kind']:<18} {detail}")
    return 0


def _quarantine(args: argparse.Namespace) -> int:

    settings = Settings()
    recs = queries.quarantined(_redis(settings), settings)
    if args.json:
        print_json(recs)
        return 0
    for r in recs:
        print(
            f"{r['topic']}[{r['partition']}]@{r['offset']} run={r['run_id']} "
            f"{r['error']}: {r['message']}  ({', '.join(r['projections'])})"
        )
    print(f"{len(recs)} quarantined record(s)", file=sys.stderr)
    return 0


def _status(settings: Settings, client: Any, as_json: bool) -> int:
    """Each projection's progress; a run folded without a key is counted, not hidden."""
    marks = projection_metrics.Watermarks(settings)
    try:
        snap = projection_metrics.collect(client, settings, _ALL, marks.high)
    finally:
        marks.close()
        client.close()
    if as_json:
        print_json(snap)
        return 0
    print(f"topic {snap['topic']}")
    for name, body in snap["projections"].items():
        line = (
            f"{name:<10} lag {body['lag']:>6}  applied {body['applied']:>8}  "
            f"quarantined {body['quarantined']}  sealed: no key {body['sealed_runs']} run(s)"
        )
        if body["rebuild_incomplete"]:
            line += "  REBUILD INCOMPLETE"
        print(line)
    return 0


def _rebuild(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    names = _names(args.projection)
    try:
        targets = rebuild(
            client, settings, names, progress=progress_bar(f"rebuild {args.projection}")
        )
    finally:
        client.close()
    print(f"rebuilt {', '.join(names)} up to {json.dumps(targets, sort_keys=True)}")
    return 0


def _metrics(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _redis(settings)
    marks = projection_metrics.Watermarks(settings)
    try:
        snap = projection_metrics.collect(client, settings, _names(args.projection), marks.high)
    finally:
        marks.close()
        client.close()
    if args.json:
        print_json(snap)
    else:
        sys.stdout.write(projection_metrics.to_prometheus(snap))
    return 0
