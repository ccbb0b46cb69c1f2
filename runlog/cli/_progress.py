"""A terminal progress bar for the CLI's long reads (rebuild, replay --all, verify --all).

The log-access layer takes any ``Progress`` callable; this one draws with rich, which only
the command line loads (opening a run never imports it).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, TaskID, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from runlog.log._fold import Progress


def progress_bar(label: str = "scanning", stream: TextIO | None = None) -> Progress:
    """A progress bar (rich's), ``show(done, total)``, redrawn at most 10 times a second.

    No refresh thread: it draws when it is called, and stops itself at the end. On a
    stream that is not a terminal rich prints the final state once instead of animating.
    ``stream`` defaults to ``sys.stderr`` as it is when the bar is made (this module is
    imported when the CLI is, which may be before the caller redirected stderr).
    """
    bar = RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr if stream is None else stream),
        auto_refresh=False,
    )
    task: list[TaskID] = []
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        finished = done + 1 >= total
        if task and now - last[0] < 0.1 and not finished:
            return
        last[0] = now
        if not task:
            bar.start()
            task.append(bar.add_task(label, total=max(total, 1)))
        bar.update(task[0], completed=min(done + 1, max(total, 1)), total=max(total, 1))
        bar.refresh()
        if finished:
            bar.stop()

    return show
