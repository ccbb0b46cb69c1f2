"""The package's shape: one import name, layers that point one way, a fold without clients.

These read the source (``ast``), install a copy, or import in a fresh interpreter; none of
them needs the stack. README "Architecture" describes the layers this file enforces.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "runlog"

# Lowest first. A module may import its own layer or a lower one, never a higher one.
# The CLI registers every command, so it is the shell around everything and sits at the
# top. The tooling (tools/: benchmarks, demo, load generator) is outside the package: it
# imports runlog, runlog never imports it (test_runlog_never_imports_the_tooling).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors and settings", ("runlog.errors", "runlog._settings")),
    ("schemas and the pure fold", ("runlog.schemas", "runlog.projections")),
    ("log access", ("runlog.log", "runlog._topics", "runlog._security")),
    ("writer and services", ("runlog.producers", "runlog.consumers", "runlog.fleet")),
    ("facade", ("runlog", "runlog._api", "runlog.aio", "runlog._bootstrap", "runlog.testing")),
    ("framework integrations", ("runlog.integrations",)),
    ("shell: CLI, stack, console", ("runlog.cli", "runlog.stack", "runlog.ui")),
]
# Peers in one layer that must not import each other either.
SEPARATE = {
    ("runlog.producers", "runlog.consumers"),
    ("runlog.consumers", "runlog.producers"),
    # The fleet drives runs through the producers; they never know it, nor do consumers.
    ("runlog.producers", "runlog.fleet"),
    ("runlog.consumers", "runlog.fleet"),
    ("runlog.fleet", "runlog.consumers"),
}
# Third-party modules the fold must load without (the fold is importable on its own).
NOT_IN_FOLD = ("confluent_kafka", "redis", "fastavro", "pydantic_settings")


def _unit(module: str) -> str:
    """The most specific name in LAYERS that ``module`` belongs to."""
    best = ""
    for _, names in LAYERS:
        for name in names:
            # The bare package name stands for its own __init__ only, never for a module
            # nobody placed: a new module must be given a layer here.
            inside = name != "runlog" and module.startswith(name + ".")
            if (module == name or inside) and len(name) > len(best):
                best = name
    assert best, f"{module} is in no layer: add it to LAYERS in tests/test_layout.py"
    return best


def _layer(unit: str) -> int:
    for i, (_, names) in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(unit)


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    paths = [
        Path(d) / f
        for d, _, files in os.walk(PACKAGE, followlinks=True)  # the owner's folders are links
        for f in files
        if f.endswith(".py")
    ]
    for path in sorted(paths):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported runlog module, line) for every import in ``path``, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # ``from runlog.x import y`` imports the module ``runlog.x.y`` when y is one.
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found += [(t, node.lineno) for t in subs or [target]]
    return [(t, n) for t, n in found if t == "runlog" or t.startswith("runlog.")]


def _loaded_imports(module: str, path: Path) -> list[str]:
    """The runlog modules importing ``module`` loads: its top-level imports (in ``if`` and
    ``try`` blocks too), not those inside functions or under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (
                    node.body,
                    node.orelse,
                    node.finalbody,
                    *(h.body for h in node.handlers),
                ):
                    walk(part)
            elif isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names]
                found.extend([t for t in subs if t in MODULES] or [target])

    walk(tree.body)
    out = []
    for name in found:
        parts = name.split(".")
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        out += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [t for t in out if t in MODULES]


def _import_closure(roots: tuple[str, ...]) -> dict[str, str]:
    """Every runlog module importing ``roots`` loads -> the module that first imported it."""
    seen: dict[str, str] = {r: r for r in roots}
    todo = list(roots)
    while todo:
        module = todo.pop()
        for target in _loaded_imports(module, MODULES[module]):
            if target not in seen:
                seen[target] = module
                todo.append(target)
    return seen


# The worker facade: what a worker imports to open and use a run.
WORKER_FACADE = (
    "runlog",
    "runlog._api",
    "runlog.aio",
    "runlog._bootstrap",
    "runlog.producers._engine",
)


