"""Docker backend: each run is a throw-away container (Docker 20.10 or newer, or Podman's
docker-compatible CLI).

What a run gets: ``--network none``; a cgroup memory limit (``--memory`` = ``--memory-swap``,
no swap) on top of the per-process RLIMIT_AS every tier sets; ``--pids-limit`` (processes
and threads of this container only); ``--cpus``; a ``--read-only`` image root with a
size-capped tmpfs at ``/sandbox`` (cwd, ``HOME``, ``TMPDIR``; ``/tmp`` links there in the
image `actloop sandbox build-image` makes) and a small private ``/dev/shm``;
``--cap-drop ALL``, ``no-new-privileges``, uid 65534; CPU-time, open-file, file-size and
core rlimits; exactly the environment of the other tiers (set by the preamble: nothing from the
host, nor the ``HOSTNAME``/``TERM``/``container`` the runtimes add); no bind mount at all.

How a run starts: files travel on stdin ahead of the program's own stdin. A Python preamble
(`_BOOT`, so the image needs ``python3``) reads a length-prefixed JSON header, writes the
files into the tmpfs, changes into it, writes a start marker to stderr and then runs the
same init every tier uses (`_proc.python_init`): it sets the rlimits, forks, runs the
program as its child and stays behind as the container's pid 1, reaping orphans and exiting
with the program's status. When it exits the kernel kills whatever is left in the
container's pid namespace: no daemon outlives a run. Why not ``--workdir /sandbox``: Docker
20.10 then creates the directory root-owned 0755 over the tmpfs's ``mode=1777``, and uid
65534 cannot write its own files. Why no ``--init``: it needs ``docker-init`` on the daemon's
host (Podman: ``catatonit``); our init needs nothing but the image's ``python3``.

The start marker separates the sandbox's failures from the program's: without it (image
missing, daemon error, ``python3`` absent, tmpfs not writable) the result has ``error`` set
and whatever Docker said; after it, the exit status is the program's, so a program cannot
fake an infrastructure failure by exiting 125.

Deadline: the host watchdog (`_proc.collect`) SIGKILLs the ``docker run`` client at the
deadline, which stops all reading at once however much the program writes, and starts
``docker rm -f`` as a separate background process: the run returns on time even when the
daemon is slow to kill (a 4 GB stdout flood kept it busy for 30 s). Nothing here waits on a
``docker`` call without a timeout. A container whose removal was lost (the host process
died) carries its deadline in a label; `remove_stale` deletes such containers, and every
`DockerSandbox` runs it once in the background.

Costs: a container start is 300-1000 ms, against ~15 ms for bwrap. Use it where you want a
cgroup memory limit or cannot use bwrap. What it does NOT protect against: kernel bugs
(containers share the host kernel; Docker's default seccomp profile narrows that surface),
and a daemon without ``--userns-remap`` maps container uid 65534 to host uid 65534, which is
why the program has no capabilities and must not share that uid with anything you care
about.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

from . import _proc
from .base import AsyncMixin, ExecResult, Files, Limits, SandboxError, check_files, prepare_run

log = logging.getLogger("actloop.sandbox")

DEFAULT_IMAGE = "actloop-sandbox:bookworm"
"""What `actloop sandbox build-image` makes (Debian bookworm minbase + python3, offline)."""
WORKDIR = "/sandbox"
SANDBOX_USER = "65534:65534"
LABEL = "actloop.sandbox"
STARTED = b"\x00actloop-sandbox-started\x00"
"""Written to stderr by `_BOOT` right before the program starts; never shown to callers."""
# One docker call that is not part of a run (info, image inspect, rm): never waits longer.
CALL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 10.0  # a container's start, at least (`start_timeout`)
STALE_GRACE_S = 60.0

# Reads "<n>\n" + n bytes of JSON {"files": [[path, b64]], "init": src, "env": {...}} from fd 0 without
# reading past it, writes the files into the tmpfs, marks the start, then execs the init
# (which runs the program on the rest of stdin; a fresh interpreter, so tracebacks and
# globals look as in the other tiers). Any failure before the marker is the
# sandbox's: exit 125 with the reason on stderr.
_BOOT = (
    "import os,sys,json,base64\n"
    "def _fail(m):\n"
    " os.write(2,('actloop-boot: '+m+'\\n').encode());os._exit(125)\n"
    "h=b''\n"
    "while not h.endswith(b'\\n'):\n"
    " c=os.read(0,1)\n"
    " if not c:_fail('missing header on stdin')\n"
    " h+=c\n"
    "n=int(h);b=b''\n"
    "while len(b)<n:\n"
    " c=os.read(0,n-len(b))\n"
    " if not c:_fail('short header on stdin')\n"
    " b+=c\n"
    "s=json.loads(b);del h,b,c,n\n"
    "try:\n"
    f" os.chdir({WORKDIR!r})\n"
    " for p,d in s['files']:\n"
    "  os.makedirs(os.path.dirname(p) or '.',exist_ok=True)\n"
    "  with open(p,'wb') as f:f.write(base64.b64decode(d))\n"
    " t=os.open('.actloop-w',os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o600);os.close(t);os.unlink('.actloop-w')\n"
    "except OSError as e:\n"
    f" _fail('cannot write the work directory {WORKDIR}: '+str(e)+' (uid '+str(os.getuid())+')')\n"
    f"os.write(2,{STARTED!r})\n"
    "os.environ.clear();os.environ.update(s['env'])\n"  # not HOSTNAME, TERM, container, ...
    "os.execv(sys.executable,[sys.executable,'-S','-c',s['init']])\n"
)


# ----------------------------------------------------------------------------- the client
def _call(argv: Sequence[str], timeout: float = CALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """One docker call with a deadline; a hang becomes a failed call, never a hang here."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=_client_env(), check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"`{' '.join(argv[:3])}` did not answer within {timeout:.0f} s")
    except OSError as e:
        return subprocess.CompletedProcess(list(argv), 127, "", str(e))


