"""The framework how-to pages (docs/howto/<framework>.md) each open with a complete example
that runs as written: its first ``python`` block, run as a script against the real stack
(the test's topics), with the framework's own test model. It must refund once and, run
again on the same run id, ask the model for nothing. One check for every such page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from workers.common import KEEP, ROOT, worker_env

from runlog._settings import Settings

FIRST_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def opening_example_refunds_once(page_name: str, settings: Settings, tmp_path: Path) -> None:
    page = ROOT / "docs" / "howto" / page_name
    found = FIRST_BLOCK.search(page.read_text())
    assert found, f"{page.name} has no python example"
    script = tmp_path / "example.py"
    script.write_text(found.group(1))
    done = subprocess.run(
        [sys.executable, str(script)],
        env=worker_env(settings, **KEEP),
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run r"), done.stdout  # the run's id, known before its end
    first, again = lines[1], lines[2]
    assert first.endswith("| turns asked 2"), done.stdout
    assert "| turns asked 0 |" in again, done.stdout  # the resumption replayed every turn
    refunds = again.split("| refunds ")[1]
    assert refunds.count(": 700") == 1, done.stdout  # one refund, under one key
