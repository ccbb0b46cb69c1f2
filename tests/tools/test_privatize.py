"""tools/privatize.py on a small tree of its own (a git repository in a temporary folder).

It renames the modules that are neither declared public nor a package's ``__init__`` or
``__main__`` (``git mv``), rewrites the dotted names, the imports of a module from its
package (absolute and relative) and the paths that name them, leaves the public modules
and the owner's folders as they are, changes nothing when run again, and on a re-run
rewrites a stale old spelling merged in afterwards, and renames a module merged in
afterwards.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools import privatize

FILES = {
    "pyproject.toml": '[project]\nname = "runlog"\n[tool.x]\nignore = ["runlog/ui/pages.py"]\n',
    "runlog/__init__.py": '_PUBLIC_MODULES = ("runlog", "runlog.pub")\nfrom runlog import api\n',
    "runlog/pub.py": "from runlog.settings import Settings\n",
    "runlog/api.py": "import runlog.settings\nX = runlog.settings.Settings\n",
    "runlog/settings.py": "class Settings: ...\n",
    "runlog/ui/__init__.py": "",
    "runlog/ui/__main__.py": "from . import pages\n",
    "runlog/ui/pages.py": "from .util import helper as h, other\nfrom ..settings import Settings\n",
    "runlog/ui/util.py": "def helper() -> None: ...\nother = 1\n",
    "runlog/ui/_ok.py": "",
    "producers/__init__.py": "",
    "producers/run.py": "from runlog.producers import ops\n",
    "producers/ops.py": "",
    "schemas/__init__.py": "",
    "schemas/keys.py": "",
    "tests/test_a.py": (
        "from runlog.ui import pages, util as u\n"
        "from runlog.settings import Settings\n"
        "from runlog.producers.run import x\n"
        'P = "runlog.producers.ops.thing"\n'
        "from runlog import pub\n"
        "import producers.run  # the owner's folder by its own name; not schemas.keys()\n"
    ),
    "docs/a.md": (
        "See `producers/run.py`, `runlog/api.py` and `runlog.api`; `runlog/pub.py`.\n"
        "In `ui/util.py`, `pages.py` and `run.py`; not `tests/test_a.py`.\n"
    ),
}


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for owner in ("producers", "schemas"):
        (root / "runlog" / owner).symlink_to(f"../{owner}")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    return root


def _read(root: Path, name: str) -> str:
    return (root / name).read_text()


def test_privatize_renames_internal_modules_and_rewrites_what_names_them(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    counts = privatize.run(root, use_ruff=False)

    renamed = {"runlog/_api.py", "runlog/_settings.py", "runlog/ui/_pages.py", "runlog/ui/_util.py"}
    assert all((root / n).is_file() for n in renamed | {"producers/_run.py", "producers/_ops.py"})
    kept = ["runlog/pub.py", "runlog/ui/__init__.py", "runlog/ui/__main__.py", "runlog/ui/_ok.py"]
    assert all((root / n).is_file() for n in kept)
    assert (root / "producers").is_dir() and (root / "runlog" / "producers").is_symlink()
    assert counts["renamed"] == 7 and counts["internal_public_by_name_after"] == 0
    assert counts["internal_public_by_name_before"] == 7
    assert (root / "schemas" / "_keys.py").is_file()

    assert _read(root, "runlog/__init__.py").endswith("from runlog import _api as api\n")
    assert _read(root, "runlog/pub.py") == "from runlog._settings import Settings\n"
    assert (
        _read(root, "runlog/_api.py") == "import runlog._settings\nX = runlog._settings.Settings\n"
    )
    assert _read(root, "runlog/ui/__main__.py") == "from . import _pages as pages\n"
    assert _read(root, "runlog/ui/_pages.py") == (
        "from ._util import helper as h, other\nfrom .._settings import Settings\n"
    )
    assert _read(root, "producers/_run.py") == "from runlog.producers import _ops as ops\n"
    assert _read(root, "tests/test_a.py") == (
        "from runlog.ui import _pages as pages, _util as u\n"
        "from runlog._settings import Settings\n"
        "from runlog.producers._run import x\n"
        'P = "runlog.producers._ops.thing"\n'
        "from runlog import pub\n"
        "import producers._run  # the owner's folder by its own name; not schemas.keys()\n"
    )
    assert _read(root, "docs/a.md") == (
        "See `producers/_run.py`, `runlog/_api.py` and `runlog._api`; `runlog/pub.py`.\n"
        "In `ui/_util.py`, `_pages.py` and `_run.py`; not `tests/test_a.py`.\n"
    )
    assert 'ignore = ["runlog/ui/_pages.py"]' in _read(root, "pyproject.toml")
    status = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
    ).stdout
    assert "runlog/api.py -> runlog/_api.py" in status  # git mv: history follows

    # Again: nothing to do.
    snapshot = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}
    again = privatize.run(root, use_ruff=False)
    assert again["renamed"] == 0 and again["files_rewritten"] == 0
    assert snapshot == {
        p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts
    }

    # A branch written against the old names, merged afterwards: a stale import and a new
    # public-named module; the re-run fixes both.
    (root / "tests" / "test_b.py").write_text("from runlog.ui.pages import X\n")
    (root / "runlog" / "ui" / "fresh.py").write_text("from runlog.ui import util\n")
    third = privatize.run(root, use_ruff=False)
    assert third["renamed"] == 1
    assert _read(root, "tests/test_b.py") == "from runlog.ui._pages import X\n"
    assert _read(root, "runlog/ui/_fresh.py") == "from runlog.ui import _util as util\n"