def test_the_worker_facade_loads_no_projection_service() -> None:
    """Opening a run reads its log (snapshot cache, replay, fold) through log access; the
    projection services (runners, stores, queries, timelines) are never loaded by it."""
    closure = _import_closure(WORKER_FACADE)
    services = sorted(
        f"{m} (imported by {by})" for m, by in closure.items() if m.startswith("runlog.consumers")
    )
    assert not services, "the worker facade loads projection services:\n" + "\n".join(services)
    # It does load the log access the writer reads through.
    assert {"runlog.log._snapshots", "runlog.log._replay", "runlog.log._fold"} <= closure.keys()


def test_the_facade_check_would_catch_a_service_import(tmp_path: Path) -> None:
    """The checker itself: a top-level service import is found, a call-time one is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "from runlog.consumers import _queries as queries\n"
        "if TYPE_CHECKING:\n    from runlog.consumers._store import RUN_STATE\n"
        "def later() -> None:\n    from runlog.consumers._timeline import Timeline\n"
    )
    got = _loaded_imports("runlog.bad", bad)
    assert "runlog.consumers._queries" in got
    assert "runlog.consumers._store" not in got
    assert "runlog.consumers._timeline" not in got


def test_every_import_points_down_and_peers_stay_apart() -> None:
    problems: list[str] = []
    for module, path in MODULES.items():
        src = _unit(module)
        for target, line in _imports(module, path):
            dst = _unit(target)
            if _layer(dst) > _layer(src):
                problems.append(f"{path}:{line}: {module} ({src}) imports higher {target}")
            if (src, dst) in SEPARATE:
                problems.append(f"{path}:{line}: {module} imports its peer {target}")
    assert not problems, "\n".join(problems)


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        src = _unit(module)
        for target, _ in _imports(module, path):
            dst = _unit(target)
            if dst != src:
                graph[src].add(dst)
    seen: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, trail: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                pytest.fail("package import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt, [*trail, nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])


def _runtime_imports(module: str, path: Path) -> set[str]:
    """The runlog modules ``module`` imports when it runs: at its top and inside its
    functions alike (an import moved into a function still runs), not under
    ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for sub in ast.walk(stmt)
    }
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(subs or {target})
    return {t for t in out if t in MODULES and t != module}


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules_even_behind_a_function_level_import() -> None:
    """A function-level import may load a module late (the CLI, an optional extra), never
    hide a cycle: with every import counted where it runs, the modules form no cycle."""
    graph = {module: _runtime_imports(module, path) for module, path in MODULES.items()}
    cycles = _module_cycles(graph)
    assert not cycles, "module import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The checker itself: an import inside a function counts, a typing-only one does not,
    and two modules importing each other are a cycle."""
    mod = tmp_path / "mod.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from runlog._settings import Settings\n"
        "def later() -> None:\n    from runlog.errors import RunlogError\n"
    )
    assert _runtime_imports("runlog.mod", mod) == {"runlog.errors"}
    graph = {"runlog.errors": {"runlog.mod"}, "runlog.mod": _runtime_imports("runlog.mod", mod)}
    assert _module_cycles(graph) == [["runlog.errors", "runlog.mod"]]


def test_a_lower_layer_test_would_catch_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import in a fold module is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from runlog.producers._engine import Run\n")
    ((target, _),) = _imports("runlog.projections.bad", bad)
    assert _layer(_unit(target)) > _layer(_unit("runlog.projections.bad"))


def test_the_fold_imports_without_clients_or_codec() -> None:
    code = (
        "import sys, runlog.projections._run_state, runlog.projections._audit, "
        "runlog.projections._uncertain\n"
        f"bad = [m for m in {NOT_IN_FOLD!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the fold loaded {out.stdout.strip()}"


# What the wheel must never hold: the tooling a clone keeps in tools/.
TOOLING = ROOT / "tools"
NOT_IN_WHEEL = ("benchmarks", "demo", "loadgen")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runlog's wheel, built with this venv's pip from a copy of the tree (links kept as
    links), so setuptools' build/ and egg-info stay out of the clone."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("runlog", "producers", "consumers", "schemas", "projections", "tools"):
        if not (ROOT / name).exists():
            continue
        shutil.copytree(
            ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp / "dist"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("-w", str(out), str(src)),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("runlog-*.whl")
    return built


def _by_top_folder(names: list[str]) -> dict[str, int]:
    """Files per top folder of the wheel (``runlog/<folder>``, or the dist-info)."""
    counts: dict[str, int] = defaultdict(int)
    for name in names:
        parts = name.split("/")
        top = parts[0] if parts[0] != "runlog" or len(parts) < 3 else "/".join(parts[:2])
        counts[top] += 1
    return dict(sorted(counts.items()))


def test_the_wheel_holds_no_benchmark_demo_or_load_generator(wheel: Path) -> None:
    """The tooling stays in the clone: no module of the benchmarks, the demo or the load
    generator is in the wheel, under any folder."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    print(f"{wheel.name}: {len(names)} files")
    for top, count in _by_top_folder(names).items():
        print(f"  {top:40} {count:4}")
    tooling = [
        n
        for n in names
        if Path(n).parts[0] == TOOLING.name
        or {Path(p).stem for p in Path(n).parts} & {*NOT_IN_WHEEL}
    ]
    assert not tooling, f"the wheel holds tooling: {tooling[:20]}"
    # The check sees the tooling where it is in the tree (it would catch it in the wheel).
    assert {p.stem for p in TOOLING.rglob("*.py")} & set(NOT_IN_WHEEL) == {"loadgen"}
    assert (TOOLING / "benchmarks").is_dir() and (TOOLING / "demo").is_dir()


