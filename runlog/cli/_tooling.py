"""The clone-only commands' tooling (``runlog bench``, ``runlog demo``): found next to the source.

The benchmarks, the demo and the load generator live in ``tools/`` at the root of a clone,
outside the import package: the wheel installs ``runlog`` alone. runlog never imports them by
name (tests/test_layout.py); these commands load them at run time, from the folder beside
``runlog/`` in a clone or an editable install (``pip install -e .``), and say so when that
folder is absent (an installed wheel).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from runlog.errors import ConfigError

TOOLING = "tools"
"""The tooling's top-level package, a sibling of ``runlog/`` in a clone."""


def clone_root() -> Path | None:
    """The clone this runlog is imported from (the folder holding ``runlog/``, ``tools/`` and
    runlog's pyproject.toml), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent.parent
    project = root / "pyproject.toml"
    if not (root / TOOLING / "__init__.py").is_file() or not project.is_file():
        return None
    return root if 'name = "runlog"' in project.read_text(encoding="utf-8") else None


def load(module: str, command: str) -> ModuleType:
    """Import ``module`` (``tools.<...>``) from the clone, for ``runlog <command>``.

    The clone's root goes first on sys.path and on PYTHONPATH, so the processes the command
    starts (``runlog worker --agents tools.demo.agents``, a benchmark's worker) import the
    tooling too. Raises ConfigError, saying the command is clone-only, without a clone."""
    root = clone_root()
    if root is None:
        raise ConfigError(
            f"`runlog {command}` is a clone-only command: its code lives in {TOOLING}/ of a "
            f"clone of runlog, which the installed package does not include (looked beside "
            f"{Path(__file__).resolve().parent.parent}). From a clone: `pip install -e .`, "
            f"then `runlog {command}` (or `make {command}`)."
        )
    here = str(root)
    if here not in sys.path:
        sys.path.insert(0, here)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *rest])
    loaded = importlib.import_module(module)
    origin = Path(loaded.__file__ or "").resolve()
    if not origin.is_relative_to(root / TOOLING):
        raise ConfigError(
            f"`runlog {command}`: {module} was imported from {origin}, not from this clone's "
            f"{TOOLING}/ ({root / TOOLING}): another package named {TOOLING!r} is on the path"
        )
    return loaded
