"""MkDocs hook: fills the generated reference pages (see docs/gen_reference.py).

A page holding ``<!-- generated: cli -->`` or ``<!-- generated: settings -->`` gets that
marker replaced by the page generated from the code at build time.
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

MARKERS = {
    "<!-- generated: cli -->": gen.cli_markdown,
    "<!-- generated: settings -->": gen.settings_markdown,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
