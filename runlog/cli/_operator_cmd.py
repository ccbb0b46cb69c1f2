"""The operator's view: ``runlog runs`` (the run index), ``runlog show`` (a run's story) and
``runlog ui`` (the web console, an optional extra)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import print_json
from runlog.consumers._index import STATUSES, RunIndex, RunRow, age_text, parse_since
from runlog.consumers._question import question
from runlog.consumers._timeline import run_timeline
from runlog.errors import ConfigError, KafkaUnavailable, UnknownRun
from runlog.fleet._requests import Requested, requested
from runlog.log._clients import redis_client
from runlog.log._holders import status_now
from runlog.log._kafka import live_groups, unreachable
from runlog.log._reader import LogReader
from runlog.projections._run_state import RunState
from runlog.schemas._keys import check_run_id


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "runs",
        help="list runs from the run index (kept by `runlog project state`)",
        description="Runs, most recently active first, from the index the state projection "
        "keeps in Redis (never a scan of the topic). Pages with --cursor.",
    )
    p.add_argument("--tenant", action="append", default=None, help="only this tenant (repeat)")
    p.add_argument(
        "--status",
        choices=(*STATUSES, "requested"),
        default=None,
        help="only runs of this status; `requested`: start requests with no log yet",
    )
    p.add_argument(
        "--since",
        default=None,
        help="only runs with an event at or after this time: ISO 8601, or an age "
        "(90s, 15m, 2h, 7d)",
    )
    p.add_argument("--limit", type=int, default=50, help="runs per page (default 50)")
    p.add_argument("--cursor", default=None, help="continue after the page that printed it")
    p.add_argument("--all", action="store_true", help="every page, not just the first")
    p.add_argument(
        "--forked-from",
        default=None,
        metavar="RUN",
        help="only the forks of RUN (of the --tenant given, default 'default')",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs)

    p = sub.add_parser(
        "show",
        help="a run's history as a timeline, read from the log",
        description="Every record of the run in log order: model turns, tool calls (key, "
        "risk, outcome), uncertain calls and each reconciliation step, approvals, "
        "resumptions, fenced writes (x, with the rule's reason), decisions superseded by an "
        "earlier one (s), compactions; then each approval still waiting, with what it asks "
        "and what each answer does (as `runlog explain`). Fields named in "
        "RUNLOG_REDACT_FIELDS are redacted in arguments, results, evidence and errors (also "
        "inside JSON held in strings, and in results runlog cut).",
    )
    p.add_argument("run_id")
    p.add_argument("--tenant", default="default")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_show)

    p = sub.add_parser(
        "ui",
        help="the operator console (web; needs the 'ui' extra and RUNLOG_UI_TOKENS)",
        description="Runs, timelines, the uncertain-call queue, approvals (approve/reject), "
        "audit and projection lag in a browser. Binds 127.0.0.1 unless told otherwise; every "
        "request needs a token from RUNLOG_UI_TOKENS.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8642)
    p.set_defaults(func=_ui)


def _line(row: RunRow, now: datetime) -> str:
    last = "-"
    if row.last_event_at:
        ago = (now - datetime.fromisoformat(row.last_event_at)).total_seconds()
        last = f"{row.last_type or '?'} {age_text(ago)} ago"
    return (
        f"{row.tenant:<12} {row.run_id:<30} {row.status:<10} {_detail(row, now):<34} "
        f"{row.seq:>6} {row.epoch:>5} {row.resumptions:>4} {age_text(row.age_s(now)):>6}  {last}"
    )


def _detail(row: RunRow, now: datetime) -> str:
    """What the status says beside its name: the owner and lease, what it waits for, since
    when it is orphaned or cancelling, how it ended."""
    wait = ""
    if row.waiting_for == "time" and row.until:
        wait = f"until {row.until}"
    elif row.waiting_for:
        wait = f"for a {row.waiting_for}"
    if row.handed_over_by is not None:
        return f"handed over by {row.handed_over_by}"
    if row.owner is not None and not row.owner_alive:
        return f"lease held by {row.owner}, expired: its worker is gone"
    if row.owner is not None:
        left = ""
        if row.lease_expires_at:
            secs = (datetime.fromisoformat(row.lease_expires_at) - now).total_seconds()
            left = f" lease {max(0.0, secs):.0f}s"
        who = f"{row.owner}{left}"
        return f"{wait}; {who}" if wait else who
    if wait:
        return wait
    if row.status in ("orphaned", "cancelling") and row.since:
        return f"since {age_text((now - datetime.fromisoformat(row.since)).total_seconds())}"
    return row.outcome or "-"


def _runs(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    now = datetime.now(UTC)
    since = parse_since(args.since, now) if args.since else None
    if args.forked_from is not None:
        return _forks(args, client, settings, now)
    asked: list[Requested] = []
    if args.cursor is None and since is None:
        asked = _requested_only(settings, client, args.tenant)
    if args.status == "requested":
        client.close()
        return _print_requested(asked, args.json)
    try:
        index = RunIndex(client, settings)
        cursor = args.cursor
        rows: list[RunRow] = []
        header = not args.json
        if asked and not args.status and not args.json:
            _print_requested(asked, False)
            header = False
        while True:
            try:
                page = index.page(
                    tenants=args.tenant,
                    status=args.status,
                    since=since,
                    limit=args.limit,
                    cursor=cursor,
                )
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            if args.json:
                rows.extend(page.rows)
            else:
                if header and page.rows:
                    print(HEADER)
                    header = False
                for row in page.rows:
                    print(_line(row, now))
            cursor = page.next_cursor
            if cursor is None or not args.all:
                break
    finally:
        client.close()
    if args.json:
        out: dict[str, Any] = {
            "runs": [r.to_dict(now) for r in rows],
            "next_cursor": cursor,
            "requested": [] if args.status else [r.to_dict() for r in asked],
        }
        if not rows:
            out["projection_services"] = _services(settings)
        print_json(out)
    elif header:
        # Nothing listed: say whether anything keeps the index, not an empty table.
        live = _services(settings)
        if live is None:
            print(
                "no runs listed, and Kafka cannot say whether a projection service "
                "(`runlog project state`) keeps the run index",
                file=sys.stderr,
            )
        elif not live:
            print(
                "no runs listed, and no projection service is running: the run index is "
                "kept by `runlog project state` (or `runlog project all`); start one, and "
                "it folds the log from where it stopped",
                file=sys.stderr,
            )
        else:
            groups = ", ".join(f"{g} ({n} member(s))" for g, n in sorted(live.items()))
            print(f"no runs match (the state projection is running: {groups})", file=sys.stderr)
    elif cursor is not None:
        print(f"more: runlog runs ... --cursor '{cursor}'", file=sys.stderr)
    return 0


HEADER = (
    f"{'TENANT':<12} {'RUN':<30} {'STATUS':<10} {'OWNER / DETAIL':<34} "
    f"{'SEQ':>6} {'EPOCH':>5} {'RES':>4} {'AGE':>6}  LAST EVENT"
)


def _requested_only(settings: Settings, client: Any, tenants: list[str] | None) -> list[Requested]:
    """The start requests whose run has no row in the index (no log yet, or the index is
    behind), read from the lifecycle topic; none when the broker does not answer (said)."""
    gone = unreachable(settings.bootstrap_servers)
    if gone is not None:
        print(f"start requests not listed: Kafka does not answer ({gone})", file=sys.stderr)
        return []
    try:
        found = requested(settings, client, tenants=tenants)
    except KafkaUnavailable as exc:
        print(f"start requests not listed: {exc}", file=sys.stderr)
        return []
    index = RunIndex(client, settings)
    return [r for r in found if index.find(r.run_id) is None]


def _print_requested(asked: list[Requested], as_json: bool) -> int:
    if as_json:
        print_json({"runs": [], "next_cursor": None, "requested": [r.to_dict() for r in asked]})
        return 0
    if asked:
        print(HEADER)
    for r in asked:
        print(f"{r.tenant:<12} {r.run_id:<30} {'requested':<10} {r.text()}")
    return 0


def _services(settings: Settings) -> dict[str, int] | None:
    """Live consumer groups of state projection services (``runlog project``): id ->
    members (None: Kafka did not answer). The state projection keeps the run index, alone
    or among others."""
    prefix = f"{settings.topic_prefix}.projection."
    try:
        found = live_groups(settings, prefix)
    except KafkaUnavailable:
        return None
    return {g: n for g, n in found.items() if "state" in g[len(prefix) :].split("+")}


def _forks(args: argparse.Namespace, client: Any, settings: Settings, now: datetime) -> int:
    """``runs --forked-from RUN``: the run's forks, from the index (one tenant's)."""
    tenant = (args.tenant or ["default"])[0]
    try:
        rows = RunIndex(client, settings).children(tenant, check_run_id(args.forked_from))
    finally:
        client.close()
    if args.json:
        print_json({"runs": [r.to_dict(now) for r in rows], "next_cursor": None})
        return 0
    for row in rows:
        print(_line(row, now))
    return 0


def _show(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    try:
        with LogReader(settings) as reader:
            try:
                tl = run_timeline(reader, client, settings, args.tenant, args.run_id)
            except UnknownRun:
                # No log of this tenant's: a start request the fleet has not served yet
                # is still a run someone asked for, shown as the request it is.
                pending = requested(settings, client, tenants=[args.tenant], run_ids=[args.run_id])
                if not pending:
                    raise
                return _show_requested(pending[0], args.json)
        told = status_now(client, settings, tl.state)
        children = RunIndex(client, settings).children(tl.tenant, tl.run_id)
    finally:
        client.close()
    questions = [question(tl, ap) for ap in tl.state.pending_approvals]
    left = _left_open(tl.state) if told.ended else []
    if args.json:
        print_json(
            {
                **tl.to_dict(),
                **told.to_dict(),
                "cancel": _cancel_dict(tl.state),
                "left_open": left,
                "questions": [q.to_dict() for q in questions],
                "forks": [c.run_id for c in children],
            }
        )
        return 0
    st = tl.state
    print(f"run {tl.run_id}  tenant {tl.tenant}  status {told.text()}  outcome {st.outcome or '-'}")
    print(
        f"seq {st.seq}  epoch {st.epoch}  resumptions {st.resumptions}  "
        f"fenced writes {st.fenced_writes}  turns {st.turns}  cost ${st.cost_usd:.6f}"
    )
    if st.erased is not None:
        gone = st.erased
        print(
            f"CONTENT ERASED by {gone.erased_by} at {gone.erased_at.isoformat()} "
            f"(seq {gone.erased_seq}): {gone.reason}; subject {gone.subject}, "
            f"{len(gone.key_ids)} key(s) destroyed"
        )
    for child in children:
        print(f"forked into {child.run_id} (status {child.status}, seq {child.seq})")
    lin = st.lineage
    if lin is not None:
        print(
            f"forked from {lin.parent_run_id} at seq {lin.at_seq} by {lin.forked_by} "
            f"(effects {lin.effects_mode}; parent state digest {lin.parent_digest[:16]})"
            + (f": {lin.reason}" if lin.reason else "")
        )
        for fx in lin.not_inherited():
            undo = "  (has an inverse)" if fx.compensable else ""
            print(
                f"  other timeline: {fx.name} {fx.args_json} in {fx.run_id} #{fx.seq} "
                f"{fx.status} key={fx.key} -> {fx.resolution or 'not met'}{undo}"
            )
    print()
    for e in tl.entries:
        mark = "x " if not e["valid"] else "s " if e.get("superseded") else "  "
        at = datetime.fromisoformat(e["at"]).strftime("%H:%M:%S.%f")[:-3]
        print(f"{mark}{at} #{e['seq']:<4} e{e['epoch']:<3} {e['text']}")
    if tl.calls:
        print()
        print("tool calls:")
        for c in tl.calls:
            recon = f"  reconciliation: {'; '.join(c.reconciliations)}" if c.reconciliations else ""
            print(
                f"  {c.tool:<14} key={c.idempotency_key} risk={c.risk or '-'} "
                f"attempts={c.attempts} -> {c.outcome}{recon}"
            )
    if st.cancel is not None:
        asked = st.cancel
        print()
        print(
            f"cancel requested by {asked.requested_by} at {asked.requested_at.isoformat()} "
            f"(seq {asked.requested_seq}): {asked.reason}"
        )
    if left:
        print()
        print(f"open calls left for reconciliation when the run ended {st.outcome}:")
        for call in left:
            print(
                f"  {call['tool']:<14} key={call['idempotency_key']} risk={call['risk']} "
                f"{call['status']} since {call['started_at']}"
            )
    if questions:
        print()
        print("waiting for a person:")
        for q in questions:
            print("\n".join(f"  {line}" for line in q.lines()))
    return 0


def _show_requested(req: Requested, as_json: bool) -> int:
    if as_json:
        print_json(req.to_dict())
        return 0
    since = req.since.isoformat() if req.since is not None else "?"
    print(f"run {req.run_id}  tenant {req.tenant}  status {req.text()}")
    print(f"agent {req.agent}  requested by {req.requested_by or '?'}  since {since}")
    if req.served_by:
        print(f"live workers that serve {req.agent}: {', '.join(req.served_by)}")
    else:
        print(
            f"no live worker serves agent {req.agent} (`runlog workers`): the run starts "
            "when one that registers it joins"
        )
    print("no event in the log yet")
    return 0


def _cancel_dict(st: RunState) -> dict[str, Any] | None:
    c = st.cancel
    if c is None:
        return None
    return {
        "requested_by": c.requested_by,
        "reason": c.reason,
        "requested_at": c.requested_at.isoformat(),
        "requested_seq": c.requested_seq,
    }


def _left_open(st: RunState) -> list[dict[str, Any]]:
    """The calls an ended run left open (a terminate, a cancel during an uncertain call):
    what a person reconciles, with the evidence the log holds."""
    return [
        {
            "idempotency_key": c.idempotency_key,
            "tool": c.name,
            "risk": c.risk,
            "status": c.status,
            "attempt": c.attempt,
            "started_at": c.started_at.isoformat(),
            "last_error": c.last_error,
            "last_evidence": c.last_evidence,
        }
        for c in sorted(st.open_calls.values(), key=lambda c: c.started_seq)
    ]


def _ui(args: argparse.Namespace) -> int:
    # Optional extra: imported only when the console is asked for.
    try:
        from runlog.ui._server import serve
    except ImportError as exc:
        raise ConfigError(
            f"the console needs the 'ui' extra: pip install 'runlog[ui]' ({exc})"
        ) from exc
    return serve(host=args.host, port=args.port)
