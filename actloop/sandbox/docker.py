"""Docker backend, for hosts with a Docker daemon (and for hosts where bwrap cannot run).

Each run is ``docker run --rm`` of a throw-away container with:
``--network none``; a cgroup memory limit (``--memory`` = ``--memory-swap``, so no swap),
``--pids-limit``, ``--cpus``; ``--read-only`` root with a size-capped tmpfs at ``/sandbox``
(``TMPDIR`` points there) and a small ``/dev/shm``; ``--cap-drop ALL``,
``no-new-privileges``, uid 65534; rlimits via ``--ulimit`` (CPU time, open files, file
size); no host environment (only the variables we pass).

Files travel on stdin, ahead of the program's own stdin: a tiny Python preamble (so the
image must have ``python3``; the default is ``python:3.11-slim``) reads a length-prefixed
JSON header, writes the files into the tmpfs and execs the program on the rest of stdin.
There is no bind mount, so this also works when the client talks to a remote daemon.

The watchdog kills the container by name (``docker rm -f``): killing the ``docker run``
client alone would leave the container running.

Costs: a container start is 300-1000 ms, against ~15 ms for bwrap. Use it when you need a
cgroup memory limit or cannot use bwrap. What it does NOT protect against: kernel bugs
(containers share the host kernel; Docker's default seccomp profile narrows that surface),
and a daemon configured with ``--userns-remap`` off means container uid 0 is host uid 0 —
which is why we run as 65534 with no capabilities.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

from . import _proc
from .base import AsyncMixin, ExecResult, Files, Limits, SandboxError, check_files, prepare_run

log = logging.getLogger("actloop.sandbox")

DEFAULT_IMAGE = "python:3.11-slim"
WORKDIR = "/sandbox"

# Reads "<n>\n" + n bytes of JSON {"files": [[path, b64]], "argv": [...]} from fd 0 without
# reading past it, writes the files, then execs argv on the remaining stdin.
_BOOT = (
    "import os,json,base64\n"
    "h=b''\n"
    "while not h.endswith(b'\\n'):\n"
    " c=os.read(0,1)\n"
    " if not c:raise SystemExit('actloop: missing header')\n"
    " h+=c\n"
    "n=int(h);b=b''\n"
    "while len(b)<n:\n"
    " c=os.read(0,n-len(b))\n"
    " if not c:raise SystemExit('actloop: short header')\n"
    " b+=c\n"
    "s=json.loads(b)\n"
    "for p,d in s['files']:\n"
    " os.makedirs(os.path.dirname(p) or '.',exist_ok=True)\n"
    " with open(p,'wb') as f:f.write(base64.b64decode(d))\n"
    "os.execvp(s['argv'][0],s['argv'])\n"
)


@functools.lru_cache(maxsize=4)
def docker_available(docker: str = "docker") -> tuple[bool, str]:
    """(True, version) if ``docker info`` reaches a daemon, else (False, why)."""
    exe = shutil.which(docker)
    if not exe:
        return False, "the docker client is not installed"
    try:
        r = subprocess.run([exe, "info", "--format", "{{.ServerVersion}}"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`docker info` failed: {e}"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no daemon"])[-1]
        return False, f"`docker info` failed: {why}"
    return True, f"docker daemon {r.stdout.strip()}"


class DockerSandbox(AsyncMixin):
    """Run code in a throw-away Docker container. See the module docstring.

    Args:
        limits: default `Limits`.
        image: image with ``python3`` in ``PATH`` (default ``python:3.11-slim``). Pull it
            beforehand: a run never pulls (``--pull never``), so a missing image fails fast.
        cpus: ``--cpus`` quota per container (default 1.0).
        env: extra environment variables for the program.
        docker: the docker client binary.
        check: verify at construction that a daemon answers (``docker info``).
    """

    tier = "docker"
    isolated = True

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        cpus: float = 1.0,
        env: Mapping[str, str] | None = None,
        docker: str = "docker",
        check: bool = True,
    ) -> None:
        self.limits = limits or Limits()
        self.image = image
        self.cpus = cpus
        self.docker = shutil.which(docker) or docker
        self._env = _proc.sandbox_env(home=WORKDIR, tmp=WORKDIR, path="/usr/local/bin:/usr/bin:/bin", extra=env)
        if check:
            ok, why = docker_available(docker)
            if not ok:
                raise SandboxError(f"Docker backend unavailable: {why}")

    def command(self, name: str, limits: Limits) -> list[str]:
        """The ``docker run`` command line (public so it can be inspected and tested)."""
        mb = limits.memory_mb
        cpu = limits.cpu_seconds
        fsize = limits.max_file_mb * 1024 * 1024
        cmd = [
            self.docker, "run", "--rm", "-i", "--pull", "never", "--name", name,
            "--network", "none",
            "--memory", f"{mb}m", "--memory-swap", f"{mb}m",
            "--pids-limit", str(limits.max_procs),
            "--cpus", str(self.cpus),
            "--read-only",
            "--tmpfs", f"{WORKDIR}:rw,exec,nosuid,nodev,size={limits.tmpfs_mb}m,mode=1777",
            "--shm-size", f"{max(1, limits.tmpfs_mb // 4)}m",
            "--workdir", WORKDIR,
            "--user", "65534:65534",
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            "--ulimit", f"cpu={cpu}:{cpu + 1}",
            "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}",
            "--ulimit", f"fsize={fsize}:{fsize}",
            "--ulimit", "core=0:0",
            "--hostname", "sandbox",
            "--init",
            "--log-driver", "none",
        ]
        for k, v in self._env.items():
            cmd += ["--env", f"{k}={v}"]
        cmd += ["--entrypoint", "python3", self.image, "-S", "-c", _BOOT]
        return cmd

    def _header(self, argv: Sequence[str], files: dict[str, bytes]) -> bytes:
        spec = {"files": [[p, base64.b64encode(d).decode()] for p, d in files.items()], "argv": list(argv)}
        body = json.dumps(spec).encode()
        return str(len(body)).encode() + b"\n" + body

    def _remove(self, name: str) -> None:
        subprocess.run([self.docker, "rm", "-f", name], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False)

    def _argv(self, argv: Sequence[str] | None, code: str | None) -> list[str]:
        if code is not None:
            return ["python3", "main.py"]
        assert argv
        return ["python3" if a == "python" and i == 0 else a for i, a in enumerate(argv)]

    def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Files | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        limits, fs, data = prepare_run(code, argv, files, stdin, limits, self.limits)
        data = data or b""
        name = f"actloop-sbx-{uuid.uuid4().hex[:16]}"
        started = time.monotonic()
        proc = _proc.spawn(self.command(name, limits), env=_client_env(), stdin_pipe=True, new_session=True)

        def kill() -> None:
            self._remove(name)
            proc.kill()

        c = _proc.collect(proc, stdin_data=self._header(self._argv(argv, code), fs) + data,
                          limits=limits, started=started, kill=kill)
        res = _proc.to_result(c, self.tier, oom_exit_137=True)
        log.debug("sandbox run tier=docker exit=%s timed_out=%s %.3fs", res.exit_code, res.timed_out, res.duration_s)
        return res

    def spawn(
        self, argv: Sequence[str], *, files: Files | None = None, limits: Limits | None = None
    ) -> _proc.SandboxProcess:
        limits = limits or self.limits
        name = f"actloop-sbx-{uuid.uuid4().hex[:16]}"
        proc = _proc.spawn(self.command(name, limits), env=_client_env(), stdin_pipe=True, new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(self._header(self._argv(argv, None), check_files(files)))
        proc.stdin.flush()

        def kill() -> None:
            self._remove(name)
            proc.kill()

        return _proc.SandboxProcess(proc, kill=kill, tier=self.tier)

    def close(self) -> None:
        pass


def _client_env() -> dict[str, str]:
    """The docker *client* needs to find its daemon and config; the container gets none of
    this (its environment is set with --env only)."""
    keep = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")
    return {k: os.environ[k] for k in keep if k in os.environ}
