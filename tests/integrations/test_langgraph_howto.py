"""The LangGraph how-to page's opening example runs as written, against the real stack."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from workers.common import ROOT, worker_env

from runlog._settings import Settings

PAGE = ROOT / "docs" / "howto" / "langgraph.md"


def test_the_pages_first_example_runs_as_written(test_settings: Settings, tmp_path: Path) -> None:
    found = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert found is not None
    script = tmp_path / "example.py"
    script.write_text(found.group(1))
    done = subprocess.run(
        [sys.executable, str(script)],
        env=worker_env(test_settings),
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "Refunded order 42."
