"""Make every internal module of runlog private by name, and rewrite what names it.

    .venv/bin/python tools/privatize.py [--dry-run] [--no-ruff]

A module is public when ``runlog._PUBLIC_MODULES`` declares it (read from the source, not
imported); packages' ``__init__.py`` and ``__main__.py`` keep their names (the package is
what they are), and so do the packages themselves: the owner's top-level folders stay as
they are. Every other module ``a/b/name.py`` becomes ``a/b/_name.py`` (``git mv``, so history
follows), and these are rewritten in the text files of the folders below:

* dotted names: ``runlog.producers.run`` -> ``runlog.producers._run`` (imports, strings,
  ``mock.patch`` targets, docs' ``::: runlog...`` blocks), and the owner's folders' own
  spelling, ``producers.run`` -> ``producers._run``;
* imports of a module from its package: ``from runlog.producers import run`` ->
  ``from runlog.producers import _run as run`` (absolute and relative), and relative
  ``from .run import Run`` -> ``from ._run import Run``;
* paths: ``runlog/producers/run.py``, ``producers/run.py``, ``runner/loop.py`` ->
  ``.../_run.py``; a file name alone in backticks (```loop.py```) when no file of the tree
  still has that name.

Idempotent, and meant to be re-run after merging branches written against the old names:
the renames come from the files (a public-named module not declared public), the rewrites
from the tree as it is (for every private module ``a.b._name`` with no module ``a.b.name``,
the old spelling ``a.b.name`` is rewritten), so a merged file's stale imports are fixed and
a merged new module is renamed. Afterwards ``ruff check --select I --fix`` and ``ruff
format`` tidy the Python files it changed (unless ``--no-ruff``). Prints what it did.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "runlog"
# The folders and files whose text is rewritten (the owner's folders are real folders here;
# runlog/ holds links to them, which are not followed twice).
REWRITE = (
    "runlog",
    "producers",
    "consumers",
    "schemas",
    "projections",
    "tests",
    "docs",
    "tools",
    "Makefile",
    "pyproject.toml",
    "README.md",
    "mkdocs.yml",
)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".ini"}
# This script and its test spell old names on purpose (examples, a tree to rename).
NOT_REWRITTEN = {"tools/privatize.py", "tests/tools/test_privatize.py"}
KEEP_NAMES = {"__init__.py", "__main__.py"}


def public_modules(root: Path = ROOT) -> frozenset[str]:
    """``runlog._PUBLIC_MODULES``, read from runlog/__init__.py's source."""
    tree = ast.parse((root / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "_PUBLIC_MODULES" for t in targets):
            return frozenset(ast.literal_eval(value))
    raise SystemExit("privatize: no _PUBLIC_MODULES in runlog/__init__.py")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package (dotted name -> its real file, the links resolved)."""
    out: dict[str, Path] = {}
    base = root / PACKAGE
    for d, dirs, files in os.walk(base, followlinks=True):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = (Path(d) / f).relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = (Path(d) / f).resolve()
    return out


def is_private_by_name(module: str, path: Path, public: frozenset[str]) -> bool:
    """Whether ``module`` may keep its name: declared public, a package's ``__init__`` or
    ``__main__``, or already a ``_`` name."""
    return module in public or path.name in KEEP_NAMES or module.rsplit(".", 1)[-1][0] == "_"


@dataclass
class Plan:
    renames: dict[str, str] = field(default_factory=dict)  # old dotted -> new dotted
    moves: list[tuple[Path, Path]] = field(default_factory=list)  # real files
    aliases: dict[str, str] = field(default_factory=dict)  # every old spelling -> new
    paths: dict[str, str] = field(default_factory=dict)  # old path suffix -> new
    basenames: dict[str, str] = field(default_factory=dict)  # `old.py` -> `_old.py`


def plan(root: Path = ROOT) -> Plan:
    public = public_modules(root)
    mods = modules(root)
    p = Plan()
    for module, path in mods.items():
        if is_private_by_name(module, path, public):
            continue
        head, leaf = module.rsplit(".", 1)
        new = f"{head}._{leaf}"
        if new in mods:
            raise SystemExit(f"privatize: {module} and {new} both exist; merge them by hand")
        p.renames[module] = new
        p.moves.append((path, path.with_name("_" + path.name)))
    # The spellings to rewrite: this run's renames, and every earlier one (a private leaf
    # whose public-named twin does not exist), so references merged in later are fixed.
    after = {p.renames.get(m, m) for m in mods}
    for module in sorted(after):
        head, _, leaf = module.rpartition(".")
        if not head or not leaf.startswith("_") or leaf.startswith("__"):
            continue
        old = f"{head}.{leaf[1:]}"
        if old in after or old in public:
            continue
        p.aliases[old] = module
        # The owner's folders are importable by their own names too (projections.audit).
        owner = old.split(".")
        if len(owner) > 2 and (root / PACKAGE / owner[1]).is_symlink():
            p.aliases[".".join(owner[1:])] = module.split(".", 1)[1]
        rel = Path(*old.split(".")).with_suffix(".py")  # runlog/producers/run.py
        new_rel = rel.with_name(leaf + ".py")
        p.paths[rel.as_posix()] = new_rel.as_posix()
        # Shorter spellings, down to the folder the module is in: the owner's folders
        # (producers/run.py), and paths within the package (log/kafka.py, runner/loop.py).
        for i in range(1, len(rel.parts) - 1):
            p.paths[Path(*rel.parts[i:]).as_posix()] = Path(*new_rel.parts[i:]).as_posix()
    # A file name alone in backticks (`loop.py`), where no file of the tree has that name
    # any more: each one that remains is a renamed module's (or several, all renamed alike).
    moving = {old for old, _ in p.moves}
    present = {f.name for f in _files(root) if f.suffix == ".py" and f.resolve() not in moving}
    for module in p.aliases.values():
        leaf = module.rsplit(".", 1)[1]
        if leaf[1:] + ".py" not in present:
            p.basenames[leaf[1:] + ".py"] = leaf + ".py"
    return p


def _move(root: Path, old: Path, new: Path) -> None:
    """``git mv`` (history follows the file), or a plain rename for an untracked file."""
    rel_old, rel_new = str(old.relative_to(root)), str(new.relative_to(root))
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", rel_old], cwd=root, capture_output=True
    )
    if tracked.returncode == 0:
        subprocess.run(["git", "mv", rel_old, rel_new], cwd=root, check=True)
    else:
        old.rename(new)


def _alternation(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


class Rewriter:
    def __init__(self, p: Plan) -> None:
        self.p = p
        self.dotted = (
            # never before "(": a module is not called (schemas.keys() is a dict's method)
            re.compile(rf"(?<![\w.])({_alternation(list(p.aliases))})(?![\w(])")
            if p.aliases
            else None
        )
        self.path = (
            re.compile(rf"(?<![\w.-])({_alternation(list(p.paths))})(?![\w])") if p.paths else None
        )
        self.basename = (
            re.compile(rf"(?<=`)({_alternation(list(p.basenames))})(?=`)") if p.basenames else None
        )

    def text(self, s: str) -> str:
        if self.dotted is not None:
            s = self.dotted.sub(lambda m: self.p.aliases[m.group(1)], s)
        if self.path is not None:
            s = self.path.sub(lambda m: self.p.paths[m.group(1)], s)
        if self.basename is not None:
            s = self.basename.sub(lambda m: self.p.basenames[m.group(1)], s)
        return s

    def python(self, s: str, module: str | None, is_pkg: bool) -> str:
        """The imports of a module from its package, and relative imports, then the text."""
        try:
            tree = ast.parse(s)
        except SyntaxError:
            return self.text(s)
        lines = s.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))
        edits: list[tuple[int, int, str]] = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.end_lineno is None:
                continue
            if node.level:
                if module is None:
                    continue
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            start = offsets[node.lineno - 1] + node.col_offset
            end = offsets[node.end_lineno - 1] + (node.end_col_offset or 0)
            seg = s[start:end]
            new_seg = seg
            # from .run import X -> from ._run import X (absolute ones: the dotted rewrite)
            if node.level and node.module and target in self.p.aliases:
                old_tail = node.module
                new_tail = self.p.aliases[target][len(".".join(base)) + 1 :] if base else old_tail
                new_seg = re.sub(
                    rf"^(from\s+\.+){re.escape(old_tail)}(?!\w)",
                    rf"\g<1>{new_tail}",
                    new_seg,
                )
            # from pkg import run -> from pkg import _run as run
            head, sep, names = new_seg.partition(" import ")
            if not sep:
                head, sep, names = new_seg.partition("import")
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                if full not in self.p.aliases:
                    continue
                leaf = self.p.aliases[full].rsplit(".", 1)[1]
                if alias.asname:
                    names = re.sub(
                        rf"(?<![\w.]){re.escape(alias.name)}(\s+as\s+{re.escape(alias.asname)})",
                        rf"{leaf}\g<1>",
                        names,
                        count=1,
                    )
                else:
                    names = re.sub(
                        rf"(?<![\w.]){re.escape(alias.name)}(?![\w])(?!\s+as\b)",
                        f"{leaf} as {alias.name}",
                        names,
                        count=1,
                    )
            new_seg = head + sep + names
            if new_seg != seg:
                edits.append((start, end, new_seg))
        for start, end, new_seg in sorted(edits, reverse=True):
            s = s[:start] + new_seg + s[end:]
        return self.text(s)


def _module_of(path: Path, root: Path, links: dict[Path, str]) -> tuple[str | None, bool]:
    """The dotted module a Python file is (through runlog's links), and whether a package."""
    for real, dotted in links.items():
        if path.is_relative_to(real):
            rel = path.relative_to(real).with_suffix("")
            parts = [*dotted.split("."), *rel.parts]
            is_pkg = parts[-1] == "__init__"
            return ".".join(parts[:-1] if is_pkg else parts), is_pkg
    return None, path.name == "__init__.py"


def _files(root: Path) -> list[Path]:
    out: list[Path] = []
    for name in REWRITE:
        top = root / name
        if top.is_file():
            out.append(top)
            continue
        if not top.is_dir():
            continue
        for d, dirs, files in os.walk(top):  # links not followed: each file once
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "site"))
            for f in sorted(files):
                path = Path(d) / f
                if path.is_symlink() or path.relative_to(root).as_posix() in NOT_REWRITTEN:
                    continue
                if path.suffix in TEXT_SUFFIXES or path.name == "Makefile":
                    out.append(path)
    return out


