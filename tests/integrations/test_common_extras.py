"""Importing an integration without its framework installed raises runlog's ``ConfigError``
(``MissingExtra``) naming the extra that installs it, not a bare ``ModuleNotFoundError``.

The framework is hidden in a fresh interpreter by a meta-path finder that refuses its
packages, as if the extra had never been installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HIDE_AND_IMPORT = textwrap.dedent(
    """
    import importlib, json, sys
    from importlib.abc import MetaPathFinder

    hidden, module = set(sys.argv[1].split(",")), sys.argv[2]

    class NotInstalled(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import runlog
    try:
        importlib.import_module(module)
    except runlog.ConfigError as exc:
        print(json.dumps({"type": type(exc).__name__, "config_error": True,
                          "extra": exc.extra, "package": exc.package,
                          "integration": exc.integration, "message": str(exc)}))
    except BaseException as exc:
        print(json.dumps({"type": type(exc).__name__, "config_error": False}))
    else:
        print(json.dumps({"type": None, "config_error": False}))
    """
)

CASES = [
    ("runlog.integrations.openai_agents", "agents", "openai-agents"),
    ("runlog.integrations.openai_agents", "openai", "openai-agents"),
    ("runlog.integrations.pydantic_ai", "pydantic_ai", "pydantic-ai"),
    ("runlog.integrations.pydantic_ai_capability", "pydantic_ai", "pydantic-ai"),
    ("runlog.integrations.langgraph", "langgraph", "langgraph"),
    ("runlog.integrations.langgraph", "langchain_core", "langgraph"),
]


def _import_without(hidden: str, module: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", HIDE_AND_IMPORT, hidden, module],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    got: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


@pytest.mark.parametrize(("module", "hidden", "extra"), CASES)
def test_an_integration_imported_without_its_extra_raises_config_error_naming_the_extra(
    module: str, hidden: str, extra: str
) -> None:
    got = _import_without(hidden, module)
    assert got["config_error"], got
    assert got["type"] == "MissingExtra"
    assert got["extra"] == extra and got["package"] == hidden
    assert got["integration"] == module
    assert f"runlog[{extra}]" in str(got["message"])  # the install command a user can paste


def test_a_module_missing_inside_an_installed_framework_is_not_called_a_missing_extra() -> None:
    """A broken install (a dependency of the framework gone, here the SDK's ``griffe``) is
    re-raised as it is: telling the user to install an extra they already have would send
    them the wrong way."""
    got = _import_without("griffe", "runlog.integrations.openai_agents")
    assert got == {"type": "ModuleNotFoundError", "config_error": False}
