"""bubblewrap backend: the default wherever unprivileged user namespaces work.

Each run gets fresh user, pid, network, mount, ipc, uts (and, if possible, cgroup)
namespaces, created by ``bwrap`` in a few milliseconds, without a daemon and without root.

What the program sees:
- ``/usr`` (and the ``/bin``, ``/lib*`` links), the interpreter's prefix and any
  `python_path` / `ro_binds` entries — all read-only. No ``/home``, ``/root``, ``/etc``
  (beyond ``ld.so.cache`` and ``localtime``), ``/var``, ``/run``, ``/sys``, no host sockets.
- ``/sandbox``: a private tmpfs of `Limits.tmpfs_mb`, the only writable place, its cwd and
  ``HOME``; ``/tmp`` links to it (unless you bind something below ``/tmp``; ``TMPDIR``
  points there either way). ``/dev/shm`` is a second, small tmpfs (a quarter of that size) so
  `multiprocessing` locks work. The root, ``/dev`` and ``/proc`` are remounted read-only.
- its own ``/proc``: only its own processes; pid 1 is a shell that runs the program and
  exits with its status (see `BwrapSandbox._program`).
- a loopback interface in an empty network namespace: no route anywhere, not even to the
  host's 127.0.0.1.
- an environment built from scratch (`_proc.sandbox_env`): no host variables.
- uid 65534 inside, and an unprivileged uid outside: your own uid, or, when the host runs as
  root, an unused uid (62000 + n) per concurrent run in a pre-made user namespace (see
  `_UsernsSlots`: mapping the sandbox to host root would exempt it from RLIMIT_NPROC). No
  capabilities, an empty bounding set, no_new_privs, no nested user namespaces.

Limits: rlimits (CPU, address space, processes, open files, file size) are set inside the
sandbox before the program starts, the tmpfs has a size, and a host-side watchdog SIGKILLs
bwrap at the deadline; ``--die-with-parent`` then takes down the sandbox's pid 1, and the
kernel kills every process left in the pid namespace. When the program exits, pid 1 exits
too, with the same effect. Nothing survives a run: no daemon,
no double-forked orphan, no file.

What it does NOT protect against: kernel bugs reachable through the syscall surface (there
is no seccomp filter; nested user namespaces are disabled: ``--disable-userns``, or
max_user_namespaces=0 in the pre-made namespaces of root hosts), CPU
and cache side channels, and reading whatever you bind in. Memory is bounded per process
by RLIMIT_AS, not per sandbox (use the Docker backend for a cgroup limit). CPU time is
bounded per process by RLIMIT_CPU and overall by the wall-clock watchdog.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from . import _proc
from .base import AsyncMixin, ExecResult, Files, Limits, SandboxError, check_files, prepare_run

log = logging.getLogger("actloop.sandbox")

WORKDIR = "/sandbox"  # not /work or /tmp: host paths there are common bind sources
_RESERVED = (WORKDIR, "/dev", "/proc")
SANDBOX_UID = 65534  # "nobody", inside the sandbox and, when we can, outside as well
_PATH = "/usr/local/bin:/usr/bin:/bin"


def default_python() -> str:
    """The host's base interpreter (not the venv's wrapper): same version as the trainer,
    standard library only unless you pass `python_path` or `site_packages=True`."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _interpreter_binds(python: str) -> list[str]:
    """Directories to bind read-only so `python` runs: its real prefix and, for a venv,
    the venv itself (it holds pyvenv.cfg and site-packages)."""
    real = os.path.realpath(python)
    binds = [os.path.dirname(os.path.dirname(real))]
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        binds.append(venv)
    return binds


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@functools.lru_cache(maxsize=8)
def _bwrap_features(bwrap: str) -> frozenset[str]:
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    text = out.stdout + out.stderr
    return frozenset(f for f in ("--disable-userns", "--unshare-cgroup-try", "--size") if f in text)


class _Slot:
    """One pre-made user namespace (root hosts): its fd, its host uid, its command prefix."""

    __slots__ = ("uid", "fd", "prefix")

    def __init__(self, uid: int, fd: int, prefix: list[str]) -> None:
        self.uid, self.fd, self.prefix = uid, fd, prefix


