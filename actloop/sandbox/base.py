"""Shared vocabulary of the sandbox package: limits, results, the `Sandbox` protocol.

Why a sandbox at all: in agentic RL the policy writes code and we run it thousands of
times per step. Most of it is merely wrong; some of it is accidentally destructive
(`rm -rf`, a fork loop, a 50 GB list); a little of it, under reward pressure, learns to
poke at its surroundings (read the grader, kill the parent, leave a daemon behind to win
the next episode). The sandbox makes every run start from the same clean, small world and
makes sure nothing it does outlives the run or reaches the host.

Tiers (every `ExecResult` says which one produced it):

- ``bwrap``  — Linux namespaces via bubblewrap: own user/pid/net/mount/ipc/uts namespaces,
  read-only view of the interpreter, size-capped tmpfs work dir, no network. The default.
- ``rlimit`` — fallback where namespaces are unavailable: a subprocess with rlimits, its own
  session, a clean environment and a temp dir (and, when the host runs as root, a throw-away
  uid per run). NOT isolation: see `actloop.sandbox.rlimit` for what it cannot contain.
- ``docker`` — for hosts with a Docker daemon: ``--network none``, cgroup memory/pids/CPU
  limits, read-only root, tmpfs work dir.

What no tier here protects against: kernel exploits (there is no seccomp filter and the
sandbox shares the host kernel), CPU cache/timing side channels, and a compromised
interpreter binary. For hostile code from the internet use a VM (gVisor, Firecracker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Tier = Literal["bwrap", "rlimit", "docker"]
"""Which mechanism ran the code. Only ``bwrap`` and ``docker`` isolate."""

ISOLATED_TIERS: frozenset[str] = frozenset({"bwrap", "docker"})

Files = Mapping[str, "str | bytes"]
"""Relative path inside the work directory -> content (text is written as UTF-8)."""


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not: the program failed)."""


