"""``runlog bench --quick`` end to end on this test's topics: every section, no speed asserted.

Timing assertions would make CI flaky on shared machines; what must never break is that
the benchmark runs against a live stack and reports a positive number for every figure.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runlog._settings import Settings
from tools.benchmarks.run import SECTIONS, run_all


def _numbers(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(node, bool):
        return
    if isinstance(node, int | float):
        yield path, float(node)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.timeout(240)
def test_quick_bench_reports_every_section_with_positive_numbers(
    test_settings: Settings, tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    res = run_all(test_settings, quick=True, out=out, echo=lambda _line: None)

    saved = json.loads((out / "results.json").read_text())
    assert saved["mode"] == "quick"
    assert not saved["failed"], {name: saved[name]["error"] for name in saved["failed"]}
    for key in ("cores", "memory_gib", "cpu_model", "python", "kafka_broker", "librdkafka"):
        assert saved["machine"][key], key
    assert saved["settings"]["producer"]["acks"] == "all"
    for section in SECTIONS:
        assert section in saved, section
        body = saved[section]
        numbers = dict(_numbers(body))
        assert numbers, f"{section} has no figures"
        # Offsets, fitted intercepts, slopes and differences of two figures (what
        # encryption adds, measured on a noisy machine) may be zero or negative; the
        # figures themselves may not.
        skip = (
            "fixed_s",
            "loglog_slope",
            "per_event_us",
            "values",
            "other_runs",
            "overhead",
            "_adds",
        )
        figures = {p: v for p, v in numbers.items() if not any(s in p for s in skip)}
        bad = {p: v for p, v in figures.items() if not v > 0}
        assert not bad, f"{section}: non-positive figures {bad}"
    assert res["throughput"]["by_runs"].keys() == {"1", "10", "100"}
    # Restate is measured beside runlog where its server and SDK can be had; else the row
    # says why. A failure while measuring it is neither.
    restate = saved["steps"]["restate"]
    assert "one_run" in restate or restate["status"].startswith("not measured"), restate
    assert saved["steps"]["fanout"]["event_loop_safe"]["steps_per_s"] > 0
    assert (out / "results.txt").read_text().startswith("runlog bench (quick")
    if importlib.util.find_spec("matplotlib") is not None:
        assert saved["plots"], "matplotlib is installed but no plot was written"
        for name in saved["plots"]:
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.timeout(240)
def test_fork_bench_forks_at_the_last_event_and_replays_fork_and_plain_run(
    test_settings: Settings,
) -> None:
    from tools.benchmarks import fork

    res = fork.measure(test_settings, events=400, repeats=2, length=120, replays=2)
    assert res["events"] >= 400 and res["length"] == 120
    for key in ("first_s", "p50_s", "p99_s", "fork_replay_ms", "plain_replay_ms", "ratio"):
        assert res[key] > 0, key
    assert "fork / plain" in fork.report(res)


def test_the_restate_row_says_why_when_its_server_cannot_be_had(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tools.benchmarks import report, restate_peer

    # No binary given, none cached, no npm to fetch one with.
    monkeypatch.delenv(restate_peer.SERVER_ENV, raising=False)
    monkeypatch.setenv("RUNLOG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    res = restate_peer.measure(n=10, repeats=1, runs=2, steps_per_run=2)
    assert res["status"].startswith("not measured: "), res
    assert ("npm" in res["status"]) != ("restate-sdk" in res["status"]), res
    # A binary that is not one.
    monkeypatch.setenv(restate_peer.SERVER_ENV, str(tmp_path / "missing"))
    res = restate_peer.measure(n=10, repeats=1, runs=2, steps_per_run=2)
    assert res["status"].startswith("not measured: "), res
    rows: list[tuple[str, str, str]] = []
    report._restate_rows(res, rows)
    assert rows == [("  restate", res["status"], "")]