class _UsernsSlots:
    """User namespaces for sandboxes started by a root host, one per concurrent run.

    Why: when bwrap creates the user namespace itself, it maps the sandbox to the uid that
    started it. For root that is host uid 0, and the kernel does not apply RLIMIT_NPROC
    to uid 0: a fork bomb would run until the watchdog. So a root host prepares namespaces
    where the sandbox uid 65534 maps to an unused host uid (62000 + n), one per concurrent
    run (its own process count), and starts bwrap as that uid with ``--userns``. The
    namespace also maps host root to itself so that bwrap, which holds capabilities in it,
    may read bind sources below 0700 directories such as /root; the program itself runs
    as 65534 without capabilities, with an empty bounding set and no_new_privs, and the
    namespace's max_user_namespaces is 0 (no nested namespaces).
    """

    def __init__(self, uid_base: int = 62000, count: int = 512) -> None:
        self._next = uid_base
        self._end = uid_base + count
        self._free: collections.deque[_Slot] = collections.deque()  # FIFO: a slot rests between runs
        self._lock = threading.Lock()
        tools = {t: shutil.which(t) for t in ("setpriv", "unshare", "nsenter")}
        missing = [t for t, p in tools.items() if not p]
        if missing:
            raise SandboxError(f"bwrap as root needs util-linux {', '.join(missing)}")
        self._tools = tools

    def acquire(self, bwrap: str) -> _Slot:
        with self._lock:
            if self._free:
                return self._free.popleft()
            if self._next >= self._end:
                raise SandboxError("no free sandbox uid (too many concurrent sandboxes)")
            uid = self._next
            self._next += 1
        fd = self._create(uid)
        prefix = [self._tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",  # type: ignore[list-item]
                  bwrap, "--userns", str(fd)]
        return _Slot(uid, fd, prefix)

    def release(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)

    def _create(self, uid: int) -> int:
        env = {"PATH": "/usr/bin:/bin"}
        holder = subprocess.Popen(
            [self._tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",  # type: ignore[list-item]
             self._tools["unshare"], "--user", "--", "/bin/sh", "-c", "echo ready && exec cat"],  # type: ignore[list-item]
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        assert holder.stdin is not None and holder.stdout is not None and holder.stderr is not None
        try:
            if holder.stdout.readline() != b"ready\n":
                raise SandboxError(f"cannot create a user namespace: {holder.stderr.read().decode().strip()}")
            mapping = f"0 0 1\n{SANDBOX_UID} {uid} 1\n"
            for f in ("uid_map", "gid_map"):
                with open(f"/proc/{holder.pid}/{f}", "w") as fh:
                    fh.write(mapping)
            r = subprocess.run(
                [self._tools["nsenter"], f"--user=/proc/{holder.pid}/ns/user", "--",  # type: ignore[list-item]
                 "/bin/sh", "-c", "echo 0 > /proc/sys/user/max_user_namespaces"],
                capture_output=True, text=True, env=env, check=False,
            )
            if r.returncode != 0:
                raise SandboxError(f"cannot limit nested user namespaces: {r.stderr.strip()}")
            return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxError(f"cannot prepare a user namespace: {e}") from e
        finally:
            holder.stdin.close()
            holder.kill()
            holder.wait()
            holder.stdout.close()
            holder.stderr.close()


_SLOTS: _UsernsSlots | None = None
_SLOTS_LOCK = threading.Lock()


def _slots() -> _UsernsSlots:
    global _SLOTS
    with _SLOTS_LOCK:
        if _SLOTS is None:
            _SLOTS = _UsernsSlots()
        return _SLOTS


class BwrapSandbox(AsyncMixin):
    """Run code in a bubblewrap sandbox. See the module docstring for what it isolates.

    Args:
        limits: default `Limits` for runs that do not pass their own.
        python: interpreter used for `code` and for ``argv[0] == "python"``; default: the
            host's base interpreter (`default_python`).
        python_path: extra directories (e.g. a site-packages with numpy) bound read-only
            and put on ``PYTHONPATH``.
        site_packages: run Python with its ``site`` module (default off: ``-S`` skips it,
            which saves 5-30 ms per run and keeps host packages out of reach).
        ro_binds: extra host paths bound read-only at the same place.
        env: extra environment variables for the program (nothing is inherited).
        bwrap: path of the bwrap binary (default: from ``PATH``).
    """

    tier = "bwrap"
    isolated = True

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        python: str | None = None,
        python_path: Sequence[str] = (),
        site_packages: bool = False,
        ro_binds: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        bwrap: str | None = None,
    ) -> None:
        self.limits = limits or Limits()
        found = bwrap or shutil.which("bwrap")
        if not found:
            raise SandboxError("bwrap (bubblewrap) is not installed; `apt-get install bubblewrap`")
        self.bwrap = found
        self.python = python or default_python()
        self.python_note = ""
        if not os.access(self.python, os.X_OK):
            # e.g. an unprivileged user whose venv's base interpreter lives below /root (0700)
            why = f"interpreter {self.python} {_proc.unreachable_reason(self.python)}"
            alt = None if python else _proc.find_reachable_python(self.python)
            if alt is None:
                raise SandboxError(f"{why}; pass python= an interpreter this user can run (e.g. /usr/bin/python3)")
            log.info("bwrap sandbox: %s; using %s", why, alt)
            self.python_note = f"{why}, so the sandbox uses {alt}"
            self.python = alt
        self._python_cmd = [self.python] if site_packages else [self.python, "-S"]
        feats = _bwrap_features(self.bwrap)
        if "--size" not in feats:
            raise SandboxError(f"{self.bwrap} is too old to cap a tmpfs (--size needs bubblewrap >= 0.5)")
        # Root hosts use pre-made user namespaces (see _UsernsSlots); others let bwrap
        # create one, mapping the sandbox to their own (unprivileged) uid.
        self._slots = _slots() if os.geteuid() == 0 else None

        system = ["/usr", "/bin", "/lib", "/lib64", "/sbin"]
        binds: list[str] = []
        for p in [*_interpreter_binds(self.python), *python_path, *ro_binds]:
            p = os.path.abspath(p)
            if _under(p, _RESERVED) or p == "/":
                raise ValueError(f"cannot bind {p!r}: {', '.join(_RESERVED)} belong to the sandbox")
            if not _under(p, system) and not _under(p, binds):
                binds.append(p)
        self._tmp_link = not any(_under(b, ["/tmp"]) for b in binds)

        # The fixed part of the command line is built once; a run only adds its user
        # namespace (root hosts), tmpfs sizes, files and command.
        a: list[str] = []
        if self._slots is None:
            a += [self.bwrap, "--unshare-user"]
            if "--disable-userns" in feats:
                a.append("--disable-userns")
            else:
                log.info("bubblewrap < 0.8: nested user namespaces stay possible inside the sandbox")
            a += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        else:
            a += ["--uid", str(SANDBOX_UID)]  # the gid comes from setpriv (bwrap sets uid first)
        a += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        if "--unshare-cgroup-try" in feats:
            a.append("--unshare-cgroup-try")
        a += ["--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL",
              "--ro-bind", "/usr", "/usr"]
        for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for f in ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"):
            a += ["--ro-bind-try", f, f]
        for b in binds:
            a += ["--ro-bind", b, b]
        a += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
        self._argv_head = a
        self._env = _proc.sandbox_env(
            home=WORKDIR, tmp=WORKDIR, path=_PATH, pythonpath=list(python_path), extra=env
        )

    @property
    def host_identity(self) -> str:
        """Who the sandboxed program is on the host, in words (for `doctor`)."""
        if self._slots is not None:
            return "an unused unprivileged host uid (62000+n) per concurrent run, in a pre-made user namespace"
        return f"your own uid {os.getuid()} (unprivileged), in a fresh user namespace"

    # -- command construction ---------------------------------------------------------
    def _command(
        self, argv: Sequence[str] | None, code: str | None, files: dict[str, bytes], limits: Limits,
        slot: _Slot | None,
    ) -> tuple[list[str], list[int]]:
        """Full command line plus the memfds bwrap copies the files from."""
        mb = 1024 * 1024
        total = sum(len(v) for v in files.values())
        if total > limits.tmpfs_mb * mb:
            raise ValueError(f"files ({total} bytes) do not fit in tmpfs_mb={limits.tmpfs_mb}")
        cmd = [*slot.prefix, *self._argv_head] if slot is not None else list(self._argv_head)
        cmd += ["--size", str(max(1, limits.tmpfs_mb // 4) * mb), "--tmpfs", "/dev/shm",
                "--remount-ro", "/dev",
                "--size", str(limits.tmpfs_mb * mb), "--tmpfs", WORKDIR]
        if self._tmp_link:
            cmd += ["--symlink", WORKDIR, "/tmp"]
        fds: list[int] = []
        try:
            made: set[str] = set()
            for name, data in files.items():
                parent = os.path.dirname(name)
                if parent and parent not in made:
                    cmd += ["--dir", f"{WORKDIR}/{parent}"]
                    made.add(parent)
                fd = os.memfd_create("sandbox-file")
                fds.append(fd)
                if data:
                    _write_all(fd, data)
                    os.lseek(fd, 0, os.SEEK_SET)
                cmd += ["--file", str(fd), f"{WORKDIR}/{name}"]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        cmd += ["--chdir", WORKDIR, "--remount-ro", "/", "--"]
        cmd += self._program(argv, code, limits)
        return cmd, fds

    def _program(self, argv: Sequence[str] | None, code: str | None, limits: Limits) -> list[str]:
        # pid 1 is a shell that runs the program as its child and exits with its status:
        # unlike bwrap's own reaper it never outlives bwrap, so a host whose pid 1 does not
        # reap (a trainer started as a container's entrypoint) collects no zombies, and the
        # program is not pid 1 (signals and orphans behave as usual). Python programs set
        # their rlimits in a -c preamble; other commands go through util-linux `prlimit`.
        # Both run inside the user namespace, so RLIMIT_NPROC counts only this sandbox's
        # processes; +2 for the shell and bwrap, which are charged to the same count.
        if code is not None:
            argv = ["python", "main.py"]
        assert argv
        nproc = limits.max_procs + 2
        if argv[0] == "python":
            prog = _proc.init_command(self._python_cmd, argv, WORKDIR, limits, nproc=nproc)
        else:
            prog = ["prlimit", *_proc.prlimit_args(limits, nproc=nproc), "--", *argv]
        return ["/bin/sh", "-c", '"$@"; exit $?', "sh", *prog]

    def _spawn(
        self, argv: Sequence[str] | None, code: str | None, files: dict[str, bytes], limits: Limits,
        stdin_pipe: bool,
    ) -> tuple[subprocess.Popen[bytes], _Slot | None]:
        slot = self._slots.acquire(self.bwrap) if self._slots is not None else None
        try:
            cmd, fds = self._command(argv, code, files, limits, slot)
            try:
                # its own session: a Ctrl-C at the terminal goes to the trainer (which finishes the step),
                # not to the sandboxes of that step (which would die with exit 130 and score 0)
                proc = _proc.spawn(cmd, env=self._env, stdin_pipe=stdin_pipe, new_session=True,
                                   pass_fds=[*fds, *([slot.fd] if slot else [])])
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            if slot is not None:
                self._slots.release(slot)  # type: ignore[union-attr]
            raise
        return proc, slot

    @staticmethod
    def _killer(proc: subprocess.Popen[bytes]):  # type: ignore[no-untyped-def]
        def kill() -> None:
            # SIGKILL bwrap: --die-with-parent kills the sandbox's pid 1, and with it the
            # kernel kills every process in the pid namespace.
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return kill

    # -- public API -------------------------------------------------------------------
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
        started = time.monotonic()
        proc, slot = self._spawn(argv, code, fs, limits, data is not None)
        try:
            c = _proc.collect(proc, stdin_data=data, limits=limits, started=started,
                              kill=self._killer(proc))
        finally:
            if slot is not None:
                self._slots.release(slot)  # type: ignore[union-attr]
        res = _proc.to_result(c, self.tier)
        log.debug("sandbox run tier=bwrap exit=%s timed_out=%s %.3fs", res.exit_code, res.timed_out, res.duration_s)
        return res

    def spawn(
        self, argv: Sequence[str], *, files: Files | None = None, limits: Limits | None = None
    ) -> _proc.SandboxProcess:
        """Start a long-lived sandboxed process with stdin/stdout/stderr pipes and no
        watchdog (the caller owns its lifetime: `PythonSession`)."""
        limits = limits or self.limits
        proc, slot = _proc.on_spawner_thread(self._spawn, argv, None, check_files(files), limits, True)  # type: ignore[misc]
        slots = self._slots
        return _proc.SandboxProcess(
            proc, kill=self._killer(proc), tier=self.tier,
            cleanup=(lambda: slots.release(slot)) if slot is not None and slots is not None else None,
        )

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"BwrapSandbox(python={self.python!r})"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
