"""`get_sandbox`: pick the best tier that works here; `diagnose`: say which and why."""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from typing import Any

from .base import IsolationUnavailableError, Limits, Sandbox, SandboxError
from .bwrap import BwrapSandbox
from .docker import DEFAULT_IMAGE, DockerSandbox, docker_available, image_present, missing_image_hint
from .rlimit import RlimitSandbox, warn_once
from .pool import SandboxPool

# sandbox.backend's values (config.SandboxBackend). Written here too: the sandbox imports nothing outside the
# standard library (it loads under `python -S`, tests/sandbox/test_sandbox.py); a test keeps the two equal.
BACKENDS = ("auto", "bwrap", "rlimit", "docker")


@dataclass(frozen=True)
class TierStatus:
    """Whether one tier works on this machine, and the reason in one line."""

    tier: str
    available: bool
    isolated: bool
    reason: str


def _userns_hints() -> list[str]:
    hints = []
    for path, bad in (
        ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
        ("/proc/sys/user/max_user_namespaces", "0"),
        ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"),
    ):
        try:
            with open(path) as f:
                if f.read().strip() == bad:
                    hints.append(f"{path} = {bad}")
        except OSError:
            pass
    return hints


@functools.lru_cache(maxsize=8)
def probe_bwrap(python: str | None = None) -> TierStatus:
    """Run a real program in a real bwrap sandbox (once per process, ~20 ms)."""
    if not shutil.which("bwrap"):
        return TierStatus("bwrap", False, True, "bwrap is not installed (apt-get install bubblewrap)")
    try:
        sb = BwrapSandbox(python=python)
        r = sb.run("print(6 * 7)", limits=Limits(timeout_s=20))
    except SandboxError as e:
        return TierStatus("bwrap", False, True, str(e))
    if r.stdout.strip() == "42" and r.exit_code == 0:
        note = f"; {sb.python_note}" if sb.python_note else ""
        return TierStatus("bwrap", True, True, f"user namespaces work; the sandbox runs as {sb.host_identity}{note}")
    why = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
    hints = _userns_hints()
    if hints:
        why += f" [{'; '.join(hints)}]"
    return TierStatus("bwrap", False, True, f"bwrap cannot create namespaces here: {why}")


@functools.lru_cache(maxsize=8)
def probe_docker(image: str | None = None, docker: str = "docker") -> TierStatus:
    """The Docker tier's real state: client, daemon, image, and one real run (~1 s)."""
    image = image or DEFAULT_IMAGE
    ok, why = docker_available(docker)
    if not ok:
        return TierStatus("docker", False, True, why)
    if not image_present(image, docker):
        return TierStatus("docker", False, True, f"{why}; {missing_image_hint(image)}")
    sb = DockerSandbox(image=image, docker=docker, check=False)
    r = sb.run("import os; print(6 * 7, os.getuid())", limits=Limits(timeout_s=30))
    if r.error or r.stdout.split() != ["42", "65534"]:
        said = r.error or (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
        return TierStatus("docker", False, True, f"{why}, image {image}: a test run failed: {said}")
    return TierStatus("docker", True, True,
                      f"{why}, image {image}; a test run as uid 65534 took {r.duration_s:.2f} s")


def diagnose(docker: bool = True, image: str | None = None) -> list[TierStatus]:
    """Status of every tier, best first. Used by ``actloop sandbox doctor``."""
    out = [probe_bwrap()]
    if docker:
        out.append(probe_docker(image))
    root = os.geteuid() == 0
    detail = ("throw-away uid per run (host is root)" if root and shutil.which("setpriv")
              else "runs as your own uid: it can read your files and signal your processes")
    out.append(TierStatus("rlimit", True, False, f"always available, NO isolation; {detail}"))
    return out


def get_sandbox(
    backend: str = "auto",
    *,
    require_isolation: bool = False,
    limits: Limits | None = None,
    pool_size: int | None = None,
    **kwargs: Any,
) -> Sandbox:
    """The sandbox to use.

    Args:
        backend: ``"auto"`` (bwrap if it works here, else the rlimit fallback with a loud
            warning), ``"bwrap"``, ``"rlimit"`` or ``"docker"`` (never chosen by auto: it
            needs a daemon and an image, and costs ~0.5 s per run).
        require_isolation: refuse to return a tier without namespace isolation: raises
            `IsolationUnavailableError` instead of falling back. Set it for any run whose
            code you would not execute in your own shell.
        limits: default `Limits` of the sandbox.
        pool_size: if set, wrap the sandbox in a `SandboxPool` of that many slots.
        **kwargs: passed to the backend (`python`, `python_path`, `image`, ...).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose from {BACKENDS}")
    sb: Sandbox
    if backend == "auto":
        status = probe_bwrap(kwargs.get("python"))
        if status.available:
            sb = BwrapSandbox(limits, **kwargs)
        elif require_isolation:
            raise IsolationUnavailableError(
                f"require_isolation=True but no isolating sandbox works here: {status.reason}. "
                "Install bubblewrap and allow unprivileged user namespaces, or use backend='docker'."
            )
        else:
            warn_once(status.reason)
            sb = RlimitSandbox(limits, warn=False, **kwargs)
    elif backend == "bwrap":
        status = probe_bwrap(kwargs.get("python"))
        if not status.available:
            raise SandboxError(f"bwrap backend unavailable: {status.reason}")
        sb = BwrapSandbox(limits, **kwargs)
    elif backend == "rlimit":
        if require_isolation:
            raise IsolationUnavailableError(
                "require_isolation=True refuses backend='rlimit': it runs code without namespace "
                "isolation (network, host files and processes are reachable)."
            )
        sb = RlimitSandbox(limits, **kwargs)
    else:
        sb = DockerSandbox(limits, **kwargs)
    return SandboxPool(sb, pool_size) if pool_size else sb


def sandbox_from_config(backend: str, docker_image: str, require_isolation: bool) -> Sandbox:
    """The sandbox a config's ``sandbox`` section asks for (keys as in `actloop config show`)."""
    kwargs: dict[str, Any] = {"image": docker_image} if backend == "docker" else {}
    return get_sandbox(backend, require_isolation=require_isolation, **kwargs)
