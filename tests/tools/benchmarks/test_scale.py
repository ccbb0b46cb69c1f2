"""``runlog bench scale`` at toy sizes: every figure it prints is measured and positive.

The smoke of ``runlog bench --quick`` (test_run_smoke.py) leaves this one out: its quick
form takes minutes. Here its long-run and opens-at-once parts run on a few hundred events
and five threads (seconds); its timers part, which needs a worker process and a due time
ahead, is the benchmark's alone. No speed is asserted.
"""

from __future__ import annotations

import pytest

from runlog._settings import Settings
from tools.benchmarks import scale
from tools.benchmarks.common import machine


@pytest.mark.timeout(120)
def test_scale_long_runs_and_opens_report_positive_figures(test_settings: Settings) -> None:
    long = scale.long_runs(
        test_settings, events=1_200, repeats=3, echo=lambda _l: None, base_events=300, calls=5
    )
    conv = long["conversation"]
    assert conv["model_calls"] == 5 and conv["events"] == 1 + 5 * 3
    # Only what is new is recorded: the log is a few bytes per token, far below a history
    # that records every prompt again.
    assert 0 < conv["log_bytes_per_token"] < conv["resend_bytes_per_token"]
    lr = long["long_run"]
    assert lr["events"] >= 1_200 and lr["snapshot_writes"] >= 1 and lr["snapshot_body_bytes"] > 0
    assert lr["append_ratio_last_over_first"] > 0 and lr["alternated_ratio_long_over_new"] > 0
    assert lr["alternated_ratio_without_snapshot_writes"] > 0
    assert set(long["resume"]) == {"300", "1200"}
    for figures in long["resume"].values():
        assert all(figures[k] > 0 for k in ("replay_p99_ms", "snapshot_p99_ms"))
    opens = scale.opens_at_once(test_settings, (5,))
    assert opens["5"]["opened"] == 5 and not opens["5"]["errors"]
    text = scale.report(
        {"mode": "test", "machine": machine(test_settings), "long": long, "opens_at_once": opens}
    )
    for ref in ("<= 1.2", "<= 50 ms", "<= 100 ms", "Temporal"):
        assert ref in text, ref


@pytest.mark.timeout(120)
def test_scale_long_run_without_snapshots_reports_flatness(test_settings: Settings) -> None:
    m = scale.million_run(test_settings, events=2_000, echo=lambda _l: None)
    assert m["events"] >= 2_000 and m["state_bytes"] > 0
    assert m["ratio_last_over_first"] > 0 and m["alternated_ratio_long_over_new"] > 0
    text = scale.report({"mode": "test", "machine": machine(test_settings), "million": m})
    assert "<= 1.2" in text and "51,200" in text
