"""The OpenAI Agents SDK how-to page (docs/howto/openai-agents.md) opens with a complete
example that runs as written (``howto_support``): it refunds once and, run again on the
same run id, asks the model for nothing."""

from __future__ import annotations

from pathlib import Path

from howto_support import opening_example_refunds_once

from runlog._settings import Settings


def test_a_how_to_pages_opening_example_runs_as_written(fast: Settings, tmp_path: Path) -> None:
    opening_example_refunds_once("openai-agents.md", fast, tmp_path)
