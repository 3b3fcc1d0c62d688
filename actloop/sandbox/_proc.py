"""Process plumbing shared by the backends: spawn, feed stdin, capped capture, watchdog.

One thread drives one run with a `selectors` loop over stdout, stderr, stdin and a pidfd,
so there are no helper threads per run, no deadlock on full pipes, and the watchdog fires
on time even while the program floods its output.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import clock
from .base import ExecResult, Limits, SandboxError

_READ_CHUNK = 1 << 16
# After the program exits (or is killed) we read what is left in the pipes for at most
# this long. Normally the pipes hit EOF at once; they stay open only if something that
# escaped the sandbox still holds them (possible in the rlimit tier without uid switching).
DRAIN_S = 0.5

_OOM_RE = re.compile(
    rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|failed to map segment"
)


class CappedBuffer:
    """Keeps the first and last `cap // 2` bytes of a stream and counts the rest.

    Head *and* tail, because for a model the end of stderr (the exception line) is what
    matters, and for a grader the beginning of stdout is.
    """

    __slots__ = ("head", "tail", "head_cap", "tail_cap", "total")

    def __init__(self, cap: int) -> None:
        self.tail_cap = cap // 2
        self.head_cap = cap - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            extra = len(self.tail) - self.tail_cap
            if extra > 0:
                del self.tail[:extra]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def raw_tail(self, n: int) -> bytes:
        return bytes((self.head + self.tail)[-n:])

    def text(self, name: str) -> str:
        head = self.head.decode("utf-8", "replace")
        if not self.truncated:
            return head + self.tail.decode("utf-8", "replace")
        dropped = self.total - len(self.head) - len(self.tail)
        marker = f"\n[actloop: {name} truncated, {dropped} bytes omitted]\n"
        return head + marker + self.tail.decode("utf-8", "replace")


def normalize_returncode(rc: int) -> int:
    """Popen's ``-N`` (killed by signal N) becomes ``128 + N``, as shells and Docker say."""
    return 128 - rc if rc < 0 else rc


@dataclass
class Collected:
    stdout: CappedBuffer
    stderr: CappedBuffer
    exit_code: int
    timed_out: bool
    duration_s: float
    lingering: bool  # pipes still open after the drain window (something escaped)


def spawn(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None = None,
    stdin_pipe: bool,
    pass_fds: Sequence[int] = (),
    new_session: bool = False,
    stderr_pipe: bool = True,
) -> subprocess.Popen[bytes]:
    """Popen without `preexec_fn`, so CPython can use vfork: cheap even from a host
    process holding gigabytes (a trainer), and safe with threads."""
    try:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr_pipe else subprocess.DEVNULL,
            env=dict(env),
            cwd=cwd,
            pass_fds=tuple(pass_fds),
            start_new_session=new_session,
            close_fds=True,
        )
    except OSError as e:
        raise SandboxError(f"could not start {cmd[0]!r}: {e}") from e