def run(root: Path = ROOT, *, dry_run: bool = False, use_ruff: bool = True) -> dict[str, int]:
    public = public_modules(root)
    before = modules(root)
    p = plan(root)
    for old, new in p.moves:
        print(f"rename {old.relative_to(root)} -> {new.name}")
        if not dry_run:
            _move(root, old, new)
    # Where runlog's modules are on disk: the package, and the owner's folders it links to.
    links = {(root / PACKAGE).resolve(): PACKAGE}
    for entry in (root / PACKAGE).iterdir():
        if entry.is_symlink() and entry.is_dir():
            links[entry.resolve()] = f"{PACKAGE}.{entry.name}"
    rw = Rewriter(p)
    changed: list[Path] = []
    for path in _files(root):
        try:
            src = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if path.suffix == ".py":
            module, is_pkg = _module_of(path.resolve(), root, links)
            text = rw.python(src, module, is_pkg)
        else:
            text = rw.text(src)
        if text != src:
            changed.append(path)
            print(f"rewrite {path.relative_to(root)}")
            if not dry_run:
                path.write_text(text, encoding="utf-8")
    py = [str(x.relative_to(root)) for x in changed if x.suffix == ".py"]
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if py and use_ruff and not dry_run and ruff:
        subprocess.run([ruff, "check", "-q", "--select", "I", "--fix", *py], cwd=root)
        subprocess.run([ruff, "format", "-q", *py], cwd=root)
    final = modules(root) if not dry_run else {p.renames.get(m, m): v for m, v in before.items()}
    return {
        "modules": len(final),
        "declared_public": sum(m in public for m in final),
        "package_files": sum(v.name in KEEP_NAMES for v in final.values()),
        "internal": len(_internal(final, public)),
        "internal_public_by_name_before": _public_by_name(before, public),
        "internal_public_by_name_after": _public_by_name(final, public),
        "renamed": len(p.moves),
        "files_rewritten": len(changed),
    }


def _internal(mods: dict[str, Path], public: frozenset[str]) -> list[str]:
    """The modules neither declared public nor a package's ``__init__``/``__main__``."""
    return [m for m, v in mods.items() if m not in public and v.name not in KEEP_NAMES]


def _public_by_name(mods: dict[str, Path], public: frozenset[str]) -> int:
    return sum(not m.rsplit(".", 1)[-1].startswith("_") for m in _internal(mods, public))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/privatize.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="print what would change, change nothing"
    )
    ap.add_argument("--no-ruff", action="store_true", help="do not sort imports and format after")
    args = ap.parse_args(argv)
    counts = run(ROOT, dry_run=args.dry_run, use_ruff=not args.no_ruff)
    for key, value in counts.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
