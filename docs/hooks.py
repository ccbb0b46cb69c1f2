"""MkDocs hook: fills the generated reference pages (see docs/gen_reference.py).

A page's region between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
(NAME: ``cli``, ``settings``) is rendered again from the code at build time, so the site
never shows a stale copy; the copy checked in is for GitHub, and tests/test_docs.py keeps
it current.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this tree's runlog, not an installed one
# Import it now, while this tree comes first: later in the build another runlog on the
# path (an editable install of another clone) could be found instead.
import runlog  # noqa: E402

if not Path(runlog.__file__).resolve().is_relative_to(ROOT):
    raise RuntimeError(f"the docs would document {runlog.__file__}, not {ROOT}/runlog")

_spec = importlib.util.spec_from_file_location(
    "gen_reference", Path(__file__).with_name("gen_reference.py")
)
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
sys.modules["gen_reference"] = gen  # dataclasses look their module up there
_spec.loader.exec_module(gen)


def on_page_markdown(markdown: str, **_: Any) -> str:
    for name, (_page, render) in gen.GENERATED.items():
        if gen.begin(name) in markdown:
            markdown = gen.fill(markdown, name, render())
    return markdown
