"""The README is a door and the docs site its house: both checked without a stack.

- README.md stays short, and every relative link in it names a file that exists;
- no code example in README.md or docs/ imports an internal module: examples use the public
  names (``runlog``, ``runlog.aio``, ``runlog.integrations.*``) only;
- the generated settings page names every ``RUNLOG_*`` variable the package's code mentions,
  and documents each (nothing rendered as UNDOCUMENTED);
- the generated CLI page holds every subcommand of ``runlog.cli.build_parser()``;
- every source or test file a page names (``consumers/_store.py``, ``tests/producers/...``)
  exists, so a page cannot go on naming a module after it moved;
- the generated reference pages checked in (CLI, settings) are what the code generates now;
- every page says whom it is for in its first lines, and the architecture page's layer
  table names the layers ``tests/test_layout.py`` enforces.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path
from types import ModuleType

import pytest

import runlog

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 320

LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# Indented fences too (in a list item); [ \t], not \s: \s would take the blank lines before a
# fence into its indent and pair one block's closing fence with the next one's opening.
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
# The public modules, as runlog/__init__.py lists them (tests/test_public_api.py pins them).
PUBLIC_MODULES = frozenset(runlog._PUBLIC_MODULES)
PUBLIC = re.compile("^(" + "|".join(re.escape(m) for m in sorted(PUBLIC_MODULES)) + ")$")
# ``runlog.integrations.pydantic_ai`` is reached through its package.
PUBLIC_PACKAGES = frozenset({"runlog.integrations"})
IMPORT = re.compile(r"^\s*(?:from\s+(runlog[\w.]*)\s+import|import\s+(runlog[\w.]*))", re.M)
# Internal packages named in an example even without an import (runlog.log._fold.read_run(...)).
INTERNAL = re.compile(r"\brunlog\.(producers|consumers|schemas|projections|log|stack)\b")


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# A file of the tree named in a page's text: `consumers/_store.py`, `tests/cli/test_x.py`.
NAMED_FILE = re.compile(
    r"`((?:runlog|producers|consumers|schemas|projections|tests|docs)/[\w./-]*\w)`"
)


def test_pages_name_files_that_exist() -> None:
    """Paths in backticks name files or folders of this tree (globs and placeholders aside:
    ``tests/test_x.py`` in the development guide stands for any test)."""
    missing = []
    for page in _pages():
        for path in NAMED_FILE.findall(page.read_text()):
            if path.endswith("test_x.py") or any(c in path for c in "*<"):
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)


def test_readme_is_short() -> None:
    # The doc-test marks (tests/test_doc_examples.py) are comments the reader never sees.
    text = README.read_text()
    lines = text.count("\n") - text.count("<!-- doc-test:")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_readme_relative_links_exist() -> None:
    broken = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the README itself
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to missing files: {broken}"


def _python_blocks(page: Path) -> list[str]:
    return [m.group(3) for m in FENCE.finditer(page.read_text()) if m.group(2) in ("python", "py")]


def test_examples_import_public_names_only() -> None:
    internal = []
    for page in _pages():
        for block in _python_blocks(page):
            for m in IMPORT.finditer(block):
                module = m.group(1) or m.group(2)
                if not PUBLIC.match(module):
                    internal.append(f"{page.relative_to(ROOT)}: {module}")
            internal += [f"{page.relative_to(ROOT)}: runlog.{m}" for m in INTERNAL.findall(block)]
    assert not internal, f"examples import internal modules: {internal}"


def _runlog_attributes(block: str) -> list[str]:
    """X of every ``runlog.X`` in the code (not in its strings or comments)."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(block).readline)]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        toks = []
    code = [t for t in toks if t.type in (tokenize.NAME, tokenize.OP)]
    return [
        c.string
        for a, b, c in zip(code, code[1:], code[2:], strict=False)
        if a.string == "runlog" and b.string == "." and c.type == tokenize.NAME and a.end == b.start
    ]


def test_examples_use_public_names_of_runlog_only() -> None:
    """``runlog.X`` in an example is a name of ``runlog.__all__`` (the test doubles are
    ``runlog.testing.X``, not ``runlog.X``)."""
    unknown = []
    for page in _pages():
        for block in _python_blocks(page):
            for name in _runlog_attributes(block):
                if name not in runlog.__all__ and f"runlog.{name}" not in PUBLIC_PACKAGES:
                    unknown.append(f"{page.relative_to(ROOT)}: runlog.{name}")
    assert not unknown, f"examples use names runlog does not export: {sorted(set(unknown))}"


