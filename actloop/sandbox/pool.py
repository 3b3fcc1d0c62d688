"""`SandboxPool`: bound how many sandboxes run at once, for sync and async callers alike.

Why: a rollout step fans out G completions x N tests; starting them all at once would
oversubscribe the CPUs the trainer needs, and the watchdog deadlines would start firing
because of our own contention, not because of the programs. The pool is a semaphore in
front of any `Sandbox`; async callers wait on it without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import ExecResult, Files, Limits, Sandbox


class SandboxPool:
    """A `Sandbox` that runs at most `size` programs at a time on the wrapped sandbox.

    Sync `run` blocks on a semaphore; `arun` and `map` use the pool's own `size` worker
    threads, so at most `size` runs are ever in flight, whoever calls. The limit counts
    runs, not the processes inside them (those are bounded by `Limits.max_procs`).
    """

    def __init__(self, sandbox: Sandbox, size: int | None = None) -> None:
        self.sandbox = sandbox
        self.size = size or max(1, (os.cpu_count() or 2) // 2)
        if self.size < 1:
            raise ValueError("pool size must be >= 1")
        self._sem = threading.BoundedSemaphore(self.size)
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="actloop-sandbox")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0  # high-water mark, for tests and monitoring

    @property
    def tier(self) -> str:
        return self.sandbox.tier

    @property
    def isolated(self) -> bool:
        return self.sandbox.isolated

    @property
    def limits(self) -> Limits:
        return self.sandbox.limits  # type: ignore[attr-defined, no-any-return]

    def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Files | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        with self._sem:
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return self.sandbox.run(code, argv=argv, files=files, stdin=stdin, limits=limits)
            finally:
                with self._lock:
                    self.in_flight -= 1

    async def arun(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Files | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        loop = asyncio.get_running_loop()
        call = functools.partial(self.run, code, argv=argv, files=files, stdin=stdin, limits=limits)
        return await loop.run_in_executor(self._executor, call)

    def map(self, requests: Iterable[str | Mapping[str, Any]]) -> list[ExecResult]:
        """Run many programs, `size` at a time; results in input order. A request is a
        code string or a dict of `run` keyword arguments."""
        def one(req: str | Mapping[str, Any]) -> ExecResult:
            return self.run(req) if isinstance(req, str) else self.run(**req)

        return list(self._executor.map(one, requests))

    def spawn(self, *args: Any, **kw: Any) -> Any:
        """Long-lived processes (sessions) are not counted against the pool."""
        return self.sandbox.spawn(*args, **kw)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.sandbox.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxPool({self.sandbox!r}, size={self.size})"