def collect(
    proc: subprocess.Popen[bytes],
    *,
    stdin_data: bytes | None,
    limits: Limits,
    started: float,
    kill: Callable[[], None],
    after_exit: Callable[[], None] | None = None,
    start_marker: bytes | None = None,
    start_timeout_s: float = 0.0,
) -> Collected:
    """Drive one run to completion: feed stdin, capture capped output, enforce the deadline.

    `kill` must take down the whole sandbox (not just the direct child); `after_exit` runs
    once the direct child has exited, to sweep up anything it left behind.

    `start_marker`: the sandbox writes it to stderr when the program starts (Docker: after the
    container's start, 0.3-1 s and several seconds on a loaded box). The program's timeout and
    its `duration_s` then count from the marker, so a slow container start does not eat the
    program's time; until the marker, the start itself has `start_timeout_s`.
    """
    out, err = CappedBuffer(limits.max_output_bytes), CappedBuffer(limits.max_output_bytes)
    sel = selectors.DefaultSelector()
    streams = 0
    assert proc.stdout is not None
    for f, buf in ((proc.stdout, out), (proc.stderr, err)):
        if f is None:
            continue
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, buf)
        streams += 1
    stdin_view: memoryview | None = None
    if proc.stdin is not None:
        if stdin_data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
            stdin_view = memoryview(stdin_data)
        else:
            proc.stdin.close()
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    except (AttributeError, OSError):  # kernels before 5.3: poll instead
        pidfd = -1

    program_started: float | None = started if start_marker is None else None
    deadline = started + (limits.timeout_s if start_marker is None else start_timeout_s)
    hard_stop: float | None = None
    exited = timed_out = False
    try:
        while not (exited and streams == 0):
            now = time.monotonic()
            if hard_stop is not None and now >= hard_stop:
                break
            if not exited and not timed_out and now >= deadline:
                timed_out = True
                kill()
                hard_stop = now + DRAIN_S
            until = hard_stop if hard_stop is not None else deadline
            wait = max(0.0, until - now)
            if pidfd < 0:
                wait = min(wait, 0.01)
            for key, _ in sel.select(wait):
                tag = key.data
                if tag == "exit":
                    sel.unregister(pidfd)
                    exited = True
                elif tag == "stdin":
                    assert stdin_view is not None and proc.stdin is not None
                    try:
                        n = os.write(key.fd, stdin_view[:_READ_CHUNK])
                        stdin_view = stdin_view[n:]
                        done = not stdin_view
                    except (BrokenPipeError, OSError):
                        done = True
                    if done:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                else:
                    try:
                        data = os.read(key.fd, _READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if data:
                        tag.feed(data)
                        if program_started is None and start_marker is not None and tag is err \
                                and start_marker in err.head:
                            program_started = time.monotonic()
                            deadline = program_started + limits.timeout_s
                    else:
                        sel.unregister(key.fd)
                        streams -= 1
            if pidfd < 0 and not exited and proc.poll() is not None:
                exited = True
            if exited and hard_stop is None:
                if after_exit is not None:
                    after_exit()
                hard_stop = time.monotonic() + DRAIN_S
    finally:
        sel.close()
        if pidfd >= 0:
            os.close(pidfd)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()
    if proc.poll() is None:  # the drain window closed before the exit: make sure
        kill()
    rc = proc.wait()
    if after_exit is not None and not exited:
        after_exit()
    return Collected(
        stdout=out,
        stderr=err,
        exit_code=normalize_returncode(rc),
        timed_out=timed_out,
        duration_s=time.monotonic() - (started if program_started is None else program_started),
        lingering=streams > 0,
    )


SIGXCPU_EXIT = 128 + 24


def to_result(c: Collected, tier: str, *, oom_exit_137: bool = False) -> ExecResult:
    """Turn collected output into an `ExecResult`, flagging CPU-limit kills and OOM."""
    timed_out = c.timed_out or c.exit_code == SIGXCPU_EXIT
    clock.record(c.duration_s, timed_out)  # per-step sandbox time for the trainer's metrics
    oom = bool(_OOM_RE.search(c.stderr.raw_tail(4096)))
    if oom_exit_137 and c.exit_code == 137 and not c.timed_out:
        oom = True
    return ExecResult(
        stdout=c.stdout.text("stdout"),
        stderr=c.stderr.text("stderr"),
        exit_code=c.exit_code,
        timed_out=timed_out,
        oom=oom and not timed_out,
        duration_s=c.duration_s,
        tier=tier,
        truncated=c.stdout.truncated or c.stderr.truncated,
    )


def rlimit_list(limits: Limits, *, nproc: int | None) -> list[tuple[str, int, int]]:
    """(name, soft, hard) for every rlimit a sandboxed program gets."""
    mb = 1024 * 1024
    cpu = limits.cpu_seconds
    lims = [
        ("CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        ("AS", limits.memory_mb * mb, limits.memory_mb * mb),
        ("NOFILE", limits.max_open_files, limits.max_open_files),
        ("FSIZE", limits.max_file_mb * mb, limits.max_file_mb * mb),
        ("CORE", 0, 0),
    ]
    if nproc is not None:
        lims.append(("NPROC", nproc, nproc))
    return lims


# ``python -S -c INIT``: how every sandboxed Python program starts. It sets the rlimits
# (hard == soft, so they cannot be raised again) and runs the program — a script or
# source *in-process*, like ``python FILE`` would, with its own traceback frame hidden —
# or execs a command. With ``init=True`` it first forks and the parent stays behind as
# the run's init: it reaps whatever the program orphans and exits with the program's
# status (128 + N for signal N); as a child subreaper (rlimit tier) orphans come back to
# it instead of to the host's pid 1, and with a throw-away uid it kills every leftover.
# (The bwrap tier uses a shell as pid 1 instead: forking a started interpreter costs ~3 ms
# of copy-on-write faults while the child tears down.)
_INIT = r"""
import os, sys, _signal
S = %(spec)r
_child = 0
if S["init"]:
    if S["subreaper"]:
        try:
            import ctypes
            ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except Exception:
            pass
    for _s in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):  # `signal` imports enum: 5 ms
        _signal.signal(_s, _signal.SIG_IGN)
    _child = os.fork()
    if _child == 0:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        for _s in (_signal.SIGTERM, _signal.SIGHUP):
            _signal.signal(_s, _signal.SIG_DFL)
if _child == 0:
    import resource
    for _n, _soft, _hard in S["limits"]:
        resource.setrlimit(getattr(resource, "RLIMIT_" + _n), (_soft, _hard))
    if S["exec"]:
        try:
            os.execvp(S["exec"][0], S["exec"])
        except OSError as _e:
            os.write(2, ("%%s: %%s\n" %% (S["exec"][0], _e.strerror)).encode())
            os._exit(127)
    sys.argv[:] = S["argv"]
    sys.path[0] = S["path0"]
    def _hook(t, v, b, h=sys.__excepthook__):
        if b is not None and b.tb_frame.f_code.co_filename == "<string>":
            b = b.tb_next
        h(t, v.with_traceback(b), b)
    sys.excepthook = _hook
    if S["source"] is not None:
        _code = compile(S["source"], "<string>", "exec")
    else:
        __file__ = S["script"]
        with open(__file__, "rb") as _f:
            _code = compile(_f.read(), __file__, "exec")
        del _f
    del os, sys, _signal, S, resource, _child, _n, _soft, _hard, _hook
    exec(_code)
else:
    for _fd in (0, 1, 2):
        os.close(_fd)
    _status = 0
    while True:
        try:
            _pid, _st = os.wait()
        except ChildProcessError:
            break
        if _pid == _child:
            _status = _st
            break
    if S["sweep"]:
        try:
            os.kill(-1, _signal.SIGKILL)
        except OSError:
            pass
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
    _rc = os.waitstatus_to_exitcode(_status)
    os._exit(128 - _rc if _rc < 0 else _rc)
"""


def python_init(
    limits: Limits,
    *,
    nproc: int | None,
    script: str | None = None,
    source: str | None = None,
    exec_argv: Sequence[str] | None = None,
    argv: Sequence[str] = (),
    path0: str = "",
    init: bool = False,
    subreaper: bool = False,
    sweep: bool = False,
) -> str:
    """Source of the program (see `_INIT`) for one run.

    Exactly one of `script` (path of a Python file), `source` (Python source) or
    `exec_argv` (a command to exec) says what to run. `argv` becomes ``sys.argv`` and
    `path0` ``sys.path[0]`` for in-process Python. `init`: fork and stay behind as the
    run's init; `subreaper`: as a child subreaper; `sweep`: kill every other process of
    this uid when the program exits (only for a uid that belongs to this one run).
    """
    if sum(x is not None for x in (script, source, exec_argv)) != 1:
        raise ValueError("exactly one of script, source, exec_argv")
    spec = {
        "limits": rlimit_list(limits, nproc=nproc),
        "script": script,
        "source": source,
        "exec": list(exec_argv) if exec_argv is not None else None,
        "argv": list(argv),
        "path0": path0,
        "init": init,
        "subreaper": subreaper,
        "sweep": sweep,
    }
    return _INIT % {"spec": spec}


def prlimit_args(limits: Limits, *, nproc: int | None) -> list[str]:
    """util-linux ``prlimit`` flags: the rlimits for a non-Python command (bwrap tier)."""
    return [f"--{name.lower()}={soft}:{hard}" for name, soft, hard in rlimit_list(limits, nproc=nproc)]


def init_command(
    python_cmd: Sequence[str],
    argv: Sequence[str],
    workdir: str,
    limits: Limits,
    *,
    nproc: int | None,
    init: bool = False,
    subreaper: bool = False,
    sweep: bool = False,
) -> list[str]:
    """``python -S -c ...`` for a run of `argv`. ``argv[0] == "python"`` means the
    sandbox's interpreter: ``python FILE ...`` and ``python -c SRC ...`` run in-process,
    other interpreter flags re-exec it; anything else is exec'd from ``PATH``."""
    what: dict[str, object]
    if argv[0] == "python" and len(argv) >= 2 and not argv[1].startswith("-"):
        script = argv[1] if argv[1].startswith("/") else f"{workdir}/{argv[1]}"
        what = {"script": script, "argv": list(argv[1:]), "path0": os.path.dirname(script)}
    elif argv[0] == "python" and len(argv) >= 3 and argv[1] == "-c":
        what = {"source": argv[2], "argv": ["-c", *argv[3:]], "path0": workdir}
    elif argv[0] == "python":
        what = {"exec_argv": [*python_cmd, *argv[1:]]}
    else:
        what = {"exec_argv": list(argv)}
    src = python_init(limits, nproc=nproc, init=init, subreaper=subreaper, sweep=sweep, **what)  # type: ignore[arg-type]
    return [*python_cmd, "-c", src]


def sandbox_env(
    *, home: str, tmp: str, path: str, pythonpath: Sequence[str] = (), extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment a sandboxed program sees: nothing from the host."""
    env = {
        "PATH": path,
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # Same set iteration order on every run: rewards do not depend on hash seeds.
        "PYTHONHASHSEED": "0",
        # One thread per BLAS/OpenMP pool: threads count against max_procs and memory_mb.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if pythonpath:
        env["PYTHONPATH"] = ":".join(pythonpath)
    if extra:
        env.update(extra)
    return env


class SandboxProcess:
    """A long-lived sandboxed process (for `PythonSession`): pipes plus a `kill` that
    takes down the whole sandbox, not just the direct child."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        *,
        kill: Callable[[], None],
        tier: str,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.popen = popen
        self.tier = tier
        self._kill = kill
        self._cleanup = cleanup
        self._closed = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self._kill()

    def close(self) -> None:
        """Kill the sandbox, reap it, close the pipes, remove its files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._kill()
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
            pass
        if self._cleanup is not None:
            self._cleanup()


def others_can_reach(path: str) -> bool:
    """Whether an unrelated, unprivileged uid can reach `path`: o+x on every directory on
    the way (and on `path` itself if it is one), o+r on it if it is a file."""
    import stat as _stat

    try:
        parts = os.path.abspath(path).split("/")
        for i in range(2, len(parts) + 1):
            st = os.stat("/".join(parts[:i]))
            need = _stat.S_IXOTH if _stat.S_ISDIR(st.st_mode) else _stat.S_IROTH
            if not st.st_mode & need:
                return False
    except OSError:
        return False
    return True


def interpreter_reachable(python: str) -> bool:
    """Whether an unprivileged uid can run `python` *and* read its standard library."""
    real = os.path.realpath(python)
    if not others_can_reach(real):
        return False
    prefix = os.path.dirname(os.path.dirname(real))
    libs = [os.path.join(prefix, "lib", d) for d in os.listdir(os.path.join(prefix, "lib"))
            if d.startswith("python3")] if os.path.isdir(os.path.join(prefix, "lib")) else []
    return all(others_can_reach(p) for p in libs) and bool(libs)


def unreachable_reason(path: str) -> str:
    """Why this process cannot run `path`, in words: the directory on the way it may not
    enter (e.g. an interpreter below /root, mode 0700, seen by an unprivileged user)."""
    import stat as _stat

    parts = os.path.abspath(path).split("/")
    for i in range(2, len(parts) + 1):
        here, parent = "/".join(parts[:i]), "/".join(parts[: i - 1]) or "/"
        try:
            os.stat(here)
        except PermissionError:
            try:
                st = os.stat(parent)
                how = f"{parent} is {_stat.filemode(st.st_mode)} owned by uid {st.st_uid}"
            except OSError:
                how = f"{parent} cannot be entered"
            return f"is not reachable by uid {os.geteuid()}: {how}"
        except OSError:
            return "does not exist"
    if not os.access(path, os.X_OK):
        return f"is not executable by uid {os.geteuid()}"
    return "cannot be used"


def find_reachable_python(prefer: str) -> str | None:
    """An interpreter an unprivileged uid can use, same major.minor as `prefer` first."""
    import glob

    ver = os.path.basename(os.path.realpath(prefer))  # e.g. python3.11
    cands = [f"/usr/local/bin/{ver}", f"/usr/bin/{ver}", "/usr/local/bin/python3", "/usr/bin/python3",
             *sorted(glob.glob("/usr/bin/python3.*"), reverse=True)]
    for c in cands:
        if os.path.exists(c) and os.access(c, os.X_OK) and interpreter_reachable(c):
            return c
    return None


_SPAWNER = None
_SPAWNER_LOCK = __import__("threading").Lock()


def on_spawner_thread(fn: Callable[..., object], *args: object) -> object:
    """Call `fn` on one thread that lives as long as the process, and return its result.

    Why: bwrap arms PR_SET_PDEATHSIG, and the kernel fires it when the *thread* that
    spawned bwrap exits, not the process. A long-lived sandbox (a `PythonSession`) started
    from a short-lived thread (an executor worker, an env's reset in a thread) would be
    killed with it. One-shot runs do not need this: their thread waits for them.
    """
    global _SPAWNER
    from concurrent.futures import ThreadPoolExecutor

    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="actloop-sandbox-spawner")
    return _SPAWNER.submit(fn, *args).result()