def _last_line(text: str, default: str) -> str:
    """The line that says what went wrong: the first error line, else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "rror" in ln or ln.startswith(("docker:", "actloop-boot:"))]
    return (errors or lines or [default])[0 if errors else -1]


@functools.lru_cache(maxsize=8)
def is_podman(exe: str) -> bool:
    """Podman's docker-compatible CLI (``podman``, or ``docker`` from podman-docker)."""
    if "podman" in os.path.basename(exe):
        return True
    ver = _call([exe, "--version"], timeout=10)
    return "podman" in (ver.stdout + ver.stderr).lower()


@functools.lru_cache(maxsize=8)
def docker_available(docker: str = "docker") -> tuple[bool, str]:
    """(True, "docker 20.10.24") if the client reaches a daemon (or is a local Podman),
    else (False, why). Cached per process."""
    exe = shutil.which(docker)
    if not exe:
        return False, f"the {docker} client is not installed (apt-get install docker.io, or podman-docker)"
    podman = is_podman(exe)
    fmt = "{{.Client.Version}}" if podman else "{{.Server.Version}}"
    r = _call([exe, "version", "--format", fmt], timeout=15)
    if r.returncode != 0 or not r.stdout.strip():
        why = _last_line(r.stderr, "no daemon answers")
        return False, f"`{docker} version` cannot reach a daemon: {why}"
    return True, f"{'podman' if podman else 'docker'} {r.stdout.strip()}"


def image_present(image: str, docker: str = "docker") -> bool:
    exe = shutil.which(docker) or docker
    return _call([exe, "image", "inspect", "--format", "{{.Id}}", image], timeout=15).returncode == 0


def missing_image_hint(image: str) -> str:
    return (f"image {image!r} is not present (runs never pull): build it offline with "
            f"`actloop sandbox build-image --image {image}`, or `docker pull` an image with python3 "
            "and pass --image / sandbox.docker_image")


# ------------------------------------------------------------------------- removal
def _remove_in_background(docker: str, name: str) -> None:
    """``docker rm -f NAME`` as a separate process that we do not wait for: it outlives
    this call (and this process), and a thread reaps it so no zombie is left."""
    # Podman's `rm -f` first waits 10 s for a SIGTERM to work; `-t 0` kills at once, as Docker's does
    argv = [docker, "rm", "-f", *(["-t", "0"] if is_podman(docker) else []), name]
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=_client_env(), start_new_session=True)
    except OSError as e:
        log.warning("docker sandbox: could not start `docker rm -f %s`: %s", name, e)
        return

    def reap() -> None:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            log.warning("docker sandbox: `docker rm -f %s` still runs after 120 s (daemon stuck?)", name)
            p.kill()
            p.wait()

    threading.Thread(target=reap, name="actloop-docker-rm", daemon=True).start()


