"""A run's conversation as the fold keeps it: messages and the tool results among them.

Below the fold's modules (``run_state`` and ``lineage`` both build messages), so neither
needs the other to make one. Pure, like every fold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ToolResult:
    call_id: str
    name: str
    content: str
    is_error: bool = False


@dataclass
class Message:
    role: Literal["user", "assistant", "tool"]
    content: str = ""
    trust: Literal["user", "model", "tool", "untrusted"] = "user"
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_result: ToolResult | None = None