def test_install_adds_one_import_name(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"),
            *("--target", str(target), str(wheel)),
        ],
        check=True,
        capture_output=True,
    )
    names = {p.name for p in target.iterdir() if p.name not in ("bin", "__pycache__")}
    importable = {n for n in names if not n.endswith((".dist-info", ".egg-info"))}
    assert importable == {"runlog"}, f"pip install added {sorted(importable)}"
    # The owner's folders arrive inside it as real files, with their data.
    for sub in ("producers", "consumers", "schemas", "projections"):
        assert (target / "runlog" / sub / "__init__.py").is_file()
    assert list((target / "runlog" / "schemas" / "avro").rglob("v1.avsc"))


def _imported_names(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import statement in ``path``, wherever it is."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module, node.lineno))
    return found


def test_runlog_never_imports_the_tooling() -> None:
    """Tooling imports runlog, never the reverse: no runlog module imports ``tools`` (the
    clone-only commands load it by name at run time, through runlog.cli._tooling)."""
    problems = [
        f"{path}:{line}: {module} imports {name}"
        for module, path in MODULES.items()
        for name, line in _imported_names(path)
        if name == "tools" or name.startswith("tools.")
    ]
    assert not problems, "\n".join(problems)


def test_the_tooling_imports_runlog_modules_that_exist() -> None:
    """A module renamed in runlog fails here, not on the next `runlog bench`: each runlog
    module the tooling imports exists."""
    problems = []
    for path in sorted(TOOLING.rglob("*.py")):
        for name, line in _imported_names(path):
            if name.startswith("runlog.") and name not in MODULES:
                problems.append(f"{path.relative_to(ROOT)}:{line}: no module {name}")
    assert not problems, "\n".join(problems)


def test_a_projection_is_one_module_registered_once() -> None:
    """Each module of consumers/stores declares one projection whole (name, pure fold,
    store half) and the registry holds exactly those: the store iterates it, nothing else
    names the projections."""
    from runlog.consumers import stores

    declared = {}
    for path in sorted((PACKAGE / "consumers" / "stores").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"runlog.consumers.stores.{path.stem}")
        assert hasattr(module, "PROJECTION"), f"{path} declares no PROJECTION"
        declared[module.PROJECTION.name] = module.PROJECTION
    assert declared == stores.REGISTRY, "a module of consumers/stores is not registered"
    for name, projection in stores.REGISTRY.items():
        assert projection.handler.name == name
        assert projection.fold.__name__.startswith("runlog.projections."), projection.fold
        handler = stores.make_handler(name, "p", "t")
        assert isinstance(handler, projection.handler)
        assert handler.keys.projection == name
    assert set(stores.PROJECTIONS) | {stores.NOTIFY} == set(stores.KNOWN)


# The tests mirror the package (docs/development.md, "The tests are grouped as the package
# is"): the tests of runlog.<X...>._<m> are tests/<X...>/test_<m>.py or test_<m>_<topic>.py,
# and a file about a subpackage as a whole is named after it in its parent's folder
# (tests/consumers/test_runner_crash.py). tests/tools mirrors the repository's tools/ (not
# part of the package) the same way.
TESTS = ROOT / "tests"
# Folders of tests/ (relative, posix) -> the package whose modules their files are named after.
MIRROR_FOLDERS = {
    "producers": "runlog.producers",
    "consumers": "runlog.consumers",
    "consumers/runner": "runlog.consumers.runner",
    "consumers/stores": "runlog.consumers.stores",
    "projections": "runlog.projections",
    "log": "runlog.log",
    "schemas": "runlog.schemas",
    "fleet": "runlog.fleet",
    "stack": "runlog.stack",
    "cli": "runlog.cli",
    "ui": "runlog.ui",
    "integrations": "runlog.integrations",
    "tools": "tools",
    "tools/benchmarks": "tools.benchmarks",
}
# Scenarios, not modules: folders of their own, any names (unique all the same).
SCENARIO_FOLDERS = {"faults", "security", "erasure", "explorer", "integrations/conformance"}
# What tests import or read, holding no tests: the worker processes, the permanent logs.
SUPPORT_FOLDERS = {"workers", "fixtures"}
TEST_FOLDERS = set(MIRROR_FOLDERS) | SCENARIO_FOLDERS
# The checks of the package as a whole, at the top beside files named after a top-level
# module or subpackage of runlog (tests/test_topics.py, tests/test_cli_conventions.py).
PACKAGE_WIDE_TESTS = {
    "test_layout.py",
    "test_public_api.py",
    "test_docs.py",
    "test_doc_examples.py",
    "test_trace.py",
}
# A ratchet: how many of the package's modules (packages named as a whole included, the
# root and __main__ not) have a test file at the path their name gives. Today's count; raise
# it when you add one, never lower it (a test file moved off its module's name fails here).
MIRRORED_AT_LEAST = 79


def _tooling_modules() -> dict[str, Path]:
    """tools/'s modules by dotted name (``tools.benchmarks.scale``), as MODULES is runlog's."""
    out: dict[str, Path] = {}
    for path in sorted(TOOLING.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _test_names(package: str, modules: dict[str, Path]) -> dict[str, str]:
    """``<m>`` -> module, for the modules and subpackages directly inside ``package``: the
    names a test file in the folder mirroring ``package`` may start with (``test_<m>``)."""
    names = {}
    for module in modules:
        parent, _, last = module.rpartition(".")
        if parent == package and not last.startswith("__"):
            names[last.removeprefix("_")] = module
    return names


def _named_after(stem: str, names: dict[str, str]) -> str | None:
    """The module ``test_<m>`` or ``test_<m>_<topic>`` names (the longest ``<m>`` that fits:
    test_pydantic_ai_capability is pydantic_ai_capability's, not pydantic_ai's)."""
    fits = [m for m in names if stem == f"test_{m}" or stem.startswith(f"test_{m}_")]
    return names[max(fits, key=len)] if fits else None


def _folder(path: Path) -> str:
    """``path``'s folder relative to tests/, posix ("" for tests/ itself)."""
    rel = path.parent.relative_to(TESTS).as_posix()
    return "" if rel == "." else rel


def _inside(folder: str, tops: set[str]) -> bool:
    return any(folder == t or folder.startswith(t + "/") for t in tops)


def test_a_modules_tests_are_found_from_its_name() -> None:
    """Every test file in a mirroring folder is named after a module (or a subpackage) of
    the package that folder mirrors; the mirroring folders are exactly the packages that
    have tests; every basename is unique; and no fewer modules than MIRRORED_AT_LEAST have a
    test file at the path their name gives."""
    modules = {**MODULES, **_tooling_modules()}
    files = sorted(
        p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.relative_to(TESTS).parts
    )
    problems = []

    # (a) a file's name names a module of the package its folder mirrors.
    owner: dict[Path, str] = {}
    for path in files:
        folder = _folder(path)
        if _inside(folder, SCENARIO_FOLDERS) or (not folder and path.name in PACKAGE_WIDE_TESTS):
            continue
        package = "runlog" if not folder else MIRROR_FOLDERS.get(folder)
        if package is None:
            continue  # (b) names the folder
        names = _test_names(package, modules)
        module = _named_after(path.stem, names)
        if module is None:
            allowed = ", ".join(f"test_{m}[_<topic>].py" for m in sorted(names))
            problems.append(
                f"{path.relative_to(ROOT)}: named after no module of {package}; a test file "
                f"of tests/{folder or ''} is one of: {allowed}"
                + (f", or one of {sorted(PACKAGE_WIDE_TESTS)}" if not folder else "")
            )
        else:
            owner[path] = module

    # (b) the folders: each mirrors a package, is a scenario, or holds support files.
    for folder in sorted({_folder(p) for p in files} - {""}):
        if _inside(folder, SCENARIO_FOLDERS) or folder in MIRROR_FOLDERS:
            continue
        dotted = "runlog." + folder.replace("/", ".")
        hint = (
            f"add it to MIRROR_FOLDERS ({dotted} is a package)"
            if dotted in MODULES
            else (
                f"it mirrors no package ({dotted} is none) and is no scenario folder "
                f"({sorted(SCENARIO_FOLDERS)}): move its files to tests/<package>/test_<module>*.py"
            )
        )
        problems.append(f"tests/{folder}: {hint}")
    for folder, package in sorted(MIRROR_FOLDERS.items()):
        if package not in modules or modules[package].name != "__init__.py":
            problems.append(f"MIRROR_FOLDERS: tests/{folder} mirrors {package}, no package")
        elif not any(_folder(p) == folder for p in files):
            problems.append(f"MIRROR_FOLDERS: tests/{folder} holds no test file: drop it")
    for d in sorted(TESTS.rglob("*")):
        rel = d.relative_to(TESTS)
        if not d.is_dir() or any(part.startswith(("__", ".")) for part in rel.parts):
            continue
        held = rel.as_posix() in {_folder(p) for p in files}  # told above if it is wrong
        if not held and not _inside(rel.as_posix(), TEST_FOLDERS | SUPPORT_FOLDERS):
            problems.append(f"tests/{rel}: a folder that is no mirror, scenario or support folder")

    # pytest imports test files by basename (no __init__.py): two equal names would clash.
    names = [p.name for p in files]
    problems += [
        f"{n}: {names.count(n)} test files of this name"
        for n in sorted(set(names))
        if names.count(n) > 1
    ]
    assert not problems, "the tests do not mirror the package:\n" + "\n".join(problems)

    # (c) the ratchet: modules with a test file at their name.
    mirrored = {m for m in owner.values() if m in MODULES}
    counted = {m for m in MODULES if m != "runlog" and not m.endswith(".__main__")}
    assert len(mirrored) >= MIRRORED_AT_LEAST, (
        f"{len(mirrored)} of {len(counted)} modules have a test file at their name, fewer than "
        f"MIRRORED_AT_LEAST = {MIRRORED_AT_LEAST}: a test file moved off its module's name? "
        f"without one: {sorted(counted - mirrored)}"
    )


def test_only_the_shell_imports_the_console_renderer() -> None:
    """rich draws terminals: the CLI (and the tooling) may import it, never a layer a worker or a
    projection service loads (opening a run must not pay for it)."""
    shell = _layer("runlog.cli")
    problems = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            rich = any(n == "rich" or n.startswith("rich.") for n in names)
            if rich and _layer(_unit(module)) < shell:
                problems.append(f"{path}:{node.lineno}: {module} imports rich")
    assert not problems, "\n".join(problems)


# Where a module's reason to change puts it (issue 31): the writer's snapshot cache and a
# run's replay are log access; a projection's store is a module of consumers/stores.
HOMES = {
    "runlog.log._snapshots": "log access",
    "runlog.log._replay": "log access",
    "runlog.log._metrics": "log access",
    "runlog.consumers.stores": "writer and services",
    "runlog.consumers.runner._loop": "writer and services",
    "runlog.cli._progress": "shell: CLI, stack, console",
    "runlog.stack._faults": "shell: CLI, stack, console",
}


def test_modules_live_in_their_layers() -> None:
    for module, layer in HOMES.items():
        assert module in MODULES, f"{module} moved: update HOMES and the docs that name it"
        assert LAYERS[_layer(_unit(module))][0] == layer, module


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_defined(tree: ast.AST) -> set[str]:
    """The ``_``-names a module defines: functions, classes, assigned names and attributes
    (``self._x = ...``, class and dataclass fields), parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _import_bases(module: str, node: ast.ImportFrom) -> list[str]:
    """The modules ``from ... import`` may name in ``module`` (a relative import's base is
    its package, or the module itself when it is a package's __init__)."""
    if node.level == 0:
        return [node.module or ""]
    parts = module.split(".")
    tail = [node.module] if node.module else []
    return [".".join(parts[: len(parts) - k] + tail) for k in (node.level, node.level - 1)]


def _foreign_private_uses(sources: dict[str, str]) -> list[str]:
    """Where a module touches another module's ``_``-names: ``from m import _name``, and
    ``x._name`` (x not ``self``, ``cls`` or ``super()``) for a ``_name`` that some runlog
    module defines and this one does not (its own privates, on any object, are its own;
    a name no runlog module defines is a third party's). Dunders are not private."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    defined = {m: _private_defined(t) for m, t in trees.items()}
    ours = set().union(*defined.values())
    found: list[str] = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                # A private module of a package is the package's to import: only a name
                # that is not a module counts.
                bases = _import_bases(module, node)
                found += [
                    f"{module}:{node.lineno}: from {node.module} import {a.name}"
                    for a in node.names
                    if _private(a.name) and not any(f"{b}.{a.name}" in sources for b in bases)
                ]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                    continue
                if node.attr in ours - defined[module]:
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_touches_another_modules_private_names() -> None:
    """A module's ``_``-names are its own: what other modules use is named as an interface
    (the run's engine is reached through its public members, from a handle by
    ``handle.engine_of``). Counted over every module of the package: zero."""
    found = _foreign_private_uses({m: p.read_text() for m, p in MODULES.items()})
    assert not found, f"{len(found)} uses of another module's _-names:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_kinds_of_access() -> None:
    """The checker itself: an import of a private name and an attribute access to another
    module's private member count; the module's own, ``self``'s and a dunder do not."""
    sources = {
        "runlog.a": "class A:\n    def __init__(self):\n        self._x = 1\n"
        "def _helper():\n    return 1\n",
        "runlog._c": "X = 1\n",
        "runlog.b": "from runlog.a import _helper\nfrom runlog import _c\n"
        "def f(a):\n    return a._x, a.__class__\n"
        "class B:\n    def __init__(self):\n        self._y = 2\n"
        "    def g(self, other):\n        return self._y + other._y\n",
    }
    found = _foreign_private_uses(sources)
    assert [f.split(": ", 1)[1] for f in found] == ["from runlog.a import _helper", "a._x"]


def test_every_internal_module_is_private_by_name() -> None:
    """From its path alone a reader knows whether a module is public: the modules
    runlog._PUBLIC_MODULES declares, packages' __init__ and __main__ keep their names, every
    other module is a ``_`` name (tools/privatize.py renames one that is not)."""
    import runlog

    public = set(runlog._PUBLIC_MODULES)
    assert public <= MODULES.keys(), f"declared public but absent: {public - MODULES.keys()}"
    named_public = sorted(
        module
        for module, path in MODULES.items()
        if module not in public
        and path.name not in ("__init__.py", "__main__.py")
        and not module.rsplit(".", 1)[-1].startswith("_")
    )
    assert not named_public, (
        f"{len(named_public)} internal modules are public by name (run tools/privatize.py): "
        + ", ".join(named_public)
    )


# The projection runner is composed, not inherited: the loop owns its collaborators
# (positions, the rebuild fence, the batch applier, retrying), each used through its
# public interface. The error tree is the one hierarchy it may extend.
RUNNER = "runlog.consumers.runner"


def _runlog_bases(classes: list[type]) -> list[str]:
    """``class: base`` for every class whose ancestry holds another runlog class (an
    exception's ``RunlogError`` ancestry excepted: that is the error tree)."""
    found = []
    for cls in classes:
        if issubclass(cls, BaseException):
            continue
        found += [
            f"{cls.__module__}.{cls.__qualname__}: {base.__module__}.{base.__qualname__}"
            for base in cls.__mro__[1:]
            if base.__module__ == "runlog" or base.__module__.startswith("runlog.")
        ]
    return found


def test_the_runner_is_composed_not_inherited() -> None:
    classes = []
    for module in sorted(m for m in MODULES if m == RUNNER or m.startswith(RUNNER + ".")):
        mod = importlib.import_module(module)
        classes += [
            obj for obj in vars(mod).values() if isinstance(obj, type) and obj.__module__ == module
        ]
    assert {c.__name__ for c in classes} >= {"ProjectionRunner", "BatchApplier", "RebuildFence"}
    found = _runlog_bases(classes)
    assert not found, "runner classes inheriting runlog classes:\n" + "\n".join(found)


def test_the_inheritance_check_sees_a_runlog_base() -> None:
    """The checker itself: a runlog base counts, also two levels up; an error does not."""
    from runlog.errors import RunlogError

    base = type("Base", (), {"__module__": "runlog.a"})
    mid = type("Mid", (base,), {"__module__": "runlog.b"})
    leaf = type("Leaf", (mid,), {"__module__": "runlog.c"})
    error = type("Oops", (RunlogError,), {"__module__": "runlog.c"})
    plain = type("Plain", (), {"__module__": "runlog.c"})
    assert _runlog_bases([leaf, error, plain]) == [
        "runlog.c.Leaf: runlog.b.Mid",
        "runlog.c.Leaf: runlog.a.Base",
    ]


def _function_level_imports(module: str, path: Path) -> list[str]:
    """``path:line: target`` for every import of a runlog module inside a function or a
    class of ``path`` (one there would only ever hide a cycle: the runner has no optional
    dependency to load late)."""
    tree = ast.parse(path.read_text(), str(path))
    inner = {
        id(node): node
        for outer in ast.walk(tree)
        if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for node in ast.walk(outer)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    nested = sorted(inner.values(), key=lambda node: node.lineno)
    found = []
    for node in nested:
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if not node.level
            else [module]  # a relative import is the package's own
        )
        found += [
            f"{path}:{node.lineno}: {n}" for n in names if n == "runlog" or n.startswith("runlog.")
        ]
    return found


def test_the_runner_has_no_function_level_import_of_runlog() -> None:
    found = [
        hit
        for module, path in MODULES.items()
        if module == RUNNER or module.startswith(RUNNER + ".")
        for hit in _function_level_imports(module, path)
    ]
    assert not found, "function-level imports in the runner:\n" + "\n".join(found)


def test_the_function_level_import_check_sees_one(tmp_path: Path) -> None:
    """The checker itself: an import in a function or a method counts, a top-level one and
    a third party's do not."""
    mod = tmp_path / "mod.py"
    mod.write_text(
        "import json\nfrom runlog.errors import RunlogError\n"
        "def f() -> None:\n    import json\n    from runlog import _settings\n"
        "class C:\n    def g(self) -> None:\n        import runlog.log\n"
    )
    found = _function_level_imports("runlog.mod", mod)
    assert [f.split(": ", 1)[1] for f in found] == ["runlog", "runlog.log"]