def start_timeout(limits: Limits) -> float:
    """How long a container may take to start before the program's own timeout begins."""
    return max(START_TIMEOUT_S, limits.timeout_s)


def remove_stale(docker: str = "docker", grace_s: float = STALE_GRACE_S) -> int:
    """Remove sandbox containers whose deadline passed more than `grace_s` ago (left behind
    by a host process that died mid-run). Returns how many were removed."""
    exe = shutil.which(docker) or docker
    r = _call([exe, "ps", "-a", "--filter", f"label={LABEL}", "--format",
               '{{.ID}} {{.Label "' + LABEL + '.deadline"}}'], timeout=15)
    if r.returncode != 0:
        return 0
    now = time.time()
    stale = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                if float(parts[1]) + grace_s < now:
                    stale.append(parts[0])
            except ValueError:
                pass  # a session container: lives as long as its client
    if stale:
        _call([exe, "rm", "-f", *stale], timeout=60)
        log.warning("docker sandbox: removed %d stale sandbox container(s)", len(stale))
    return len(stale)


_SWEPT: set[str] = set()
_SWEPT_LOCK = threading.Lock()


def _sweep_once(docker: str) -> None:
    with _SWEPT_LOCK:
        if docker in _SWEPT:
            return
        _SWEPT.add(docker)
    threading.Thread(target=remove_stale, args=(docker,), name="actloop-docker-sweep", daemon=True).start()