class IsolationUnavailableError(SandboxError):
    """Raised when `require_isolation=True` but only the non-isolating tier works here."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run. Defaults suit unit-test-sized programs (MBPP, HumanEval).

    All limits are enforced by the kernel (rlimits, tmpfs size, cgroups for Docker), never
    by cooperating code inside the sandbox.

    Attributes:
        timeout_s: wall-clock limit. A watchdog on the host kills the *whole* sandbox
            (every process in it) when it passes. Default 10 s.
        cpu_s: CPU-seconds limit (RLIMIT_CPU, per process, rounded up to whole seconds;
            SIGXCPU then SIGKILL one second later). ``None`` (default) follows `timeout_s`,
            so a busy loop dies at the same time a sleeping one does. For a `PythonSession`
            this is the budget of the whole session, not of one call.
        memory_mb: address-space limit (RLIMIT_AS) per process, default 512 MiB. This is
            virtual memory, not RSS: generous for Python, but programs that reserve big
            arenas up front (JVM, Go, some BLAS builds) need more. Docker uses a cgroup
            memory limit of the same size instead, which counts real usage.
        max_procs: RLIMIT_NPROC, default 64. Counts processes *and threads*. Under bwrap it
            is counted inside the sandbox's own user namespace, so concurrent runs do not
            share it.
        max_open_files: RLIMIT_NOFILE, default 256.
        max_file_mb: RLIMIT_FSIZE, the largest single file a process may write, default 16.
        tmpfs_mb: size of the writable work directory (a RAM-backed tmpfs), default 64 MiB.
            It is the only writable place in the bwrap tier (``/tmp`` and ``/dev/shm``
            point into it). The rlimit tier cannot cap it (only `max_file_mb` applies).
        max_output_bytes: bytes kept per stream (stdout, stderr), default 64 KiB. Beyond
            that the head and tail are kept around a ``[actloop: ... truncated ...]``
            marker, and the rest is read and discarded so the program is not blocked.
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 512
    max_procs: int = 64
    max_open_files: int = 256
    max_file_mb: int = 16
    tmpfs_mb: int = 64
    max_output_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "cpu_s":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Limits.{f.name} must be a positive number, got {v!r}")

    @property
    def cpu_seconds(self) -> int:
        """Whole CPU seconds for RLIMIT_CPU (the soft limit); the hard limit is one more."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))

    def replace(self, **changes: object) -> Limits:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ExecResult:
    """What one sandboxed run produced. Canonical data: compare it on the host.

    Attributes:
        stdout, stderr: decoded as UTF-8 (invalid bytes replaced), each capped at
            `Limits.max_output_bytes` with a visible marker when cut.
        exit_code: the exit status; ``128 + N`` when killed by signal N (the shell and
            Docker convention, identical in every tier). 137 after a watchdog kill.
        timed_out: the wall-clock watchdog fired or the CPU-time limit was hit.
        oom: the program ran out of memory (MemoryError / allocation failure in stderr, or
            a cgroup OOM kill under Docker). A heuristic, documented as such.
        duration_s: wall-clock seconds from spawn to collection, the sandbox's start-up included
            (Docker: from the program's start; the container's start is not counted).
        tier: which sandbox tier ran it ("bwrap", "rlimit" or "docker").
        truncated: stdout or stderr was cut.
        error: set when the *sandbox* failed (could not start), never for program errors.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    oom: bool
    duration_s: float
    tier: str
    truncated: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Exited 0 within the limits. (Graders should still compare outputs, not this.)"""
        return self.exit_code == 0 and not self.timed_out and self.error is None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted code. Implementations: `BwrapSandbox`, `RlimitSandbox`,
    `DockerSandbox`, and `SandboxPool` (which wraps any of them to bound concurrency).

    Exactly one of `code` (Python source, run as ``main.py`` in the work dir) or `argv`
    (a command, resolved inside the sandbox; ``"python"`` means the sandbox's interpreter)
    is given. `files` are written into the work dir first; `stdin` is fed to the program.
    """

    tier: str
    isolated: bool
    limits: Limits

    def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Files | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult: ...

    async def arun(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Files | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult: ...

    def close(self) -> None: ...


class AsyncMixin:
    """`arun` for synchronous backends: the blocking run happens on a worker thread.

    The event loop never blocks; concurrency is bounded by the default executor here, and
    explicitly by `SandboxPool` (use it when you fan out many runs).
    """

    def run(self, code: str | None = None, **kw: object) -> ExecResult:  # pragma: no cover
        raise NotImplementedError

    async def arun(self, code: str | None = None, **kw: object) -> ExecResult:
        return await asyncio.to_thread(self.run, code, **kw)  # type: ignore[arg-type]


def prepare_run(code: str | None, argv: Sequence[str] | None, files: Files | None, stdin: str | bytes | None,
                limits: Limits | None, default: Limits) -> tuple[Limits, dict[str, bytes], bytes | None]:
    """The argument checks every backend's `run` starts with: exactly one of code / argv; files
    validated (code goes to ``main.py``); stdin as bytes. -> (limits, files, stdin bytes or None)."""
    if (code is None) == (argv is None) or (argv is not None and not argv):
        raise ValueError("pass exactly one of `code` or a non-empty `argv`")
    fs = check_files(files, reserved=("main.py",) if code is not None else ())
    if code is not None:
        fs["main.py"] = code.encode()
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return limits or default, fs, data


def check_files(files: Files | None, reserved: Sequence[str] = ()) -> dict[str, bytes]:
    """Validate relative paths (no absolute paths, no ``..``) and encode text to bytes."""
    out: dict[str, bytes] = {}
    for name, data in (files or {}).items():
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"sandbox file names must be plain relative paths, got {name!r}")
        if name in reserved:
            raise ValueError(f"{name!r} is reserved: it holds the `code` argument")
        out[name] = data.encode() if isinstance(data, str) else bytes(data)
    return out
