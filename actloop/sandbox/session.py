"""`PythonSession`: a persistent Python interpreter tool for agents (ReTool-style).

One long-lived REPL server process per episode runs inside the sandbox and keeps its
variables between calls, so the model can build on earlier results the way a person does
in a notebook. Each call has its own wall-clock timeout and output cap. After a timeout or
a crash the sandbox is killed, the model is told plainly that its state is gone, and the
next call starts a fresh interpreter — an episode never hangs and never aborts.

Why a server and not one run per call with replayed history: replay re-executes side
effects and costs O(n^2); a live process is what "the interpreter" means to the model.

Not protected against (beyond the sandbox tier's own list): a cell can leave background
threads running between calls; they share the session's CPU-time budget (`Limits.cpu_s`
covers the whole session) and die with it. The session lives until `close()`, garbage
collection of the `PythonSession`, or the host process's exit (bwrap: ``--die-with-parent``).
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from . import clock
from ._proc import SandboxProcess
from .base import Limits, Sandbox, SandboxError
from .factory import get_sandbox

_SERVER_SOURCE = (Path(__file__).with_name("_repl.py")).read_text()

DEFAULT_SESSION_LIMITS = Limits(timeout_s=10.0, cpu_s=120.0, memory_mb=1024, max_output_bytes=8 * 1024)
"""Per call: 10 s wall clock, 8 KiB of output. Per session: 120 CPU-seconds, 1 GiB of
address space (numpy/sympy need a few hundred MiB of it), the usual process/file caps."""

RESTART_NOTE = (
    "The Python session was restarted: variables, functions and imports from earlier "
    "calls are gone."
)


@dataclass(frozen=True)
class ToolOutput:
    """One call's result. `str(output)` is what to show the model.

    Attributes:
        text: captured stdout+stderr (interleaved as printed) and the repr of a final
            expression, or the explanation of a timeout/crash.
        ok: the cell ran to the end without an exception.
        timed_out: the call hit its time limit and the session was killed.
        restarted: the session's state was lost in this call (timeout or crash).
        truncated: the output was cut to `max_output_bytes` (head and tail kept).
        duration_s: wall-clock seconds of the call, including a (re)start.
        tier: the sandbox tier the interpreter runs in.
    """

    text: str
    ok: bool
    timed_out: bool = False
    restarted: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    tier: str = ""

    def __str__(self) -> str:
        return self.text


class PythonSession:
    """A persistent Python interpreter in a sandbox. Use as a context manager.

    >>> with PythonSession() as py:                     # doctest: +SKIP
    ...     py.execute("x = 21")
    ...     print(py.execute("x * 2"))
    42

    Args:
        sandbox: any sandbox with `spawn` (default: `get_sandbox()`, the best tier here).
        limits: `Limits`; `timeout_s` and `max_output_bytes` apply per call, the others to
            the whole session. Default `DEFAULT_SESSION_LIMITS`.
        startup_timeout_s: how long a (re)start may take.
    """

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        limits: Limits | None = None,
        startup_timeout_s: float = 15.0,
    ) -> None:
        if sandbox is None:
            sandbox = get_sandbox()
        if not hasattr(sandbox, "spawn"):
            raise TypeError(f"{sandbox!r} cannot spawn long-lived processes")
        self.sandbox = sandbox
        self.limits = limits or DEFAULT_SESSION_LIMITS
        self.startup_timeout_s = startup_timeout_s
        self._proc: SandboxProcess | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0  # how many times state was lost (timeouts + crashes)
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def tier(self) -> str:
        return self.sandbox.tier

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the interpreter now (otherwise the first `execute` does)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closed:
            raise SandboxError("session is closed")
        if self._proc is not None:
            return
        proc: SandboxProcess = self.sandbox.spawn(  # type: ignore[attr-defined]
            ["python", "-c", _SERVER_SOURCE], limits=self.limits
        )
        assert proc.popen.stdout is not None
        os.set_blocking(proc.popen.stdout.fileno(), False)
        self._proc, self._buf = proc, b""
        self._finalizer = weakref.finalize(self, proc.close)
        msg = self._read_message(time.monotonic() + self.startup_timeout_s)
        if not isinstance(msg, dict) or not msg.get("ready"):
            err = self._stderr_tail()
            self._discard()
            raise SandboxError(f"python session failed to start ({msg!r}): {err}")

    def _discard(self) -> None:
        if self._proc is not None:
            self._proc.close()
            if self._finalizer is not None:
                self._finalizer.detach()
        self._proc, self._buf = None, b""

    def close(self) -> None:
        """Kill the interpreter and its sandbox. Idempotent."""
        with self._lock:
            self._closed = True
            self._discard()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O ------------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict[str, object] | str:
        """Next protocol line, or "timeout" / "eof"."""
        assert self._proc is not None and self._proc.popen.stdout is not None
        fd = self._proc.popen.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                if not sel.select(left):
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    return "eof"
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            msg = json.loads(line)
        except ValueError:
            return "garbled"
        return msg if isinstance(msg, dict) else "garbled"

    def _stderr_tail(self) -> str:
        if self._proc is None or self._proc.popen.stderr is None:
            return ""
        fd = self._proc.popen.stderr.fileno()
        os.set_blocking(fd, False)
        try:
            return os.read(fd, 4096).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    # -- the tool -------------------------------------------------------------------------
    def execute(self, code: str, *, timeout_s: float | None = None) -> ToolOutput:
        """Run one cell; never raises for anything the code does."""
        out = self._execute(code, timeout_s=timeout_s)
        clock.record(out.duration_s, out.timed_out)  # per-step sandbox time for the trainer's metrics
        return out

    def _execute(self, code: str, *, timeout_s: float | None = None) -> ToolOutput:
        timeout = timeout_s if timeout_s is not None else self.limits.timeout_s
        with self._lock:
            t0 = time.monotonic()
            self._ensure_started()
            assert self._proc is not None and self._proc.popen.stdin is not None
            req = json.dumps({"code": code, "max_output_bytes": self.limits.max_output_bytes})
            try:
                self._proc.popen.stdin.write(req.encode() + b"\n")
                self._proc.popen.stdin.flush()
                msg = self._read_message(time.monotonic() + timeout)  # a (re)start is free
            except (BrokenPipeError, OSError):
                msg = "eof"
            dt = time.monotonic() - t0
            if isinstance(msg, dict):
                return ToolOutput(
                    text=str(msg.get("output", "")), ok=not msg.get("error"),
                    truncated=bool(msg.get("truncated")), duration_s=dt, tier=self.tier,
                )
            # Timeout, crash or a broken protocol: the state is gone either way.
            self.restarts += 1
            if msg == "timeout":
                self._discard()
                text = (f"TimeoutError: the code did not finish within {timeout:g} s and was "
                        f"stopped. {RESTART_NOTE}")
                return ToolOutput(text=text, ok=False, timed_out=True, restarted=True,
                                  duration_s=time.monotonic() - t0, tier=self.tier)
            status = self._exit_status()
            err = self._stderr_tail()
            self._discard()
            text = f"The Python process died{status}. {RESTART_NOTE}"
            if err:
                text += f"\n{err[-2000:]}"
            return ToolOutput(text=text, ok=False, restarted=True,
                              duration_s=time.monotonic() - t0, tier=self.tier)

    async def aexecute(self, code: str, *, timeout_s: float | None = None) -> ToolOutput:
        return await asyncio.to_thread(self.execute, code, timeout_s=timeout_s)

    __call__ = execute

    def _exit_status(self) -> str:
        assert self._proc is not None
        try:
            rc = self._proc.popen.wait(timeout=1.0)
        except Exception:  # noqa: BLE001
            return ""
        if rc < 0 or rc > 128:
            sig = -rc if rc < 0 else rc - 128
            try:
                return f" (killed by {signal.Signals(sig).name})"
            except ValueError:
                return f" (signal {sig})"
        return f" (exit status {rc})"
