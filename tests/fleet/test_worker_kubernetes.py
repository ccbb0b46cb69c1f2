"""The Kubernetes Deployment in docs/howto/kubernetes.md is one a user can apply as is: it
parses, the worker's arguments parse with runlog's own CLI, every ``RUNLOG_*`` variable is
a setting, the grace period leaves room after the drain deadline, and the readiness probe
and the ``preStop`` hook name the file the worker makes and removes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from runlog._settings import Settings
from runlog.cli import build_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "kubernetes.md"
YAML_FENCE = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)
EXIT_ROOM_S = 5


def _deployment() -> dict[str, Any]:
    (block,) = YAML_FENCE.findall(PAGE.read_text())
    (doc,) = list(yaml.safe_load_all(block))
    assert isinstance(doc, dict)
    return doc


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_the_deployment_runs_a_worker_whose_arguments_parse() -> None:
    doc = _deployment()
    assert (doc["apiVersion"], doc["kind"]) == ("apps/v1", "Deployment")
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    container = _container(doc)
    assert container["command"] == ["runlog", "worker"]
    args = build_parser().parse_args([container["command"][1], *container["args"]])
    assert args.agents and args.ready_file


def test_its_environment_names_settings_only() -> None:
    known = {f"RUNLOG_{name.upper()}" for name in Settings.model_fields}
    env = {e["name"] for e in _container(_deployment())["env"]}
    assert env and env <= known, env - known


def test_the_grace_period_leaves_room_after_the_drain() -> None:
    doc = _deployment()
    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"]: e.get("value") for e in _container(doc)["env"]}
    drain = float(
        env.get("RUNLOG_WORKER_DRAIN_S") or Settings.model_fields["worker_drain_s"].default
    )
    assert grace >= drain + EXIT_ROOM_S


def test_readiness_and_pre_stop_name_the_ready_file() -> None:
    container = _container(_deployment())
    args = build_parser().parse_args(["worker", *container["args"]])
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe == ["test", "-f", args.ready_file]
    assert args.ready_file in container["lifecycle"]["preStop"]["exec"]["command"]
