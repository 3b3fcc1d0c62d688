"""`RaySandbox`: a `Sandbox` whose runs execute on Ray actors, so code grading can use other
nodes' CPUs. Each `SandboxWorker` actor holds a real sandbox of its node (`get_sandbox`: bwrap
where it works there, else the rlimit fallback — `tier` says which) and runs one program at a time;
`RaySandbox` sends each run to the next actor in turn and returns the actor's `ExecResult`
unchanged. Limits are enforced on the actor's node by its sandbox, exactly as locally.

Long-lived interpreter sessions (`spawn`, used by `PythonSession` in gsm8k-tool) stay in this
process's own sandbox: a session is a pipe to a live process, not a request.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from actloop.config import ConfigError

from . import clock
from .base import AsyncMixin, ExecResult, Files, Limits, Sandbox, prepare_run
from .factory import get_sandbox


def ray_module():
    """The `ray` package, or a ConfigError saying how to install it (an optional extra)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray engines and sandboxes need ray: pip install 'actloop[ray]'") from None
    return ray


class SandboxWorker:
    """One sandbox actor's state (wrapped with `ray.remote` by `RaySandbox`)."""

    def __init__(self, backend: str = "auto", limits: Limits | None = None, require_isolation: bool = False):
        self.sandbox = get_sandbox(backend, require_isolation=require_isolation, limits=limits)

    def info(self) -> tuple[str, bool, Limits]:
        return self.sandbox.tier, self.sandbox.isolated, self.sandbox.limits

    def run(self, code: str | None, argv: Sequence[str] | None, files: Files | None, stdin: str | bytes | None,
            limits: Limits | None) -> ExecResult:
        return self.sandbox.run(code, argv=argv, files=files, stdin=stdin, limits=limits)

    def close(self) -> None:
        self.sandbox.close()


class RaySandbox(AsyncMixin):
    """Runs programs on `num_workers` Ray actors, round robin (at most one run per actor at a time)."""

    def __init__(self, num_workers: int = 1, backend: str = "auto", *, limits: Limits | None = None,
                 require_isolation: bool = False, cpus_per_worker: float = 0.5):
        if num_workers < 1:
            raise ValueError("RaySandbox needs at least one worker")
        ray = ray_module()
        actor = ray.remote(SandboxWorker).options(num_cpus=cpus_per_worker)
        self.workers = [actor.remote(backend, limits, require_isolation) for _ in range(num_workers)]
        infos = ray.get([w.info.remote() for w in self.workers])  # a worker that cannot start fails here
        self.tier, self.isolated, self.limits = infos[0]
        if any(i[0] != self.tier for i in infos):
            self.isolated = all(i[1] for i in infos)  # nodes differ: claim isolation only if all isolate
            self.tier = "/".join(sorted({i[0] for i in infos}))
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._local: Sandbox | None = None

    def run(self, code: str | None = None, *, argv: Sequence[str] | None = None, files: Files | None = None,
            stdin: str | bytes | None = None, limits: Limits | None = None) -> ExecResult:
        prepare_run(code, argv, files, stdin, limits, self.limits)  # bad arguments fail here, as locally
        with self._lock:
            worker = self.workers[next(self._next) % len(self.workers)]
        res = ray_module().get(worker.run.remote(code, argv, files, stdin, limits))
        clock.record(res.duration_s, res.timed_out)  # the actor's process has its own clock: count it here
        return res

    def spawn(self, *args: Any, **kw: Any) -> Any:
        """Interpreter sessions run in this process's sandbox (see the module docstring)."""
        if self._local is None:
            self._local = get_sandbox()
        return self._local.spawn(*args, **kw)  # type: ignore[attr-defined]

    def close(self) -> None:
        ray = ray_module()
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._local is not None:
            self._local.close()

    def __repr__(self) -> str:
        return f"RaySandbox(workers={len(self.workers)}, tier={self.tier!r})"

