"""The operator's view: ``runlog runs`` (the run index) and ``runlog show`` (a run's story)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from runlog.consumers.index import STATUSES, RunIndex, RunRow
from runlog.consumers.timeline import run_timeline
from runlog.errors import ConfigError
from runlog.log.clients import redis_client
from runlog.log.reader import LogReader
from runlog.settings import Settings

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "runs",
        help="list runs from the run index (kept by `runlog project state`)",
        description="Runs, most recently active first, from the index the state projection "
        "keeps in Redis (never a scan of the topic). Pages with --cursor.",
    )
    p.add_argument("--tenant", action="append", default=None, help="only this tenant (repeat)")
    p.add_argument("--status", choices=STATUSES, default=None)
    p.add_argument(
        "--since",
        default=None,
        help="only runs with an event at or after this time: ISO 8601, or an age "
        "(90s, 15m, 2h, 7d)",
    )
    p.add_argument("--limit", type=int, default=50, help="runs per page (default 50)")
    p.add_argument("--cursor", default=None, help="continue after the page that printed it")
    p.add_argument("--all", action="store_true", help="every page, not just the first")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs)

    p = sub.add_parser(
        "show",
        help="a run's history as a timeline, read from the log",
        description="Every record of the run in log order: model turns, tool calls (key, "
        "risk, outcome), uncertain calls and each reconciliation step, approvals, "
        "resumptions, fenced writes (with the rule's reason), compactions. Fields named in "
        "RUNLOG_REDACT_FIELDS are redacted in arguments and results.",
    )
    p.add_argument("run_id")
    p.add_argument("--tenant", default="default")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_show)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (UTC if it names no zone) or an age such as ``15m`` before now."""
    at = now or datetime.now(UTC)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return at - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ConfigError(f"--since wants an ISO time or an age like 15m, not {text!r}") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _line(row: RunRow, now: datetime) -> str:
    last = "-"
    if row.last_event_at:
        ago = (now - datetime.fromisoformat(row.last_event_at)).total_seconds()
        last = f"{row.last_type or '?'} {_age(ago)} ago"
    return (
        f"{row.tenant:<12} {row.run_id:<28} {row.status:<9} {row.outcome or '-':<10} "
        f"{row.seq:>6} {row.epoch:>5} {row.resumptions:>4} {_age(row.age_s(now)):>6}  {last}"
    )


def _runs(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    now = datetime.now(UTC)
    since = parse_since(args.since, now) if args.since else None
    try:
        index = RunIndex(client, settings)
        cursor = args.cursor
        rows: list[RunRow] = []
        header = not args.json
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
                if header:
                    print(
                        f"{'TENANT':<12} {'RUN':<28} {'STATUS':<9} {'OUTCOME':<10} "
                        f"{'SEQ':>6} {'EPOCH':>5} {'RES':>4} {'AGE':>6}  LAST EVENT"
                    )
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
        }
        print(json.dumps(out, indent=2, sort_keys=True))
    elif cursor is not None:
        print(f"more: runlog runs ... --cursor '{cursor}'", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    try:
        with LogReader(settings) as reader:
            tl = run_timeline(reader, client, settings, args.tenant, args.run_id)
    finally:
        client.close()
    if args.json:
        print(json.dumps(tl.to_dict(), indent=2, sort_keys=True, default=str))
        return 0
    st = tl.state
    print(f"run {tl.run_id}  tenant {tl.tenant}  status {st.status}  outcome {st.outcome or '-'}")
    print(
        f"seq {st.seq}  epoch {st.epoch}  resumptions {st.resumptions}  "
        f"fenced writes {st.fenced_writes}  turns {st.turns}  cost ${st.cost_usd:.6f}"
    )
    print()
    for e in tl.entries:
        mark = "  " if e["valid"] else "x "
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
    return 0
