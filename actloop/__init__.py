"""actloop: agentic reinforcement learning of open LLMs.

The public API for writing your own task (see docs/tasks.md):

    from actloop import Task, ToolEnv, tool, Message, RewardTerm

Names are loaded on first use (PEP 562), so `import actloop.config` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ChatEnv": "actloop.envs.base", "Env": "actloop.envs.base", "StepResult": "actloop.envs.base",
    "PromptEnv": "actloop.envs.prompted", "qa_shots": "actloop.envs.prompted",
    "ToolEnv": "actloop.envs.tools", "ToolError": "actloop.envs.tools", "tool": "actloop.envs.tools",
    "tool_schema": "actloop.envs.tools",
    "Flag": "actloop.rewards.flags", "Grade": "actloop.rewards.flags",
    "CODE_DETECTORS": "actloop.rewards.hacking", "MATH_DETECTORS": "actloop.rewards.hacking",
    "RewardTerm": "actloop.rewards.rubric", "Rubric": "actloop.rewards.rubric",
    "Task": "actloop.tasks.base",
    "Message": "actloop.types", "ToolCall": "actloop.types", "Trajectory": "actloop.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'actloop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
