"""Reference pages generated from the code: the CLI and every ``RUNLOG_*`` variable.

Used by ``docs/hooks.py`` (the MkDocs build) and by ``tests/test_docs.py``; nothing here is
part of the runlog package. The CLI page is rendered from ``runlog.cli.build_parser()``; the
settings page from the classes that read ``RUNLOG_*`` variables (``runlog._settings.Settings``
and the console's settings, read from their source so no optional extra is imported), the
stack's port table, and the ``RUNLOG_*`` names found anywhere in the package's code.

The generated text is checked in, between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->`` in its page, so the pages read whole on GitHub too;
``tests/test_docs.py`` fails when it is not what the code generates now, and
``make reference`` (``python docs/gen_reference.py``) rewrites it.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The package's real folders: runlog/producers etc. are symlinks to the top-level ones,
# so walking these (without following links) sees every file once.
PACKAGE_DIRS = ("runlog", "producers", "consumers", "schemas", "projections")
NAME = re.compile(r"\bRUNLOG_[A-Z0-9_]*[A-Z0-9]\b")
# Settings classes (pydantic-settings) whose fields are RUNLOG_* variables.
SETTINGS_SOURCES = (("runlog/_settings.py", "Settings"), ("runlog/ui/_auth.py", "UiSettings"))

# Variables read outside the settings classes, with what they mean. Ports and heaps of the
# three local stacks are added from runlog.stack's own table (see stack_variables()); a
# RUNLOG_* name found in the code and in none of these is rendered as UNDOCUMENTED, which
# tests/test_docs.py refuses.
OTHER: dict[str, tuple[str, str]] = {
    "RUNLOG_STACK_DIR": (
        "`~/.local/state/runlog/stack`",
        "the local stack's state: data, logs, pid files, generated configs",
    ),
    "RUNLOG_CACHE_DIR": (
        "`~/.cache/runlog`",
        "downloaded jars (Kafka, the schema registry), shared by every local stack",
    ),
    "RUNLOG_STACK_NO_INSTALL": (
        "unset",
        "`1`: `runlog stack up` never runs `apt-get install redis-server`",
    ),
    "RUNLOG_STACK_REGISTRY_PORT": (
        "`{registry_port}`",
        "port of the schema registry `runlog stack up --registry` starts",
    ),
    "RUNLOG_STACK_REDIS_CLUSTER_PORT": (
        "`{redis_cluster_port}`",
        "first of the three masters of `runlog stack up --redis-cluster` (the next two ports "
        "are the others); state under `<state>/redis-cluster/`",
    ),
    "RUNLOG_SECURE_DIR": (
        "the plain stack's dir + `-secure`",
        "the secure stack's state: TLS material, `secrets/<role>.env`, data, logs",
    ),
    "RUNLOG_CLUSTER_DIR": (
        "`~/.local/state/runlog/cluster-<nodes>`",
        "the 3-node cluster's state (fault tests, explorer, soak)",
    ),
    "RUNLOG_BENCH_POSTGRES_URL": (
        "unset",
        "a Postgres server `runlog bench steps` measures LangGraph's `PostgresSaver` on "
        "(without one that row says why it was not measured)",
    ),
    "RUNLOG_BENCH_RESTATE_SERVER": (
        "unset",
        "a `restate-server` binary `runlog bench steps` runs Restate with (unset: the copy "
        "it fetches from the npm registry and caches under `~/.cache/runlog`)",
    ),
}
STACK_KINDS = {
    "STACK": "the local stack (`runlog stack up`)",
    "SECURE": "the secure stack (`runlog stack up --secure`)",
    "CLUSTER": "the 3-node cluster (`runlog stack up --nodes 3`)",
}
HEAPS = {"STACK": "512m", "SECURE": "384m", "CLUSTER": "384m"}
# Variables only the test suite and its tools read (tests/), for the development guide.
TEST_ONLY: dict[str, tuple[str, str]] = {
    "RUNLOG_TEST_TIMEOUT": ("`300`", "seconds per test"),
    "RUNLOG_TEST_NO_DOCKER": (
        "unset",
        "`1`: never start `docker-compose.yml` through testcontainers",
    ),
    "RUNLOG_FAULTS_KEEP": ("unset", "`1`: the fault suite leaves its 3-node cluster running"),
    "RUNLOG_FAULTS_SUMMARY": (
        "`~/.local/state/runlog/cluster-3/faults-summary.json`",
        "where the fault suite writes its summary",
    ),
    "RUNLOG_CONFORMANCE_KILLS": (
        "`30`",
        "SIGKILLs per integration in the integrations' conformance kill loop "
        "(`make soak-integrations`: 500)",
    ),
    "RUNLOG_CONFORMANCE_SEED": ("`7`", "the seed of the conformance harness's kill points"),
    "RUNLOG_UI_SCREENSHOTS": ("unset", "a folder: the browser test saves the console's pages"),
    "RUNLOG_TEST_REBUILD_HALT_AT": (
        "set by the test",
        "where `tests/workers/rebuild_worker.py` stops a rebuild (crash tests)",
    ),
    "RUNLOG_TEST_REBUILD_FLAG": (
        "set by the test",
        "the file `tests/workers/rebuild_worker.py` touches when it reached that point",
    ),
}


@dataclass(frozen=True)
class Field:
    env: str
    type: str
    default: str
    constraints: str
    doc: str
    secret: bool


def _docstring_after(body: list[ast.stmt], i: int) -> str:
    if i + 1 < len(body):
        nxt = body[i + 1]
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            return " ".join(nxt.value.value.split())
    return ""


def settings_fields(path: str, cls_name: str) -> list[Field]:
    """The fields of a pydantic-settings class, read from its source."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    prefix = ""
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "model_config" for t in node.targets
        ):
            call = node.value
            assert isinstance(call, ast.Call)
            for kw in call.keywords:
                if kw.arg == "env_prefix":
                    assert isinstance(kw.value, ast.Constant)
                    prefix = str(kw.value.value)
    assert prefix.startswith("RUNLOG_"), f"{cls_name}: no RUNLOG_ env_prefix"
    fields = []
    for i, node in enumerate(cls.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name == "model_config":
            continue
        ann = ast.unparse(node.annotation)
        default, constraints = "required", []
        value = node.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
            for kw in value.keywords:
                if kw.arg == "default":
                    default = ast.unparse(kw.value)
                elif kw.arg == "default_factory":
                    default = {"dict": "{}", "list": "[]"}.get(ast.unparse(kw.value), "…")
                elif kw.arg in ("ge", "gt", "le", "lt"):
                    op = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[kw.arg]
                    constraints.append(f"{op} {ast.unparse(kw.value)}")
        elif value is not None:
            default = ast.unparse(value)
        if default == "None":
            default = "unset"
        elif default == "()":
            default = "empty"
        fields.append(
            Field(
                env=prefix + name.upper(),
                type=re.sub(r"Annotated\[(.*), NoDecode\]", r"\1", ann).replace(" | ", " or "),
                default=default,
                constraints=", ".join(constraints),
                doc=_docstring_after(cls.body, i),
                secret="SecretStr" in ann,
            )
        )
    return fields


def stack_variables() -> dict[str, tuple[str, str]]:
    """Ports and heaps of the local stacks, from runlog.stack's own defaults."""
    from runlog.stack import _config as config
    from runlog.stack import _redis_cluster as redis_cluster
    from runlog.stack import _registry as registry

    out: dict[str, tuple[str, str]] = {}
    ports = config._DEFAULT_PORTS
    for kind, services in ports.items():
        for service, port in services.items():
            what = {
                "KAFKA": "Kafka's client port",
                "CONTROLLER": "the KRaft controller's port",
                "REDIS": "Redis' port",
                "INTERNAL": "the broker's own mutual-TLS listener",
            }[service]
            if kind == "CLUSTER" and service != "REDIS":
                what += " of node 1 (node n uses this + 2(n-1))"
            out[f"RUNLOG_{kind}_{service}_PORT"] = (f"`{port}`", f"{what}, {STACK_KINDS[kind]}")
        out[f"RUNLOG_{kind}_KAFKA_HEAP"] = (
            f"`{HEAPS[kind]}`",
            f"the broker JVM's `-Xmx`, {STACK_KINDS[kind]}",
        )
    fill = {
        "registry_port": registry.DEFAULT_REGISTRY_PORT,
        "redis_cluster_port": redis_cluster.DEFAULT_PORT,
    }
    for name, (default, meaning) in OTHER.items():
        out[name] = (default.format(**fill), meaning)
    return out


def names_in(dirs: tuple[str, ...]) -> dict[str, list[str]]:
    """Every RUNLOG_* name in the .py files under ``dirs``, with where it occurs."""
    found: dict[str, list[str]] = {}
    for d in dirs:
        for folder, _subdirs, files in os.walk(ROOT / d):  # symlinked folders: not followed
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = Path(folder) / f
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    for name in NAME.findall(line):
                        found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{n}")
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_markdown() -> str:
    lines: list[str] = []
    documented: set[str] = set()
    for path, cls_name in SETTINGS_SOURCES:
        fields = settings_fields(path, cls_name)
        lines += [
            f"### `{cls_name}` (`{path}`)",
            "",
            "| Variable | Type | Default | Meaning |",
            "|---|---|---|---|",
        ]
        for f in fields:
            documented.add(f.env)
            # the docstrings name their own variable for readers of the code; not here
            meaning = re.sub(rf"\s*\(``{f.env}``\)|^``{f.env}``: ", "", f.doc) or "UNDOCUMENTED"
            if f.constraints:
                meaning += f" Allowed: {f.constraints}."
            if f.secret and "Secret" not in meaning:
                meaning += " **Secret**: never printed, logged or serialised."
            default = f.default if f.default in ("unset", "empty", "{}") else f"`{f.default}`"
            kind = " or ".join(f"`{t}`" for t in f.type.split(" or "))
            lines.append(f"| `{f.env}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |")
        lines.append("")
    stack_vars = stack_variables()
    lines += [
        "### The local stacks (`runlog.stack`)",
        "",
        "Read by `runlog stack ...`, the test session and the fault tools; "
        "never by a worker or a projection service.",
        "",
        "| Variable | Default | Meaning |",
        "|---|---|---|",
    ]
    for name in sorted(stack_vars):
        default, meaning = stack_vars[name]
        documented.add(name)
        lines.append(f"| `{name}` | {_cell(default)} | {_cell(meaning)} |")
    lines.append("")
    found = names_in(PACKAGE_DIRS)
    stray = sorted(n for n in found if n not in documented)
    if stray:
        lines += ["### Other variables found in the code", "", "| Variable | Where |", "|---|---|"]
        for name in stray:
            lines.append(f"| `{name}` UNDOCUMENTED | {', '.join(found[name][:3])} |")
        lines.append("")
    lines += [
        "### The test suite (`tests/`)",
        "",
        "| Variable | Default | Meaning |",
        "|---|---|---|",
    ]
    for name in sorted(TEST_ONLY):
        default, meaning = TEST_ONLY[name]
        lines.append(f"| `{name}` | {_cell(default)} | {_cell(meaning)} |")
    lines.append("")
    return "\n".join(lines)


def _stable_formatter(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """``base`` that writes an option the same on every Python (3.13 shortened
    ``-o FILE, --out FILE`` to ``-o, --out FILE``), so the checked-in page stays current."""

    class Stable(base):  # type: ignore[valid-type,misc]
        def _format_action_invocation(self, action: argparse.Action) -> str:
            if not action.option_strings or action.nargs == 0:
                return str(super()._format_action_invocation(action))
            args = self._format_args(action, self._get_default_metavar_for_optional(action))
            return ", ".join(f"{option} {args}" for option in action.option_strings)

    return Stable


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = _stable_formatter(parser.formatter_class)
    parser.color = False  # type: ignore[attr-defined]  # Python 3.14 colours help on a tty
    return parser.format_help().rstrip()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def cli_markdown() -> str:
    """Every command and subcommand of ``runlog``, as its ``--help`` prints it."""
    from runlog.cli import EXIT_CODES, build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: make the page stable
    try:
        parser = build_parser()
        lines = [
            "## Exit codes",
            "",
            "The same for every command (`runlog.cli.EXIT_CODES`):",
            "",
            "| Code | Meaning |",
            "| ---: | --- |",
            *(f"| {code} | {meaning} |" for code, meaning in EXIT_CODES),
            "",
            "## `runlog`",
            "",
            "```text",
            _help(parser),
            "```",
            "",
        ]

        def walk(prefix: str, p: argparse.ArgumentParser, depth: int) -> None:
            for name, sub in _subcommands(p):
                full = f"{prefix} {name}"
                lines.extend(
                    [
                        f"{'#' * depth} `{full}`",
                        "",
                        "```text",
                        _help(sub),
                        "```",
                        "",
                    ]
                )
                walk(full, sub, min(depth + 1, 4))

        walk("runlog", parser, 2)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)


GENERATED = {
    "cli": ("reference/cli.md", cli_markdown),
    "settings": ("reference/settings.md", settings_markdown),
}
"""What each generated region holds: its page (under docs/) and the function that renders it."""


def begin(name: str) -> str:
    return f"<!-- generated: {name} -->"


def end(name: str) -> str:
    return f"<!-- end generated: {name} -->"


def fill(page: str, name: str, text: str) -> str:
    """``page`` with its region ``name`` (between the two markers) holding ``text``."""
    head, sep, rest = page.partition(begin(name))
    if not sep:
        raise ValueError(f"no {begin(name)} in the page")
    _old, sep, tail = rest.partition(end(name))
    if not sep:
        raise ValueError(f"{begin(name)} without {end(name)}")
    return f"{head}{begin(name)}\n\n{text.strip()}\n\n{end(name)}{tail}"


def main() -> None:
    """Rewrite the generated regions of the checked-in pages (``make reference``)."""
    for name, (page, render) in GENERATED.items():
        path = ROOT / "docs" / page
        old = path.read_text()
        new = fill(old, name, render())
        if new != old:
            path.write_text(new)
            print(f"docs/{page}: updated")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this tree's runlog, not an installed one
    main()
