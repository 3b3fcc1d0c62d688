"""bubblewrap backend: the default wherever unprivileged user namespaces work.

Each run gets fresh user, pid, network, mount, ipc, uts (and, if possible, cgroup)
namespaces, created by ``bwrap`` in a few milliseconds, without a daemon and without root.

What the program sees:
- ``/usr`` (and the ``/bin``, ``/lib*`` links), the interpreter's prefix and any
  `python_path` / `ro_binds` entries — all read-only. No ``/home``, ``/root``, ``/etc``
  (beyond ``ld.so.cache`` and ``localtime``), ``/var``, ``/run``, ``/sys``, no host sockets.
- ``/work``: a private tmpfs of `Limits.tmpfs_mb`, the only writable place; ``/tmp`` links
  to it. ``/dev/shm`` is a second, small tmpfs (a quarter of that size) so
  `multiprocessing` locks work. The root, ``/dev`` and ``/proc`` are remounted read-only.
- its own ``/proc``: only its own processes (pid 1 is bwrap's reaper).
- a loopback interface in an empty network namespace: no route anywhere, not even to the
  host's 127.0.0.1.
- an environment built from scratch (`_proc.sandbox_env`): no host variables.
- uid 65534 inside. When the host runs as root, bwrap itself is started as uid 65534 (via
  ``setpriv``) whenever the interpreter is readable by that uid, so the sandbox is an
  unprivileged *host* uid as well; otherwise it maps to host root without any capability,
  and ``/proc`` is read-only so root-owned sysctls stay out of reach (`doctor` says which).

Limits: rlimits (CPU, address space, processes, open files, file size) are set inside the
sandbox before the program starts, the tmpfs has a size, and a host-side watchdog SIGKILLs
bwrap at the deadline; ``--die-with-parent`` then takes down the sandbox's pid 1, and the
kernel kills every process left in the pid namespace. Nothing survives a run: no daemon,
no double-forked orphan, no file.

What it does NOT protect against: kernel bugs reachable through the syscall surface (there
is no seccomp filter; nested user namespaces are disabled with ``--disable-userns``), CPU
and cache side channels, and reading whatever you bind in. Memory is bounded per process
by RLIMIT_AS, not per sandbox (use the Docker backend for a cgroup limit). CPU time is
bounded per process by RLIMIT_CPU and overall by the wall-clock watchdog.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from . import _proc
from .base import AsyncMixin, ExecResult, Files, Limits, SandboxError, check_files

log = logging.getLogger("actloop.sandbox")

WORKDIR = "/work"
SANDBOX_UID = 65534  # "nobody", inside the sandbox and, when we can, outside as well
_PATH = "/usr/local/bin:/usr/bin:/bin"


def default_python() -> str:
    """The host's base interpreter (not the venv's wrapper): same version as the trainer,
    standard library only unless you pass `python_path` or `site_packages=True`."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _others_can_reach(path: str) -> bool:
    """Whether an unrelated uid can traverse to `path` (o+x on every ancestor, o+r on it)."""
    try:
        parts = os.path.abspath(path).split("/")
        for i in range(2, len(parts) + 1):
            st = os.stat("/".join(parts[:i]) or "/")
            need = stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else stat.S_IROTH
            if not st.st_mode & need:
                return False
    except OSError:
        return False
    return True


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
        run_as: ``"auto"`` (default): when the host is root, start bwrap as uid 65534 if
            every bound path is readable by it; ``"self"``: never change uid.
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
        run_as: str = "auto",
        bwrap: str | None = None,
    ) -> None:
        self.limits = limits or Limits()
        found = bwrap or shutil.which("bwrap")
        if not found:
            raise SandboxError("bwrap (bubblewrap) is not installed; `apt-get install bubblewrap`")
        self.bwrap = found
        self.python = python or default_python()
        if not os.path.exists(self.python):
            raise SandboxError(f"interpreter {self.python!r} does not exist")
        self._python_cmd = [self.python] if site_packages else [self.python, "-S"]
        feats = _bwrap_features(self.bwrap)

        system = ["/usr", "/bin", "/lib", "/lib64", "/sbin"]
        binds: list[str] = []
        for p in [*_interpreter_binds(self.python), *python_path, *ro_binds]:
            p = os.path.abspath(p)
            if not _under(p, system) and not _under(p, binds):
                binds.append(p)

        self.unprivileged_host_uid = False
        setpriv: list[str] = []
        if os.geteuid() == 0 and run_as == "auto":
            setpriv_bin = shutil.which("setpriv")
            reachable = all(_others_can_reach(p) for p in [self.python, *binds])
            if setpriv_bin and reachable:
                setpriv = [setpriv_bin, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--"]
                self.unprivileged_host_uid = True
            else:
                log.info(
                    "bwrap sandbox maps to host root (no capabilities): %s is not readable by "
                    "uid %d%s. /proc is read-only inside either way.",
                    self.python, SANDBOX_UID, "" if setpriv_bin else " / setpriv missing",
                )

        # The fixed part of the command line is built once; a run only appends its tmpfs
        # size, its files and its command.
        a = [*setpriv, self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net",
             "--unshare-ipc", "--unshare-uts"]
        if "--unshare-cgroup-try" in feats:
            a.append("--unshare-cgroup-try")
        if "--disable-userns" in feats:
            a.append("--disable-userns")
        a += ["--die-with-parent", "--new-session", "--uid", str(SANDBOX_UID),
              "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--cap-drop", "ALL",
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
            home=WORKDIR, tmp="/tmp", path=_PATH, pythonpath=list(python_path), extra=env
        )

    # -- command construction ---------------------------------------------------------
    def _command(
        self, argv: Sequence[str] | None, code: str | None, files: dict[str, bytes], limits: Limits
    ) -> tuple[list[str], list[int]]:
        """Full bwrap command line plus the memfds it reads the files from."""
        mb = 1024 * 1024
        total = sum(len(v) for v in files.values())
        if total > limits.tmpfs_mb * mb:
            raise ValueError(f"files ({total} bytes) do not fit in tmpfs_mb={limits.tmpfs_mb}")
        cmd = list(self._argv_head)
        cmd += ["--size", str(max(1, limits.tmpfs_mb // 4) * mb), "--tmpfs", "/dev/shm",
                "--remount-ro", "/dev",
                "--size", str(limits.tmpfs_mb * mb), "--tmpfs", WORKDIR, "--symlink", WORKDIR, "/tmp"]
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
        # Python programs set their own rlimits in a -c preamble (no extra exec); anything
        # else goes through util-linux `prlimit`. Both run after the user namespace exists,
        # so RLIMIT_NPROC counts only this sandbox's processes.
        if code is not None:
            argv = ["python", "main.py"]
        assert argv
        if argv[0] == "python" and len(argv) >= 2 and not argv[1].startswith("-"):
            script = argv[1] if argv[1].startswith("/") else f"{WORKDIR}/{argv[1]}"
            boot = _proc.python_boot(
                limits, nproc=limits.max_procs, script=script, argv=list(argv[1:]),
                path0=os.path.dirname(script),
            )
            return [*self._python_cmd, "-c", boot]
        prog = list(argv)
        if prog[0] == "python":
            prog[:1] = self._python_cmd
        return ["prlimit", *_proc.prlimit_args(limits, nproc=limits.max_procs), "--", *prog]

    def _spawn(self, argv, code, files, limits, stdin_pipe):  # type: ignore[no-untyped-def]
        cmd, fds = self._command(argv, code, files, limits)
        try:
            return _proc.spawn(cmd, env=self._env, stdin_pipe=stdin_pipe, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)

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
        if (code is None) == (argv is None) or (argv is not None and not argv):
            raise ValueError("pass exactly one of `code` or a non-empty `argv`")
        limits = limits or self.limits
        fs = check_files(files, reserved=("main.py",) if code is not None else ())
        if code is not None:
            fs["main.py"] = code.encode()
        data = stdin.encode() if isinstance(stdin, str) else stdin
        started = time.monotonic()
        proc = self._spawn(argv, None if code is None else code, fs, limits, data is not None)

        def kill() -> None:
            # SIGKILL bwrap: --die-with-parent kills the sandbox's pid 1, and with it the
            # kernel kills every process in the pid namespace.
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        c = _proc.collect(proc, stdin_data=data, limits=limits, started=started, kill=kill)
        res = _proc.to_result(c, self.tier)
        log.debug("sandbox run tier=bwrap exit=%s timed_out=%s %.3fs", res.exit_code, res.timed_out, res.duration_s)
        return res

    def spawn(
        self, argv: Sequence[str], *, files: Files | None = None, limits: Limits | None = None
    ) -> _proc.SandboxProcess:
        """Start a long-lived sandboxed process with stdin/stdout/stderr pipes and no
        watchdog (the caller owns its lifetime: `PythonSession`)."""
        limits = limits or self.limits
        proc = self._spawn(argv, None, check_files(files), limits, True)

        def kill() -> None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        return _proc.SandboxProcess(proc, kill=kill, tier=self.tier)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"BwrapSandbox(python={self.python!r}, unprivileged_host_uid={self.unprivileged_host_uid})"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
