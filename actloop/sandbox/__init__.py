"""Run model-written code safely: `get_sandbox().run(code) -> ExecResult`.

Tiers: ``bwrap`` (namespaces, the default), ``rlimit`` (fallback, no isolation, warns),
``docker`` (opt-in). `PythonSession` is a persistent interpreter tool for agents.
See docs/sandbox.md for what each tier protects against and what it does not.
"""

from .base import (
    ISOLATED_TIERS,
    ExecResult,
    IsolationUnavailableError,
    Limits,
    Sandbox,
    SandboxError,
    Tier,
)
from .bwrap import BwrapSandbox
from .docker import DockerSandbox
from .factory import TierStatus, diagnose, get_sandbox, probe_bwrap
from .pool import SandboxPool
from .rlimit import RlimitSandbox
from .session import DEFAULT_SESSION_LIMITS, PythonSession, ToolOutput

__all__ = [
    "DEFAULT_SESSION_LIMITS",
    "ISOLATED_TIERS",
    "BwrapSandbox",
    "DockerSandbox",
    "ExecResult",
    "IsolationUnavailableError",
    "Limits",
    "PythonSession",
    "RlimitSandbox",
    "Sandbox",
    "SandboxError",
    "SandboxPool",
    "Tier",
    "TierStatus",
    "ToolOutput",
    "diagnose",
    "get_sandbox",
    "probe_bwrap",
]
