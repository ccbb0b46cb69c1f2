"""Each framework how-to page opens with a complete example that runs as written: the first
``python`` block of the page, run as a script against the real stack (this test's topics),
with the framework's own test model. It must refund once and, run again on the same run id,
ask the model for nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from workers.common import ROOT, worker_env

from runlog._settings import Settings

FIRST_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
PAGES = ("openai-agents.md", "pydantic-ai.md")


def first_example(page: str) -> str:
    found = FIRST_BLOCK.search((ROOT / "docs" / "howto" / page).read_text())
    assert found, f"{page} has no python example"
    return found.group(1)


@pytest.mark.parametrize("page", PAGES)
def test_a_how_to_pages_opening_example_runs_as_written(
    page: str, fast: Settings, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(first_example(page))
    done = subprocess.run(
        [sys.executable, str(script)],
        env=worker_env(fast),
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
