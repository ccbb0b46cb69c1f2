"""``runlog replay | verify | snapshot``: time travel, the replay contract, snapshot economics."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.cli._groups import EXIT_USAGE, print_json
from runlog.cli._progress import progress_bar
from runlog.cli._synthetic import write_synthetic_run
from runlog.consumers import _snapshot_plan as sp
from runlog.consumers._queries import refuse_other_tenant
from runlog.consumers._redaction import redact_entry, secret_fields
from runlog.consumers._verify import run_starts, verify_run
from runlog.errors import UnknownRun
from runlog.log import _metrics as metrics
from runlog.log._clients import redis_client
from runlog.log._reader import LogReader
from runlog.log._replay import replay
from runlog.log._snapshots import SnapshotStore
from runlog.schemas._keys import check_run_id


def register(subparsers: Any) -> None:
    p_replay = subparsers.add_parser(
        "replay", help="print a run's state at any sequence (reads only that run's records)"
    )
    p_replay.add_argument("run_id")
    p_replay.add_argument("--tenant", default="default")
    p_replay.add_argument("--to-seq", type=int, default=None, help="stop at this seq")
    p_replay.add_argument("--no-snapshot", action="store_true", help="ignore stored snapshots")
    p_replay.add_argument("--state", action="store_true", help="print the full state dict")
    p_replay.add_argument("--json", action="store_true", help="JSON with metrics")
    p_replay.set_defaults(func=_replay)

    p_verify = subparsers.add_parser(
        "verify",
        help="check determinism, vocabulary, fenced-write explanations and snapshot "
        "equivalence of a run (or --all); exit 1 on any mismatch, 4 if the run is not "
        "found (or is another tenant's)",
    )
    p_verify.add_argument("run_id", nargs="?")
    p_verify.add_argument("--all", action="store_true", help="every run in the events topic")
    p_verify.add_argument("--tenant", default="default")
    p_verify.add_argument("--json", action="store_true")
    p_verify.set_defaults(func=_verify)

    p_snap = subparsers.add_parser("snapshot", help="snapshot economics and maintenance")
    sub = p_snap.add_subparsers(dest="snapshot_command", required=True)
    p_plan = sub.add_parser(
        "plan", help="measure replay and snapshot costs here; print the interval for an RTO"
    )
    p_plan.add_argument("--rto-ms", type=float, default=300.0, help="worst-case recovery")
    p_plan.add_argument("--events", type=int, default=4000, help="events per run")
    p_plan.add_argument("--recoveries", type=float, default=6.0, help="recoveries per run")
    p_plan.add_argument(
        "--sample-events", type=int, default=2000, help="size of the synthetic run measured"
    )
    p_plan.add_argument("--run", default=None, help="measure this existing run instead")
    p_plan.add_argument("--tenant", default="default")
    p_plan.add_argument(
        "--trust-live-state",
        action="store_true",
        help="plan for snapshots copied from the writer's state (no log read per write)",
    )
    p_plan.add_argument("--json", action="store_true")
    p_plan.set_defaults(func=_plan)

    p_write = sub.add_parser("write", help="snapshot a run now, from its log")
    p_write.add_argument("run_id")
    p_write.add_argument("--tenant", default="default")
    p_write.set_defaults(func=_write)


def _clients(settings: Settings) -> Any:

    return redis_client(settings)


def _store(settings: Settings, client: Any) -> Any:

    return SnapshotStore(client, settings)


def _replay(args: argparse.Namespace) -> int:

    check_run_id(args.run_id)
    settings = Settings()
    client = _clients(settings)
    try:
        result = replay(
            settings,
            client,
            args.run_id,
            tenant=args.tenant,
            to_seq=args.to_seq,
            snapshots=None if args.no_snapshot else _store(settings, client),
            progress=progress_bar(),
        )
    finally:
        client.close()
    if result.records == 0 and result.snapshot_seq is None:
        raise UnknownRun(f"no records of run {args.run_id}", run_id=args.run_id)
    refuse_other_tenant(result.state.tenant, args.tenant, args.run_id)
    out = result.summary()
    if args.state:
        out["state"] = redact_entry(result.state.to_dict(), secret_fields(settings))
    if args.json:
        out["metrics"] = metrics.snapshot()
        print_json(out)
        return 0
    read = out.pop("read")
    state = out.pop("state", None)
    for k, v in out.items():
        print(f"{k:>18}: {v}")
    print(
        f"{'read':>18}: {read['records']} records from {read['source']} "
        f"(partition {read['partition']}, offsets {read['start_offset']}..{read['end_offset']}"
        f", snapshot seq {read['snapshot_seq']}) in {read['duration_ms']} ms"
    )
    if read["snapshot_miss"]:
        print(f"{'snapshot miss':>18}: {read['snapshot_miss']}")
    if state is not None:
        print_json(state)
    return 0


def _verify(args: argparse.Namespace) -> int:

    if bool(args.all) == bool(args.run_id):
        print("runlog verify: give a RUN_ID or --all", file=sys.stderr)
        return EXIT_USAGE
    if args.run_id:
        check_run_id(args.run_id)
    settings = Settings()
    client = _clients(settings)
    try:
        store = _store(settings, client)
        runs = run_starts(settings, progress=progress_bar(), client=client) if args.all else []
        targets: list[tuple[str, str, int | None]] = [*runs]
        if not args.all:
            targets.append((args.tenant, args.run_id, None))
        reports = [
            verify_run(settings, client, rid, tenant=tenant, snapshots=store, first_offset=first)
            for tenant, rid, first in targets
        ]
    finally:
        client.close()
    if not args.all and reports[0].missing:
        # One run asked for by id: an unknown run and another tenant's are not found (4),
        # answered alike; a run that is there and fails a check is a failure (1).
        raise UnknownRun(reports[0].error or "", run_id=args.run_id)
    failed = [r for r in reports if not r.ok]
    erased = [r for r in reports if r.verdict == "erased"]
    if args.json:
        print_json(
            {
                "ok": not failed,
                "runs": len(reports),
                "failed": len(failed),
                "erased": len(erased),
                "reports": [r.to_dict() for r in reports],
                "metrics": metrics.snapshot(),
            }
        )
    else:
        for r in reports:
            if r.verdict != "ok" or not args.all:
                print(r.text())
        print(
            f"verified {len(reports)} run(s): {len(failed)} failed"
            + (f", {len(erased)} erased (content forgotten; structure verified)" if erased else "")
        )
    return 1 if failed else 0


def _plan(args: argparse.Namespace) -> int:

    settings = Settings()
    client = _clients(settings)
    try:
        if args.run:
            check_run_id(args.run)
            m = sp.measure(settings, client, args.tenant, args.run)
            m.source = f"run {args.run}"
        else:
            scratch = sp.scratch_settings(settings)
            ensure_topics(scratch).raise_for_drift()
            try:
                print(
                    f"writing a synthetic run of ~{args.sample_events} events to "
                    f"{scratch.events_topic} ...",
                    file=sys.stderr,
                )
                tenant, rid = write_synthetic_run(scratch, args.sample_events)
                m = sp.measure(scratch, client, tenant, rid)
                m.source = f"synthetic run of {m.events} events on {scratch.events_topic}"
            finally:
                for failure in sp.drop_scratch(scratch, client):
                    print(f"warning: scratch topic left behind: {failure}", file=sys.stderr)
    finally:
        client.close()
    result = sp.plan(
        m,
        events=args.events,
        recoveries=args.recoveries,
        rto_ms=args.rto_ms,
        from_log=not args.trust_live_state,
    )
    result["measured"] = m.to_dict()
    if args.json:
        print_json(result)
        return 0
    i = result["inputs"]
    print(f"measured on: {m.source}")
    print(f"  replay cost c        {i['replay_ms_per_event']:.4f} ms/event")
    print(f"                       ({1000 / i['replay_ms_per_event']:.0f} events/s)")
    print(f"  snapshot write s     {i['snapshot_write_ms']:.3f} ms ({m.state_bytes} bytes)")
    print(f"  snapshot load        {i['snapshot_load_ms']:.3f} ms")
    print(f"  reader open + seek   {i['reader_open_ms']:.3f} ms")
    print(f"for N={args.events} events, R={args.recoveries} recoveries, RTO={args.rto_ms} ms:")
    print(
        f"  full replay: worst {result['full_replay_worst_ms']} ms, "
        f"R x N/2 x c = {result['full_replay_cost_ms']} ms per run"
    )
    if result.get("interval") is not None:
        print(
            f"  interval K={result['interval']}: worst-case recovery "
            f"{result['worst_case_recovery_ms']} ms, {result['snapshot_writes_per_run']} "
            f"writes = {result['snapshot_write_cost_per_run_ms']} ms"
            + (" (each derived from the log)" if i["snapshot_derived_from_log"] else "")
        )
        print(
            f"  ceil(N/K) x s + R x K/2 x c = {result['snapshot_total_cost_ms']} ms; "
            f"net saving {result['net_saving_ms']} ms; break-even "
            f"{result['break_even_recoveries_per_run']} recoveries per run"
        )
    print(f"verdict: {result['verdict']}")
    return 0


def _write(args: argparse.Namespace) -> int:

    check_run_id(args.run_id)
    settings = Settings()
    client = _clients(settings)
    try:
        store = _store(settings, client)
        with LogReader(settings) as reader:
            partition = reader.partition_of(args.run_id)
            end = reader.high_watermark(partition)
        state = store.fold_log(args.tenant, args.run_id, partition, end)
        if state.seq == 0:
            raise UnknownRun(f"no records of run {args.run_id}", run_id=args.run_id)
        refuse_other_tenant(state.tenant, args.tenant, args.run_id)
        snap = store.put(args.tenant, args.run_id, state, partition=partition, offset=end)
    finally:
        client.close()
    print(
        f"snapshot of {args.run_id} at seq {snap.seq}, tail from offset {snap.offset}: {snap.key}"
    )
    return 0
