"""The results as a text table (printed, and the source of docs/performance.md) and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _mmm(s: dict[str, Any] | None) -> str:
    if not s:
        return "n/a"
    return f"{_f(s['min'])} / {_f(s['median'])} / {_f(s['max'])}"


Figures = tuple[tuple[str, str, str], ...]
"""Rows of one entry: each a label suffix, the entry's key and the unit."""

PER_STEP: Figures = (("", "ms_per_step", "ms/step"), (" CPU", "cpu_ms_per_step", "ms/step"))


def _measured(res: dict[str, Any]) -> dict[str, Any]:
    """``res`` without the sections that failed."""
    return {
        k: v for k, v in res.items() if not (isinstance(v, dict) and v.get("status") == "failed")
    }


def table(res: dict[str, Any]) -> str:
    """Every figure as min / median / max over the repeats, preceded by the machine."""
    rows: list[tuple[str, str, str]] = [
        (f"FAILED: {name}", res[name]["error"][:120], "") for name in res.get("failed", [])
    ]
    res = _measured(res)

    def row(label: str, s: dict[str, Any] | None, unit: str) -> None:
        rows.append((label, _mmm(s), unit))

    def note(label: str, text: str = "") -> None:
        """A section's heading, or a line of text where a figure would stand."""
        rows.append((label, text, ""))

    def each(entries: dict[str, Any], label: str, figures: Figures) -> None:
        """Per entry, a row per figure: ``label`` (``{name}``: the entry's) + its suffix."""
        for name, v in entries.items():
            for suffix, key, unit in figures:
                row(f"  {label.format(name=name)}{suffix}", v[key], unit)

    lat = res.get("latency")
    if lat:
        note(f"1. durable append latency ({lat['appends_per_repeat']} appends)")
        each(lat["systems"], "{name}", ((" p50", "p50_ms", "ms"), (" p99", "p99_ms", "ms")))
        row("  ratio runlog/raw_kafka p50", lat["ratio_runlog_over_raw_kafka"]["p50"], "x")
        row("  ratio runlog/raw_kafka p99", lat["ratio_runlog_over_raw_kafka"]["p99"], "x")
    thr = res.get("throughput")
    if thr:
        note(
            f"2. throughput ({thr['total_events']} events, "
            f"barrier every {thr['events_per_barrier']})"
        )
        each(
            thr["by_runs"],
            "{name} runs: ",
            (
                ("runlog", "runlog_events_per_s", "ev/s"),
                ("raw_kafka", "raw_kafka_events_per_s", "ev/s"),
                ("ratio runlog/raw", "ratio_runlog_over_raw", "x"),
            ),
        )
        o = thr["open_run_new_s"]
        rows.append(("  open_run (new run) p50 / p99", f"{_f(o['p50'])} / {_f(o['p99'])}", "s"))
    rep = res.get("replay")
    if rep:
        note(f"3. replay (record ~{rep['avg_record_bytes']:.0f} B)")
        each(
            rep["in_memory"],
            "in-memory {name}: ",
            (
                ("avro only", "avro_events_per_s", "ev/s"),
                ("decode+validate", "decode_events_per_s", "ev/s"),
                ("decode+validate+fold", "fold_events_per_s", "ev/s"),
                ("ratio fold/avro (time)", "ratio_fold_over_avro", "x"),
            ),
        )
        for s, m in rep["in_memory_model"].items():
            note(
                f"  in-memory model {s}",
                f"{m['per_event_us']:.1f} us/event, log-log slope {m['loglog_slope']:.2f}",
            )
        each(
            rep["kafka"],
            "kafka {name}: ",
            (
                ("fetch only", "fetch_events_per_s", "ev/s"),
                ("LogReader+fold", "logreader_fold_events_per_s", "ev/s"),
            ),
        )
        for name, m in rep.get("kafka_model", {}).items():
            note(
                f"  kafka model {name}", f"{m['fixed_s']:.3f} s + {m['per_event_us']:.1f} us/event"
            )
        for k, v in rep.get("batch_boundary", {}).items():
            row(f"  LogReader+fold, run of exactly {k} records", v, "s")
        for k, v in rep["interleaved"].items():
            row(
                f"  {k} ({v['records_scanned']} records scanned)",
                v["logreader_fold_s"],
                "s",
            )
        busy = rep.get("open_new_run_after_traffic")
        if busy:
            row(
                f"  open_run (new run), {busy['records_in_topic']:,} records written <60 s ago",
                busy["open_s"],
                "s",
            )
    rec = res.get("recovery")
    if rec:
        note(f"4. recovery (lease TTL {rec['lease_ttl_ms']} ms)")
        for how in ("expiry", "takeover", "release"):
            if how not in rec["handoff"]:
                continue
            v = rec["handoff"][how]
            row(f"  {how}: signal -> successor's first append", v["total_s"], "s")
            row(f"  {how}: lease TTL left at signal", v["lease_pttl_at_signal_s"], "s")
        r = rec["resume"]
        row("  open_run of a new run", r["new_run_open_s"], "s")
        row(f"  resume {r['events']}-event run, no snapshot", r["without_snapshot_s"], "s")
        if "with_snapshot_s" in r:
            row(
                f"  resume with snapshot every {r['snapshot_interval']} "
                f"(tail {r['tail_events_after_snapshot']})",
                r["with_snapshot_s"],
                "s",
            )
            row("  snapshot write", r.get("snapshot_write_s"), "s")
        else:
            note("  with snapshot", str(r.get("with_snapshot")))
    lag = res.get("projection_lag")
    if lag:
        if lag.get("status") == "measured":
            note(f"5. projection lag at {lag['rate_events_per_s']:.0f} ev/s (state)")
            row("  p50", lag["p50_ms"], "ms")
            row("  p99", lag["p99_ms"], "ms")
        else:
            note("5. projection lag", str(lag.get("note")))
    mem = res.get("memory")
    if mem:
        note("6. memory (peak RSS, VmHWM)")
        row("  worker, no runs", mem["baseline_vm_hwm_mib"], "MiB")
        row(
            f"  worker, {mem['runs']} open runs (opened {mem['open_threads']} at a time)",
            mem["worker_vm_hwm_mib"],
            "MiB",
        )
        row("  same worker, RSS after opening", mem["worker_vm_rss_after_mib"], "MiB")
        row("  per open run, peak", mem["per_run_peak_kib"], "KiB")
        row("  per open run, steady", mem["per_run_steady_kib"], "KiB")
        if lag and lag.get("runner_vm_hwm_mib"):
            row("  projection runner (state)", lag["runner_vm_hwm_mib"], "MiB")
    enc = res.get("encoding")
    if enc:
        note(f"7. encodings ({enc['events']} events)")
        each(
            enc["cpu"],
            "{name}",
            ((" encode", "encode_us", "us/event"), (" decode", "decode_us", "us/event")),
        )
        app = enc["append"]
        if "status" in app:
            note("  append with a registry", app["status"])
        else:
            for key in (
                "single_object_p50_ms",
                "confluent_p50_ms",
                "single_object_p99_ms",
                "confluent_p99_ms",
            ):
                row(f"  append {key[:-3].replace('_', ' ')}", app[key], "ms")
    stp = res.get("steps")
    if stp:
        note(f"8. a durable step ({stp['steps_per_repeat']} steps)")
        each(stp["systems"], "{name}", PER_STEP)
        if "peers" in stp:
            note("  peers", stp["peers"])
        if "postgres" in stp:
            note("  PostgresSaver", stp["postgres"])
        fan = stp.get("fanout")
        if fan:
            fan_head = f"  {fan['runs']} runs x {fan['calls_per_run']}"
            for how, what in (
                ("event_loop_safe", "safe calls, event loop"),
                ("event_loop", "irreversible calls, event loop"),
                ("event_loop_safe_worker_gc", "safe calls, event loop, a worker's GC"),
                ("event_loop_worker_gc", "irreversible calls, event loop, a worker's GC"),
                ("threads", "irreversible calls, threads"),
            ):
                v = fan.get(how)
                if v is None:
                    continue
                rows.append(
                    (
                        f"{fan_head} {what}",
                        f"{v['steps_per_s']:,.0f} steps/s",
                        f"CPU {v['cpu_ms_per_step']:.3f} ms/step "
                        f"({v['events_per_s']:,.0f} events/s)",
                    )
                )
        _restate_rows(stp.get("restate"), rows)
    pai = res.get("pydantic_ai")
    if pai and "systems" in pai:
        rows.append((f"9. a Pydantic AI agent step ({pai['steps_per_repeat']} steps)", "", ""))
        each(pai["systems"], "{name}", PER_STEP)
        for name, ms in pai["overhead_ms_per_step"].items():
            rows.append((f"  {name} - bare", f"{ms:.3f}", "ms/step (median)"))
    elif pai and "status" in pai:
        rows.append(("9. a Pydantic AI agent step", str(pai["status"]), ""))
    width = max(len(r[0]) for r in rows) + 2
    vwidth = max(len(r[1]) for r in rows) + 2
    head = machine_lines(res)
    lines = [*head, "", f"{'':{width}}{'min / median / max':{vwidth}}unit"]
    lines += [f"{a:{width}}{b:{vwidth}}{c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def _restate_rows(rst: dict[str, Any] | None, rows: list[tuple[str, str, str]]) -> None:
    """Section 8's Restate rows (``tools/benchmarks/restate_peer.py``), or why there are none."""
    if rst is None:
        return
    if "status" in rst:
        rows.append(("  restate", rst["status"], ""))
        return
    one = rst["one_run"]
    rows.append(("  restate", f"{rst['server']}, {rst['sdk']}, processes of their own", ""))
    head = "  restate_ctx_run"
    rows.append((head, _mmm(one["ms_per_step"]), "ms/step"))
    rows.append((f"{head} SDK CPU", _mmm(one["sdk_cpu_ms_per_step"]), "ms/step"))
    rows.append((f"{head} server CPU", _mmm(one["server_cpu_ms_per_step"]), "ms/step"))
    fan = rst["fanout"]
    head = f"  {fan['runs']} runs x {fan['steps_per_run']} restate ctx.run steps at once"
    rows.append((head, _mmm(fan["steps_per_s"]), "steps/s"))
    rows.append((f"{head}, SDK CPU", _mmm(fan["sdk_cpu_ms_per_step"]), "ms/step"))
    rows.append((f"{head}, server CPU", _mmm(fan["server_cpu_ms_per_step"]), "ms/step"))


def machine_lines(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    s = res["settings"]
    return [
        f"runlog bench ({res['mode']}, {res['repeats']} repeat(s), {res['elapsed_s']:.0f} s) "
        f"at {m['measured_at']}",
        f"machine: {m['cores']} cores, {m['memory_gib']} GiB, {m['cpu_model']}, "
        f"load {m['load_avg_at_start']}, kernel {m['kernel']}",
        f"software: python {m['python']}, kafka {m['kafka_broker']}, librdkafka "
        f"{m['librdkafka']}, confluent-kafka {m['confluent_kafka']}, redis {m['redis_server']}, "
        f"fastavro {m['fastavro']}, pydantic {m['pydantic']}",
        f"settings: {s['events_topic']} ({s['partitions']} partitions, RF "
        f"{s['replication_factor']}), producer {s['producer']}, lease TTL {s['lease_ttl_ms']} ms",
    ]


# --------------------------------------------------------------------------------- plots


def plots(res: dict[str, Any], out: Path) -> list[str]:
    """PNG files in ``out``; returns their names. Needs matplotlib (``.[bench]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = _measured(res)
    written: list[str] = []
    subtitle = (
        f"{res['machine']['cores']} cores, {res['machine']['cpu_model']}; "
        f"{res['mode']}, {res['repeats']} repeat(s); bars: median, whiskers: min-max"
    )

    def spread(stats: list[dict[str, Any]]) -> tuple[list[float], list[tuple[float, ...]]]:
        """Medians, and whiskers down to each min and up to each max, as matplotlib takes them."""
        below = [s["median"] - s["min"] for s in stats]
        above = [s["max"] - s["median"] for s in stats]
        return [s["median"] for s in stats], [tuple(below), tuple(above)]

    def pair_of_bars(
        ax: Any, table: dict[str, Any], names: list[str], series: tuple[tuple[str, str], ...]
    ) -> None:
        """Two bars per name, side by side: ``table[name][key]`` of each (key, label)."""
        for j, (key, label) in enumerate(series):
            medians, whiskers = spread([table[n][key] for n in names])
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            ax.bar(xs, medians, width=0.38, yerr=whiskers, label=label, capsize=3)

    def save(fig: Any, name: str) -> None:
        fig.text(0.5, 0.005, subtitle, ha="center", va="bottom", fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    lat = res.get("latency")
    if lat:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(lat["systems"])
        pair_of_bars(ax, lat["systems"], names, (("p50_ms", "p50"), ("p99_ms", "p99")))
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
        ax.set_ylabel("ms per durable append (log)")
        ax.set_title("1. Durable append latency, each acknowledged before the next")
        ax.legend()
        save(fig, "latency.png")

    stp = res.get("steps")
    if stp and stp.get("systems"):
        fig, ax = plt.subplots(figsize=(9, 4.2))
        names = list(stp["systems"])
        wall_and_cpu = (("ms_per_step", "wall"), ("cpu_ms_per_step", "CPU"))
        pair_of_bars(ax, stp["systems"], names, wall_and_cpu)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
        ax.set_ylabel("ms per durable step")
        ax.set_title("8. A durable tool-call step: runlog, its floor and its peers, one sitting")
        ax.legend()
        save(fig, "steps.png")

    thr = res.get("throughput")
    if thr:
        fig, ax = plt.subplots(figsize=(7, 4))
        ks = list(thr["by_runs"])
        xs = [int(k) for k in ks]
        for key, label in (("runlog_events_per_s", "runlog"), ("raw_kafka_events_per_s", "raw")):
            medians, whiskers = spread([thr["by_runs"][k][key] for k in ks])
            ax.errorbar(xs, medians, yerr=whiskers, marker="o", capsize=3, label=label)
        for k, x in zip(ks, xs, strict=True):
            r = thr["by_runs"][k]["ratio_runlog_over_raw"]["median"]
            y = thr["by_runs"][k]["runlog_events_per_s"]["median"]
            ax.annotate(f"{r:.2f}x", (x, y), textcoords="offset points", xytext=(4, -12))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent runs in one process")
        ax.set_ylabel("events/s (log)")
        ax.set_title(f"2. Throughput, barrier every {thr['events_per_barrier']} events per run")
        ax.legend()
        save(fig, "throughput.png")

    rep = res.get("replay")
    if rep:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        series = [
            (rep["in_memory"], f"{s}_s", f"in-memory {s}") for s in ("avro", "decode", "fold")
        ] + [
            (rep["kafka"], "fetch_s", "kafka fetch only"),
            (rep["kafka"], "logreader_fold_s", "kafka LogReader+fold"),
        ]
        for table_, key, label in series:
            ns = [int(k) for k in table_]
            ts = [table_[k][key]["median"] for k in table_]
            a1.plot(ns, ts, marker="o", label=label)
            a2.plot(ns, [t / n * 1e6 for t, n in zip(ts, ns, strict=True)], marker="o", label=label)
        a1.set_xscale("log")
        a1.set_yscale("log")
        a1.set_xlabel("events in the run")
        a1.set_ylabel("replay time, s (log)")
        a1.set_title("3. Replay time vs run length (slope 1 = linear)")
        a2.set_xscale("log")
        a2.set_yscale("log")
        a2.set_xlabel("events in the run")
        a2.set_ylabel("us per event (log)")
        a2.set_title("Cost per event (flat = linear)")
        a2.legend(fontsize=7)
        save(fig, "replay.png")

        inter = rep["interleaved"]
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [
            f"{v['layout']}\n{v['other_runs']} others\n{v['records_scanned']:,} rec"
            for v in inter.values()
        ]
        medians, whiskers = spread([v["logreader_fold_s"] for v in inter.values()])
        ax.bar(range(len(medians)), medians, yerr=whiskers, capsize=3)
        ax.set_xticks(range(len(medians)), labels, fontsize=8)
        n = next(iter(inter.values()))["run_events"]
        ax.set_ylabel("s to replay the run via LogReader")
        ax.set_title(f"3b. Replay of one {n}-event run with other runs in its partition")
        save(fig, "replay_interleaved.png")

    rec = res.get("recovery")
    if rec:
        fig, ax = plt.subplots(figsize=(8, 4))
        r = rec["resume"]
        bars = [
            ("SIGKILL\n(lease expiry)", rec["handoff"]["expiry"]["total_s"]),
            ("SIGKILL\n(takeover)", rec["handoff"]["takeover"]["total_s"]),
            ("SIGTERM\n(release on close)", rec["handoff"]["release"]["total_s"]),
            ("open_run\nnew run", r["new_run_open_s"]),
            (f"resume {r['events']}\nno snapshot", r["without_snapshot_s"]),
        ]
        if "with_snapshot_s" in r:
            bars.append((f"resume {r['events']}\nwith snapshot", r["with_snapshot_s"]))
        medians, whiskers = spread([b[1] for b in bars])
        colors = ["C3", "C1", "C0", "C2", "C4"][: len(bars)]
        ax.bar(range(len(bars)), medians, yerr=whiskers, capsize=3, color=colors)
        ax.axhline(4.0, color="0.5", ls="--", lw=1)
        ax.text(len(bars) - 0.5, 4.05, "example objective: 4 s", ha="right", fontsize=7)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(f"4. Recovery (lease TTL {rec['lease_ttl_ms']} ms)")
        save(fig, "recovery.png")

    mem = res.get("memory")
    lag = res.get("projection_lag") or {}
    if mem:
        fig, ax = plt.subplots(figsize=(6, 4))
        bars = [
            ("worker\nno runs", mem["baseline_vm_hwm_mib"]),
            (f"worker\n{mem['runs']} runs", mem["worker_vm_hwm_mib"]),
        ]
        if lag.get("runner_vm_hwm_mib"):
            bars.append(("projection\nrunner", lag["runner_vm_hwm_mib"]))
        medians, whiskers = spread([b[1] for b in bars])
        ax.bar(range(len(bars)), medians, yerr=whiskers, capsize=3)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars])
        ax.set_ylabel("peak RSS (VmHWM), MiB")
        ax.set_title("6. Memory")
        save(fig, "memory.png")
    return written
