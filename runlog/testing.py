"""Test doubles: an agent loop driven by a scripted model, so tests and demos need no LLM.

``ScriptedModel`` plays a fixed script of steps (``ModelStep`` with its ``Call``s,
``CompactStep``, ``ApprovalStep``, ``FinishStep``) and ``AgentLoop`` drives a ``runlog.Run``
with it, deriving its position from the run's folded log, so a worker killed anywhere and
restarted with the same run id continues where the log says it stopped. Public, like
``runlog`` itself; not what a production worker runs (that brings its own model, or uses
``runlog.integrations.pydantic_ai``).
"""

from __future__ import annotations

from runlog.producers._agent import (
    AgentLoop,
    ApprovalStep,
    Call,
    CompactStep,
    FinishStep,
    ModelStep,
    ScriptedModel,
    Step,
)

__all__ = [
    "AgentLoop",
    "ApprovalStep",
    "Call",
    "CompactStep",
    "FinishStep",
    "ModelStep",
    "ScriptedModel",
    "Step",
]
