"""runlog's tooling, kept out of the installed package: the benchmarks (``tools.benchmarks``,
``runlog bench``), the demo (``tools.demo``, ``runlog demo``) and the load generator
(``tools.loadgen``).

It lives in a clone only: the wheel installs ``runlog`` alone. Tooling imports runlog,
never the reverse; ``runlog bench`` and ``runlog demo`` find this folder next to the source
of an editable install (``runlog.cli._tooling``) and say so when it is absent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
"""The clone's root: the folder holding ``tools/`` (and ``runlog/``)."""


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the clone's root first on PYTHONPATH, so a
    child ``python -m tools...`` or ``runlog worker --agents tools...`` imports the tooling
    whatever its working directory."""
    out = dict(os.environ if env is None else env)
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    out["PYTHONPATH"] = os.pathsep.join([ROOT, *rest])
    return out
