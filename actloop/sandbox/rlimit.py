"""Fallback tier: a plain subprocess with rlimits, for hosts without user namespaces.

This is NOT isolation. It exists so that code RL still runs inside unprivileged
containers (Docker's default seccomp profile blocks ``unshare``), on HPC nodes with user
namespaces disabled, or under AppArmor policies that forbid them. It warns once, loudly;
every result says ``tier="rlimit"``; and ``require_isolation=True`` refuses it.

What it does:
- a fresh temporary work directory per run, deleted afterwards;
- a clean environment (nothing from the host), its own session and process group;
- rlimits on CPU time, address space, processes, open files, file size;
- a wall-clock watchdog that kills the process group;
- when the host runs as **root** (the usual case inside a container): each run gets a
  throw-away uid (61000 + n by default) through ``setpriv`` with ``no_new_privs``. Then
  RLIMIT_NPROC counts only this run's processes, the program cannot read ``/root`` or other
  0700 places, cannot signal host processes, and after the run every process of that uid is
  killed at once (``kill -9 -1`` as that uid) — daemons and double-forked orphans included —
  and files it left in ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are removed. That uid must be
  able to read the interpreter: if yours lives below a 0700 directory (e.g. pyenv in
  /root), a system ``python3.X`` is used instead (logged), or pass ``python=``.

What it does NOT protect against (mark these as known limitations; the attack suite skips
them for this tier with these reasons):
- **network**: the program can open sockets, reach the host's loopback services and the
  internet;
- **disk**: only the size of each single file is capped (RLIMIT_FSIZE); many files can fill
  the disk until the watchdog fires;
- **visibility**: it sees the host's whole file system (as its uid) and all processes in
  ``/proc``;
- **without root** (no uid switching): it runs as *your* uid, so it can read your files,
  signal your processes (including the trainer), keep daemons alive after the run if they
  leave the process group, and RLIMIT_NPROC is shared with all your processes (it is set to
  your current count plus `max_procs`).
Use the bwrap or Docker tier for anything you would not run in your own shell.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence

from . import _proc
from .base import AsyncMixin, ExecResult, Files, Limits, SandboxError, check_files, prepare_run
from .bwrap import default_python

log = logging.getLogger("actloop.sandbox")

_WARNED = False
_WARN_LOCK = threading.Lock()
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


def warn_once(reason: str) -> None:
    """Say loudly, once per process, that code runs without namespace isolation."""
    global _WARNED
    with _WARN_LOCK:
        if _WARNED:
            return
        _WARNED = True
    msg = (
        "actloop sandbox: running untrusted code WITHOUT namespace isolation (tier=rlimit): "
        f"{reason}. The program can use the network and see the host's files and processes. "
        "Install bubblewrap and allow user namespaces, or use backend='docker'; pass "
        "require_isolation=True to refuse this fallback."
    )
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


class _UidPool:
    """Hands out throw-away uids so concurrent runs never share one (nor its NPROC count).

    Several host processes may use this tier at once, and the post-run sweep kills every
    process of a uid, so a uid that owns any process right now is skipped, and each host
    process starts at a different place in the range.
    """

    def __init__(self, base: int, count: int) -> None:
        start = os.getpid() % count
        self._free = collections.deque([*range(base + start, base + count), *range(base, base + start)])
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            busy = _uids_with_processes()
            for _ in range(len(self._free)):
                uid = self._free.popleft()
                if uid not in busy:
                    return uid
                self._free.append(uid)
            raise SandboxError("no free sandbox uid (too many concurrent runs)")

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)  # least recently used first: zombies get time to be reaped


def _uids_with_processes() -> set[int]:
    uids = set()
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                uids.add(e.stat().st_uid)
            except OSError:
                pass
    return uids


def _count_tasks_of(uid: int) -> int:
    """Threads currently owned by `uid` (what RLIMIT_NPROC counts)."""
    n = 0
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            if e.stat().st_uid != uid:
                continue
            with open(f"/proc/{e.name}/stat", "rb") as f:
                n += int(f.read().rsplit(b")", 1)[1].split()[17])
        except (OSError, ValueError, IndexError):
            pass
    return n


class RlimitSandbox(AsyncMixin):
    """Subprocess + rlimits fallback. See the module docstring for what it cannot contain.

    Args:
        limits: default `Limits`.
        python, python_path, site_packages, env: as for `BwrapSandbox`.
        switch_uid: run each program as a throw-away uid. Default: when the host is root.
        uid_base, uid_count: the uid range used for that.
        tmp_root: where per-run work directories are created (default: the system temp).
    """

    tier = "rlimit"
    isolated = False

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        python: str | None = None,
        python_path: Sequence[str] = (),
        site_packages: bool = False,
        env: Mapping[str, str] | None = None,
        switch_uid: bool | None = None,
        uid_base: int = 61000,
        uid_count: int = 1000,
        tmp_root: str | None = None,
        warn: bool = True,
    ) -> None:
        self.limits = limits or Limits()
        is_root = os.geteuid() == 0
        self.switch_uid = is_root if switch_uid is None else switch_uid
        if self.switch_uid and not is_root:
            raise SandboxError("switch_uid=True needs root")
        self.python = python or default_python()
        if self.switch_uid and not _proc.interpreter_reachable(self.python):
            # The throw-away uid cannot read an interpreter below e.g. /root (0700).
            alt = None if python else _proc.find_reachable_python(self.python)
            if alt is None:
                raise SandboxError(
                    f"the rlimit tier runs programs as an unprivileged uid, which cannot read "
                    f"{self.python}; pass python= an interpreter outside 0700 directories"
                )
            log.info("rlimit sandbox: %s is not readable by the sandbox uid; using %s", self.python, alt)
            self.python = alt
        self._python_cmd = [self.python] if site_packages else [self.python, "-S"]
        self._python_path = list(python_path)
        self._extra_env = dict(env or {})
        self.tmp_root = tmp_root or tempfile.gettempdir()
        self._setpriv = shutil.which("setpriv")
        self._kill_bin = shutil.which("kill")
        if self.switch_uid and not (self._setpriv and self._kill_bin):
            raise SandboxError("switch_uid needs util-linux `setpriv` and `kill`")
        self._uids = _UidPool(uid_base, uid_count)
        if warn:
            warn_once("backend='rlimit' was selected")

    # -- helpers ------------------------------------------------------------------------
    def _sweep_uid(self, uid: int) -> None:
        """Kill every process of `uid` at once: ``kill -9 -1`` sent *as* that uid reaches
        exactly its processes, atomically with respect to fork (no fork-bomb race)."""
        assert self._setpriv and self._kill_bin
        subprocess.run(
            [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             self._kill_bin, "-KILL", "-1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin"}, check=False,
        )

    @staticmethod
    def _sweep_files(uid: int) -> None:
        for d in _WORLD_WRITABLE:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path, ignore_errors=True)
                    else:
                        os.unlink(e.path)
                except OSError:
                    pass

    def _prepare(
        self, argv: Sequence[str] | None, code: str | None, files: dict[str, bytes], limits: Limits
    ) -> tuple[list[str], str, int | None]:
        workdir = tempfile.mkdtemp(prefix="actloop-sbx-", dir=self.tmp_root)
        uid: int | None = None
        try:
            for name, data in files.items():
                path = os.path.join(workdir, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            prefix: list[str] = []
            if self.switch_uid:
                uid = self._uids.acquire()
                for root, dirs, fnames in os.walk(workdir):
                    for n in [*dirs, *fnames]:
                        os.lchown(os.path.join(root, n), uid, uid)
                os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
                nproc = limits.max_procs
                assert self._setpriv
                prefix = [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                          "--no-new-privs", "--"]
            else:
                nproc = _count_tasks_of(os.getuid()) + limits.max_procs
            if code is not None:
                argv = ["python", "main.py"]
            assert argv
            # The init is a child subreaper (orphans come back to it, not to the host's
            # pid 1). Only with a throw-away uid may it kill "everything of this uid".
            prog = _proc.init_command(self._python_cmd, argv, workdir, limits, nproc=nproc + 1,
                                      init=True, subreaper=True, sweep=self.switch_uid)
            return [*prefix, *prog], workdir, uid
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                self._uids.release(uid)
            raise

    def _env(self, workdir: str) -> dict[str, str]:
        return _proc.sandbox_env(home=workdir, tmp=workdir, path="/usr/local/bin:/usr/bin:/bin",
                                 pythonpath=self._python_path, extra=self._extra_env)

    def _killer(self, proc: subprocess.Popen[bytes], uid: int | None):  # type: ignore[no-untyped-def]
        def kill() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if uid is not None:
                self._sweep_uid(uid)
        return kill

    def _cleanup(self, workdir: str, uid: int | None) -> None:
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            self._sweep_files(uid)
            self._uids.release(uid)

    # -- public API -----------------------------------------------------------------------
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
        cmd, workdir, uid = self._prepare(argv, code, fs, limits)
        try:
            proc = _proc.spawn(cmd, env=self._env(workdir), cwd=workdir,
                               stdin_pipe=data is not None, new_session=True)
            kill = self._killer(proc, uid)
            c = _proc.collect(proc, stdin_data=data, limits=limits, started=started,
                              kill=kill, after_exit=kill)
        finally:
            self._cleanup(workdir, uid)
        if c.lingering:
            log.warning("rlimit sandbox: a process escaped the run and still holds its output pipes")
        res = _proc.to_result(c, self.tier)
        log.debug("sandbox run tier=rlimit exit=%s timed_out=%s %.3fs", res.exit_code, res.timed_out, res.duration_s)
        return res

    def spawn(
        self, argv: Sequence[str], *, files: Files | None = None, limits: Limits | None = None
    ) -> _proc.SandboxProcess:
        limits = limits or self.limits
        cmd, workdir, uid = self._prepare(argv, None, check_files(files), limits)
        try:
            proc = _proc.on_spawner_thread(  # setpriv does not set a parent-death signal,
                functools.partial(_proc.spawn, cmd, env=self._env(workdir), cwd=workdir,  # but
                                  stdin_pipe=True, new_session=True))  # keep one code path
        except BaseException:
            self._cleanup(workdir, uid)
            raise
        return _proc.SandboxProcess(proc, kill=self._killer(proc, uid), tier=self.tier,
                                    cleanup=lambda: self._cleanup(workdir, uid))

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"RlimitSandbox(python={self.python!r}, switch_uid={self.switch_uid})"
