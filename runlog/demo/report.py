"""The demo's final summary: read from the log (folded) and from the ledger's own counts.

Nothing here trusts the supervisor's memory of what happened: effects come from the
ledger, decisions, uncertainty, resumptions and fenced writes from the run's events.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from runlog.consumers.verify import verify_run
from runlog.demo.agent import CORRECTIONS, TENANT, TICKETS
from runlog.log.clients import redis_client
from runlog.log.reader import LogReader
from runlog.projections.run_state import RunState, accept, fold, rejection
from runlog.schemas import models as m
from runlog.schemas.models import Event
from runlog.schemas.vocabulary import EventType
from runlog.settings import Settings

if TYPE_CHECKING:
    from runlog.demo.supervisor import Options, Outcome


def read_log(settings: Settings, run_id: str) -> list[Event]:
    """Every event of the run in log order, valid or not."""
    with LogReader(settings) as reader:
        return [rec.event for rec in reader.read(run_id)]


def _target(args_json: str) -> str:
    args = json.loads(args_json)
    for key in ("correction_id", "ref"):
        if key in args:
            return str(args[key])
    if "ledger" in args:
        return f"ledger {args['ledger']}"
    return args_json


def describe_tail(events: list[Event]) -> str:
    """The last valid event, in words (what a kill interrupted)."""
    st = RunState()
    last: Event | None = None
    for ev in events:
        if accept(st, ev):
            last = ev
    if last is None:
        return "nothing yet"
    p = last.payload
    what = last.type.value
    name = getattr(p, "name", None)
    if name:
        args = getattr(p, "args_json", None)
        what += f" {name}" + (f" {_target(args)}" if args else "")
    open_note = (
        f", {len(st.open_calls)} call(s) started without an outcome" if st.open_calls else ""
    )
    return f"seq {last.seq} {what}{open_note}"


def run_verify(settings: Settings, run_id: str, events: list[Event]) -> dict[str, Any]:
    client = redis_client(settings)
    try:
        rep = verify_run(settings, client, run_id, tenant=TENANT)
    finally:
        client.close()
    return {"source": "runlog.consumers.verify", "ok": bool(rep.ok), "text": str(rep.text())}


def build_report(
    settings: Settings,
    outcome: Outcome,
    events: list[Event],
    ledger: dict[str, Any],
    projection: dict[str, Any] | None,
    opts: Options,
) -> dict[str, Any]:
    st = fold(events)
    effects: dict[str, int] = ledger["effects"]
    walk = RunState()
    args_of: dict[str, str] = {}
    attempts: Counter[str] = Counter()
    settled: dict[str, str] = {}
    uncertain: dict[str, dict[str, Any]] = {}
    resumptions: list[dict[str, Any]] = []
    fenced: list[dict[str, Any]] = []
    approvals: dict[str, dict[str, Any]] = {}
    for ev in events:
        why = rejection(walk, ev)
        accept(walk, ev)
        p = ev.payload
        if why is not None:
            fenced.append(
                {"seq": ev.seq, "epoch": ev.epoch, "type": ev.type.value, "writer": ev.writer_id}
                | {"why": why}
            )
            continue
        if isinstance(p, m.ToolCallStarted):
            args_of[p.idempotency_key] = p.args_json
            attempts[p.idempotency_key] += 1
        elif isinstance(p, m.ToolCallCompleted) and p.idempotency_key:
            settled[p.idempotency_key] = p.source
            if p.idempotency_key in uncertain:
                uncertain[p.idempotency_key]["resolution"] = f"{p.source}: {p.content}"
        elif isinstance(p, m.ToolCallUncertain):
            entry = uncertain.setdefault(
                p.idempotency_key,
                {
                    "name": p.name,
                    "target": _target(args_of.get(p.idempotency_key, "{}")),
                    "errors": [],
                    "reconciliations": [],
                    "resolution": "still open",
                },
            )
            entry["errors"].append(f"{p.detected_by}: {p.error}")
        elif isinstance(p, m.ReconciliationAttempted):
            known = uncertain.get(p.idempotency_key)
            if known is not None:
                known["reconciliations"].append(
                    {
                        "outcome": p.outcome,
                        "action": p.action,
                        "rule": p.rule,
                        "evidence": p.evidence,
                    }
                )
        elif isinstance(p, m.RunResumed) and p.operator is None:
            # A person taking the run to record a decision is not a resumption (the fold's rule).
            resumptions.append(
                {"seq": ev.seq, "epoch": ev.epoch, "gap_ms": p.gap_ms, "reason": p.reason}
            )
        elif isinstance(p, m.ApprovalRequested):
            approvals[p.approval_id] = {
                "kind": p.kind,
                "reason": p.reason,
                "target": _target(p.args_json) if p.args_json else "",
                "requested_at": ev.occurred_at,
            }
        elif isinstance(p, m.ApprovalDecided) and p.approval_id in approvals:
            a = approvals[p.approval_id]
            a.update(approved=p.approved, decided_by=p.decided_by, note=p.note)
            a["latency_s"] = round((ev.occurred_at - a.pop("requested_at")).total_seconds(), 2)

    key_of = {_target(v): k for k, v in args_of.items()}
    corrections = {
        c.correction_id: {
            "endpoint": c.endpoint,
            "applied": int(effects.get(f"correction:{c.correction_id}", 0)),
            "attempts": attempts.get(key_of.get(c.correction_id, ""), 0),
            "settled": settled.get(key_of.get(c.correction_id, ""), "not settled"),
        }
        for c in CORRECTIONS
    }
    tickets = {
        ref: {
            "filed": int(effects.get(f"ticket:{ref}", 0)),
            "attempts": attempts.get(key_of.get(ref, ""), 0),
            "settled": settled.get(key_of.get(ref, ""), "not settled"),
            "escalations": [a for a in approvals.values() if a.get("target") == ref],
        }
        for ref, _, _ in TICKETS
    }
    verify = run_verify(settings, outcome.run_id, events)
    if projection is not None and "state" in projection:
        # The projection service folded the same log independently: it must agree.
        mine = json.dumps(st.to_dict(), sort_keys=True, default=str)
        theirs = json.dumps(projection.pop("state"), sort_keys=True, default=str)
        projection["matches_fold"] = mine == theirs
    types = Counter(ev.type.value for ev in events)

    failures: list[str] = []
    if st.status != "finished" or st.outcome != "succeeded":
        failures.append(f"run not finished successfully (status {st.status}, {st.outcome})")
    failures += [
        f"correction {cid} applied {c['applied']} times"
        for cid, c in corrections.items()
        if c["applied"] != 1
    ]
    failures += [
        f"ticket {ref} filed {t['filed']} times" for ref, t in tickets.items() if t["filed"] != 1
    ]
    if not verify["ok"]:
        failures.append("verify failed")
    if opts.pause and not any(p["fenced"] for p in outcome.pauses):
        failures.append("no paused worker ended Fenced")
    if outcome.timed_out:
        failures.append(f"timed out after {opts.timeout_s:g} s")
    if outcome.gave_up:
        failures.append(outcome.gave_up)
    unfinished = [k for k, v in uncertain.items() if v["resolution"] == "still open"]
    if unfinished:
        failures.append(f"{len(unfinished)} uncertain call(s) never resolved")
    if types[EventType.TOOL_CALL_UNCERTAIN.value] == 0:
        failures.append("no uncertain call was exercised")

    return {
        "ok": not failures,
        "failures": failures,
        "run_id": outcome.run_id,
        "seed": outcome.seed,
        "elapsed_s": outcome.elapsed_s,
        "topic": settings.events_topic,
        "run": {
            "status": st.status,
            "outcome": st.outcome,
            "summary": st.summary,
            "records": len(events),
            "seq": st.seq,
            "epoch": st.epoch,
            "turns": st.turns,
            "compactions": st.compactions,
            "resumptions": st.resumptions,
            "retries": st.retries,
            "fenced_writes": st.fenced_writes,
            "digest": st.digest(),
            "event_types": dict(sorted(types.items())),
        },
        "corrections": corrections,
        "tickets": tickets,
        "reads": ledger.get("reads", {}),
        "uncertain": list(uncertain.values()),
        "approvals": list(approvals.values()),
        "resumptions": resumptions,
        "fenced": fenced,
        "attempts": [asdict(a) for a in outcome.attempts],
        "pauses": outcome.pauses,
        "decisions": [asdict(d) for d in outcome.decisions],
        "faults": outcome.faults,
        "verify": verify,
        "projection": projection,
        "projections_running": outcome.projections,
        "supervisor_pid": outcome.supervisor_pid,
    }


def print_report(r: dict[str, Any]) -> None:
    out: list[str] = []
    add = out.append
    run = r["run"]
    add("")
    add("=" * 78)
    add(f"runlog demo summary: run {r['run_id']} (seed {r['seed']}, {r['elapsed_s']} s)")
    add("=" * 78)
    add(
        f"run: {run['status']} / {run['outcome']}; {run['records']} records in {r['topic']}, "
        f"valid seq 1..{run['seq']}, final epoch {run['epoch']}"
    )
    add(
        f"     {run['turns']} model turns, {run['compactions']} compaction(s), "
        f"{run['resumptions']} resumptions, {run['retries']} retried attempt(s)"
    )
    kills = [a for a in r["attempts"] if a["killed"]]
    add(f"workers: {len(r['attempts'])} processes; outcomes:")
    for a in r["attempts"]:
        extra = f"; log ended at {a['log_tail']}" if a["log_tail"] else ""
        paused = " (paused)" if a["paused"] else ""
        add(f"  #{a['n']:<2} pid {a['pid']:<7} exit {a['rc']!s:>3} {a['outcome']}{paused}{extra}")
    add(f"  SIGKILLs: {len(kills)}; the supervisor is pid {r['supervisor_pid']}")
    for p in r["pauses"]:
        add(
            f"  pause: pid {p['paused_pid']} SIGSTOPped past its lease, pid "
            f"{p['successor_pid']} took over; the paused one exited {p['paused_exit']} "
            f"({'Fenced' if p['fenced'] else 'NOT fenced'})"
        )
    add("corrections (applied per id, counted by the ledger):")
    for cid, c in r["corrections"].items():
        add(
            f"  {cid} {c['endpoint']:<10} applied {c['applied']}x  attempts {c['attempts']}  "
            f"settled by {c['settled']}"
        )
    add("exception tickets:")
    for ref, t in r["tickets"].items():
        esc = "; ".join(
            f"escalated, {e.get('decided_by', '?')} "
            f"{'approved' if e.get('approved') else 'rejected'}: {e.get('note', '')}"
            for e in t["escalations"]
        )
        add(f"  {ref} filed {t['filed']}x  attempts {t['attempts']}  {esc or 'no escalation'}")
    reads = r["reads"]
    add(f"ledger reads: {len(reads)} ledgers, {sum(reads.values())} reads (re-reads are safe)")
    add(f"uncertain calls ({len(r['uncertain'])}):")
    for u in r["uncertain"]:
        add(f"  {u['name']} {u['target']}: {u['errors'][0]}")
        for rec in u["reconciliations"]:
            add(f"      -> {rec['outcome']} => {rec['action']} ({rec['rule']})")
        add(f"      resolved: {u['resolution']}")
    add("approvals:")
    for a in r["approvals"]:
        verdict = {True: "approved", False: "rejected", None: "PENDING"}[a.get("approved")]
        add(
            f"  {a['kind']:<14} {a['target'] or a['reason']}: {verdict} by "
            f"{a.get('decided_by', '-')} after {a.get('latency_s', '-')} s"
        )
    add(f"resumptions ({len(r['resumptions'])}):")
    for res in r["resumptions"]:
        add(
            f"  seq {res['seq']:<4} epoch {res['epoch']:<3} gap {res['gap_ms']} ms: {res['reason']}"
        )
    add(
        f"fenced writes: {r['run']['fenced_writes']} (records in the log from a writer that "
        "had lost the run;"
    )
    add("  a paused worker is usually stopped by its pre-append lease check and writes none)")
    for f in r["fenced"]:
        add(f"  seq {f['seq']} epoch {f['epoch']} {f['type']} from {f['writer']}: {f['why']}")
    proj = r["projection"]
    if proj is not None:
        summ = proj.get("summary") or {}
        keys = ("status", "outcome", "seq", "epoch", "resumptions", "fenced_writes", "open_calls")
        add(
            "state projection (runlog project all): "
            + ", ".join(f"{k}={summ.get(k)}" for k in keys)
        )
        if "error" in proj:
            add(f"  projection error: {proj['error']}")
        else:
            same = proj.get("matches_fold")
            add(f"  its full state {'equals' if same else 'DIFFERS FROM'} the fold of the log")
    add(f"verify ({r['verify']['source']}):")
    for line in r["verify"]["text"].splitlines():
        add(f"  {line}")
    add("-" * 78)
    if r["ok"]:
        add("OK: every correction applied exactly once, every ticket filed exactly once, the")
        add("    run finished and verifies, and the paused worker was fenced.")
    else:
        add("FAILED:")
        for f in r["failures"]:
            add(f"  - {f}")
    # The demo starts no server: it says how to look at this run in the console.
    add("look at it in a browser (the 'ui' extra; any long random token):")
    add(
        f'  RUNLOG_UI_TOKENS=\'{{"<token>": ["{TENANT}"]}}\' .venv/bin/runlog ui'
        "   # then http://127.0.0.1:8642/"
    )
    add(
        f"  log in with <token>, open run {r['run_id']}; or: .venv/bin/runlog show "
        f"{r['run_id']} --tenant {TENANT}"
    )
    print("\n".join(out), flush=True)