# ---------------------------------------------------------------------------- the image
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def build_image(
    image: str = DEFAULT_IMAGE,
    *,
    suite: str = "bookworm",
    mirror: str = DEBIAN_MIRROR,
    docker: str = "docker",
    force: bool = False,
    log_fn=print,  # type: ignore[no-untyped-def]
) -> str:
    """Make a Python image without any registry: ``debootstrap --variant=minbase
    --include=python3 SUITE`` from a Debian mirror (about 30 s), trimmed (docs, man pages,
    locales, apt lists), ``/tmp`` turned into a link to the work directory, then ``tar | docker
    import``. Cached: an image already present is kept unless `force`. Needs root and
    debootstrap. Returns "cached" or "built"; raises `SandboxError` with the reason."""
    import tempfile

    exe = shutil.which(docker)
    if not exe:
        raise SandboxError(f"the {docker} client is not installed")
    ok, why = docker_available(docker)
    if not ok:
        raise SandboxError(why)
    if not force and image_present(image, docker):
        log_fn(f"image {image} is already present (cached; --force rebuilds it)")
        return "cached"
    debootstrap = shutil.which("debootstrap")
    if not debootstrap:
        raise SandboxError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("building the image with debootstrap needs root")
    root = tempfile.mkdtemp(prefix="actloop-image-")
    try:
        t0 = time.monotonic()
        log_fn(f"debootstrap {suite} (minbase + python3) from {mirror} ...")
        r = subprocess.run([debootstrap, "--variant=minbase", "--include=python3", suite, root, mirror],
                           capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL, check=False)
        if r.returncode != 0:
            raise SandboxError(f"debootstrap failed (exit {r.returncode}): {_last_line(r.stdout + r.stderr, '')}")
        for sub in ("usr/share/doc", "usr/share/man", "usr/share/locale", "usr/share/info",
                    "var/cache/apt", "var/lib/apt/lists", "var/log"):
            shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        # /tmp -> the work dir, as in the bwrap tier: the root is mounted read-only
        shutil.rmtree(os.path.join(root, "tmp"), ignore_errors=True)
        os.symlink(WORKDIR, os.path.join(root, "tmp"))
        # Docker gives a tmpfs the mode of the directory it covers: 1777, so uid 65534 can write
        os.makedirs(os.path.join(root, WORKDIR.lstrip("/")), exist_ok=True)
        os.chmod(os.path.join(root, WORKDIR.lstrip("/")), 0o1777)
        log_fn(f"debootstrap done in {time.monotonic() - t0:.0f} s; docker import {image} ...")
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", root, "-c", "."], stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
        try:
            imp = subprocess.run([exe, "import", "--message", f"actloop sandbox image: debootstrap {suite} + python3",
                                  "--change", f"LABEL {LABEL}.image={suite}-python3",
                                  "-", image],
                                 stdin=tar.stdout, capture_output=True, text=True, timeout=600,
                                 env=_client_env(), check=False)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(timeout=600)
        if imp.returncode != 0 or tar.returncode != 0:
            raise SandboxError(f"docker import failed: {_last_line(imp.stderr, f'tar exit {tar.returncode}')}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log_fn(f"built {image} in {time.monotonic() - t0:.0f} s")
    return "built"


# ---------------------------------------------------------------------------- the tier
class DockerSandbox(AsyncMixin):
    """Run code in a throw-away container. See the module docstring.

    Args:
        limits: default `Limits`.
        image: an image with ``python3`` on ``PATH`` (default `DEFAULT_IMAGE`, made by
            ``actloop sandbox build-image``). Runs never pull (``--pull never``).
        cpus: ``--cpus`` quota per container (default 1.0).
        env: extra environment variables for the program.
        docker: the client binary (``docker``, or ``podman``).
        check: verify at construction that a daemon answers and the image is present
            (raises `SandboxError` with the reason otherwise).
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
            if not image_present(image, docker):
                raise SandboxError(f"Docker backend unavailable: {missing_image_hint(image)}")
            _sweep_once(self.docker)

    def command(self, name: str, limits: Limits, deadline: float | None = None) -> list[str]:
        """The ``docker run`` command line (public so it can be inspected and tested)."""
        mb = limits.memory_mb
        cpu = limits.cpu_seconds
        fsize = limits.max_file_mb * 1024 * 1024
        cmd = [
            self.docker, "run", "--rm", "-i", "--pull", "never", "--name", name,
            "--label", LABEL, "--label", f"{LABEL}.deadline={deadline if deadline is not None else 'session'}",
            "--network", "none",
            "--memory", f"{mb}m", "--memory-swap", f"{mb}m",
            "--pids-limit", str(limits.max_procs + 1),  # + the init
            "--cpus", str(self.cpus),
            "--read-only",
            "--tmpfs", f"{WORKDIR}:rw,exec,nosuid,nodev,size={limits.tmpfs_mb}m,mode=1777",
            "--ipc", "private", "--shm-size", f"{max(1, limits.tmpfs_mb // 4)}m",
            "--user", SANDBOX_USER,
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            "--ulimit", f"cpu={cpu}:{cpu + 1}",
            "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}",
            "--ulimit", f"fsize={fsize}:{fsize}",
            "--ulimit", "core=0:0",
            "--hostname", "sandbox",
            "--log-driver", "none",
        ]
        if is_podman(self.docker):
            # --read-only alone also mounts unbounded tmpfs on /tmp, /var/tmp and /run there
            cmd += ["--read-only-tmpfs=false", "--ulimit", f"nproc={_podman_nproc()}"]
        cmd += ["--entrypoint", "python3", self.image, "-S", "-c", _BOOT]
        return cmd

    def _header(self, argv: Sequence[str] | None, code: str | None, files: dict[str, bytes], limits: Limits) -> bytes:
        if code is not None:
            argv = ["python", "main.py"]
        assert argv
        init = _proc.init_command(["python3", "-S"], argv, WORKDIR, limits, nproc=None, init=True)[-1]
        spec = {"files": [[p, base64.b64encode(d).decode()] for p, d in files.items()], "init": init,
                "env": self._env}
        body = json.dumps(spec).encode()
        return str(len(body)).encode() + b"\n" + body

    def _killer(self, name: str, proc: subprocess.Popen[bytes]):  # type: ignore[no-untyped-def]
        def kill() -> None:
            # The client first: nothing more is read, whatever the container still writes.
            # Killing the client alone leaves the container running, so remove it too, in
            # the background: the daemon may take long (it may be busy relaying a flood).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _remove_in_background(self.docker, name)
        return kill

    def _failed(self, what: str, started: float, stderr: str = "", timed_out: bool = False) -> ExecResult:
        return ExecResult(stdout="", stderr=stderr, exit_code=125, timed_out=timed_out, oom=False,
                          duration_s=time.monotonic() - started, tier=self.tier, error=what)

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
        name = f"actloop-sbx-{uuid.uuid4().hex[:16]}"
        started = time.monotonic()
        start_s = start_timeout(limits)
        cmd = self.command(name, limits, deadline=round(time.time() + start_s + limits.timeout_s, 1))
        try:
            proc = _proc.spawn(cmd, env=_client_env(), stdin_pipe=True, new_session=True)
        except SandboxError as e:
            return self._failed(str(e), started)
        c = _proc.collect(proc, stdin_data=self._header(argv, code, fs, limits) + (data or b""),
                          limits=limits, started=started, kill=self._killer(name, proc),
                          start_marker=STARTED, start_timeout_s=start_s)
        preamble = _strip_started(c.stderr)
        if preamble is None:  # the program never started: the sandbox failed
            said = c.stderr.text("stderr")
            if c.timed_out:
                what = f"the container did not start within {start_s:g} s"
            else:
                what = f"docker run failed (exit {c.exit_code}): {_last_line(said, 'no message')}"
                if "No such image" in said or "Unable to find image" in said:
                    what += f"; {missing_image_hint(self.image)}"
            log.warning("docker sandbox: %s", what)
            return self._failed(what, started, said, c.timed_out)
        if preamble.strip():
            log.debug("docker client said: %s", preamble.strip())
        res = _proc.to_result(c, self.tier, oom_exit_137=True)
        log.debug("sandbox run tier=docker exit=%s timed_out=%s %.3fs", res.exit_code, res.timed_out, res.duration_s)
        return res

    def spawn(
        self, argv: Sequence[str], *, files: Files | None = None, limits: Limits | None = None
    ) -> _proc.SandboxProcess:
        """A long-lived container (`PythonSession`): stdin/stdout/stderr pipes, no watchdog.
        Blocks until the program has started (or raises `SandboxError` with Docker's words)."""
        limits = limits or self.limits
        name = f"actloop-sbx-{uuid.uuid4().hex[:16]}"
        proc = _proc.spawn(self.command(name, limits), env=_client_env(), stdin_pipe=True, new_session=True)
        assert proc.stdin is not None and proc.stderr is not None
        kill = self._killer(name, proc)
        try:
            proc.stdin.write(self._header(argv, None, check_files(files), limits))
            proc.stdin.flush()
            said = _read_until_started(proc, timeout=start_timeout(limits))
        except BaseException:
            kill()
            proc.wait()
            raise
        if said is None:
            kill()
            proc.wait()
            raise SandboxError("docker session did not start: " + _last_line(
                proc.stderr.read().decode(errors="replace") if proc.stderr else "", "no message"))
        return _proc.SandboxProcess(proc, kill=kill, tier=self.tier)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"DockerSandbox(image={self.image!r}, docker={self.docker!r})"


@functools.lru_cache(maxsize=1)
def _podman_nproc() -> str:
    """Podman asks for a high RLIMIT_NPROC by default, which its runtime could not set here
    ("error setting rlimit type 6: operation not permitted" above kernel.pid_max): ask for no
    more than pid_max, which no uid can exceed anyway. It counts per host uid across
    containers, so it is no per-run limit; ``--pids-limit`` is."""
    n = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        n = pid_max if n == resource.RLIM_INFINITY else min(n, pid_max)
    except (OSError, ValueError):
        pass
    return f"{n}:{n}" if n != resource.RLIM_INFINITY else "-1:-1"


def _strip_started(buf: _proc.CappedBuffer) -> str | None:
    """Remove everything up to and including the start marker from captured stderr (what
    the docker client said before the program started). None: the marker never came."""
    i = buf.head.find(STARTED)
    if i < 0:
        return None
    said = bytes(buf.head[:i]).decode(errors="replace")
    cut = i + len(STARTED)
    del buf.head[:cut]
    buf.total -= cut
    return said


def _read_until_started(proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    """Read the client's stderr up to the start marker (a session must not see it).
    Returns what came before it, or None if the process ended or the time ran out first."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    got = b""
    deadline = time.monotonic() + timeout
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while STARTED not in got:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(fd, 1)  # byte by byte: what follows the marker belongs to the session
            if not chunk:
                return None
            got += chunk
    return got[: got.index(STARTED)].decode(errors="replace")


def _client_env() -> dict[str, str]:
    """The docker *client* needs to find its daemon and config; the container gets none of
    this (its environment is set with --env only)."""
    keep = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_TLS_VERIFY",
            "DOCKER_CERT_PATH", "XDG_RUNTIME_DIR", "CONTAINER_HOST", "CONTAINERS_CONF")
    return {k: os.environ[k] for k in keep if k in os.environ}