def test_internal_import_check_catches_one() -> None:
    """The check above must see an internal import in a fenced block (it once matched none)."""
    block = "```python\nimport runlog\nfrom runlog.producers.run import Run\n```\n"
    blocks = [b.group(3) for b in FENCE.finditer(block)]
    found = [m.group(1) or m.group(2) for b in blocks for m in IMPORT.finditer(b)]
    assert [f for f in found if not PUBLIC.match(f)] == ["runlog.producers.run"]


def test_settings_page_names_every_variable() -> None:
    gen = _gen()
    page = gen.settings_markdown()
    assert "UNDOCUMENTED" not in page, [ln for ln in page.splitlines() if "UNDOCUMENTED" in ln]
    # Independently of the generator: every literal RUNLOG_* name in the package's code,
    # and every stack variable the stack composes from its port table.
    from runlog.stack import _config as config

    names = set(gen.names_in(gen.PACKAGE_DIRS)) | set(gen.names_in(("tests",)))
    for kind, services in config._DEFAULT_PORTS.items():
        names |= {f"RUNLOG_{kind}_{service}_PORT" for service in services}
        names.add(f"RUNLOG_{kind}_KAFKA_HEAP")
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"the settings page does not name: {missing}"


@pytest.mark.parametrize("source", ["runlog/_settings.py", "runlog/ui/_auth.py"])
def test_settings_fields_have_docstrings(source: str) -> None:
    gen = _gen()
    cls = dict(gen.SETTINGS_SOURCES)[source]
    undocumented = [f.env for f in gen.settings_fields(source, cls) if not f.doc]
    assert not undocumented, f"settings without a docstring: {undocumented}"


def test_cli_page_has_every_command() -> None:
    from runlog.cli import build_parser

    page = _gen().cli_markdown()

    def walk(prefix: str, parser: argparse.ArgumentParser) -> list[str]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out += [f"{prefix} {name}", *walk(f"{prefix} {name}", sub)]
        return out

    commands = walk("runlog", build_parser())
    assert len(commands) > 20
    missing = [c for c in commands if f"`{c}`" not in page]
    assert not missing, f"the CLI page lacks: {missing}"


def _words(text: str) -> list[str]:
    return text.split()


def test_generated_reference_pages_are_current() -> None:
    """The CLI and settings pages are checked in whole, so GitHub shows them; regenerate
    them with ``make reference`` when this fails."""
    gen = _gen()
    stale = []
    for name, (page, render) in gen.GENERATED.items():
        text = (DOCS / page).read_text()
        # Compared word by word: argparse wraps a usage line differently from one Python
        # to the next (3.13 keeps the choices and "..." on one line), which is not staleness.
        if _words(gen.fill(text, name, render())) != _words(text):
            stale.append(f"docs/{page}")
    assert not stale, f"stale generated pages (run `make reference`): {stale}"


def test_generated_region_check_sees_a_stale_page() -> None:
    gen = _gen()
    page = f"# X\n\n{gen.begin('cli')}\n\nold\n\n{gen.end('cli')}\n\nafter\n"
    assert gen.fill(page, "cli", "old") == page
    assert gen.fill(page, "cli", "new") != page
    assert gen.fill(page, "cli", "new").endswith(f"new\n\n{gen.end('cli')}\n\nafter\n")


AUDIENCE = re.compile(r"^\*For .+\*$")


def test_every_page_says_whom_it_is_for() -> None:
    """Within its first lines (after the title), an italic ``*For ...*`` paragraph."""
    missing = []
    for page in sorted(DOCS.rglob("*.md")):
        head = "\n".join(page.read_text().splitlines()[1:8])
        paragraphs = [p.replace("\n", " ") for p in head.split("\n\n")]
        if not any(AUDIENCE.match(p.strip()) for p in paragraphs):
            missing.append(str(page.relative_to(ROOT)))
    assert not missing, f"pages that do not say whom they are for: {missing}"


def test_architecture_page_names_every_layer() -> None:
    spec = importlib.util.spec_from_file_location("test_layout", ROOT / "tests" / "test_layout.py")
    assert spec is not None and spec.loader is not None
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    rows = {}
    for line in (DOCS / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and "`runlog" in cells[1]:
            rows[cells[0]] = set(re.findall(r"`(runlog[\w.]*)`", cells[1]))
    assert {layer: set(modules) for layer, modules in layout.LAYERS} == rows
