"""Unit tests for the sandbox package: runs, files, stdin, truncation, tiers, async, the
pool's concurrency bound, PythonSession, the factory, the CLI and the Docker command line."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
from typer.testing import CliRunner

import actloop.sandbox.docker as docker_mod
import actloop.sandbox.factory as factory
import actloop.sandbox.rlimit as rlimit_mod
from actloop.sandbox import (
    ISOLATED_TIERS,
    BwrapSandbox,
    DockerSandbox,
    ExecResult,
    IsolationUnavailableError,
    Limits,
    PythonSession,
    RlimitSandbox,
    SandboxError,
    SandboxPool,
    TierStatus,
    get_sandbox,
)
from actloop.sandbox import _proc
from actloop.sandbox._proc import CappedBuffer, python_init
from actloop.sandbox.cli import app
from actloop.sandbox.docker import docker_available


@pytest.fixture(params=["bwrap", "rlimit", "docker"], scope="module")
def sb(request):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(f"{request.param}_sandbox")  # skips a tier that is missing here


# ------------------------------------------------------------------------ value types
def test_limits_defaults_validation_and_cpu() -> None:
    lim = Limits()
    assert (lim.timeout_s, lim.memory_mb, lim.max_procs, lim.tmpfs_mb) == (10.0, 512, 64, 64)
    assert lim.cpu_seconds == 10  # follows timeout_s when cpu_s is None
    assert Limits(timeout_s=2.5).cpu_seconds == 3
    assert Limits(timeout_s=30, cpu_s=1.2).cpu_seconds == 2
    with pytest.raises(ValueError):
        Limits(memory_mb=0)
    with pytest.raises(ValueError):
        Limits(timeout_s=-1)
    with pytest.raises(AttributeError):
        lim.timeout_s = 3  # type: ignore[misc]  # frozen
    assert lim.replace(timeout_s=3).timeout_s == 3


def test_exec_result_json_roundtrip() -> None:
    r = ExecResult("out", "err", 0, False, False, 0.1, "bwrap")
    assert r.ok
    assert json.loads(r.to_json())["tier"] == "bwrap"
    assert not ExecResult("", "", 0, True, False, 1.0, "rlimit").ok


def test_capped_buffer_keeps_head_and_tail() -> None:
    b = CappedBuffer(10)
    b.feed(b"0123456789")
    assert not b.truncated and b.text("stdout") == "0123456789"
    b.feed(b"abcdef")
    assert b.truncated
    text = b.text("stdout")
    assert text.startswith("01234") and text.endswith("bcdef")
    assert "[actloop: stdout truncated, 6 bytes omitted]" in text


def _collect_after_a_slow_start(start_s: float, run_s: float, limits: Limits,
                                start_timeout_s: float) -> _proc.Collected:
    """A process that starts slowly (as a container on a loaded box), marks its start on stderr,
    then runs `run_s`: what `collect` makes of it with a start marker."""
    code = (f"import os,time\ntime.sleep({start_s})\nos.write(2, b'<started>')\n"
            f"time.sleep({run_s})\nprint('done', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return _proc.collect(proc, stdin_data=None, limits=limits, started=time.monotonic(),
                         kill=proc.kill, start_marker=b"<started>", start_timeout_s=start_timeout_s)


def test_the_programs_timeout_counts_from_its_start_marker_not_from_a_slow_start() -> None:
    # 1.5 s of start + 0.3 s of program under a 1 s timeout: the program is within its time
    c = _collect_after_a_slow_start(1.5, 0.3, Limits(timeout_s=1.0), start_timeout_s=30)
    assert not c.timed_out and c.exit_code == 0 and c.stdout.text("stdout") == "done\n"
    assert 0.25 < c.duration_s < 1.0, c.duration_s  # the program's own time
    # the same program over its time is still stopped, a timeout from its start
    c = _collect_after_a_slow_start(0.5, 5.0, Limits(timeout_s=1.0), start_timeout_s=30)
    assert c.timed_out and 0.9 < c.duration_s < 3.0, c.duration_s
    # a start that never ends is bounded by the start timeout, the marker never seen
    c = _collect_after_a_slow_start(10.0, 0.1, Limits(timeout_s=5.0), start_timeout_s=1.0)
    assert c.timed_out and b"<started>" not in c.stderr.head


# ------------------------------------------------------------------------------ runs
def test_basic_run_and_tier(sb) -> None:  # type: ignore[no-untyped-def]
    r = sb.run("print(6 * 7)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.oom) == ("42\n", "", 0, False, False)
    assert r.tier == sb.tier and r.ok and r.error is None
    assert 0 < r.duration_s < 5
    assert sb.isolated == (sb.tier in ISOLATED_TIERS)


def test_exit_codes_follow_shell_convention(sb) -> None:  # type: ignore[no-untyped-def]
    assert sb.run("import sys; sys.exit(3)").exit_code == 3
    r = sb.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert r.exit_code == 128 + signal.SIGSEGV


def test_traceback_reads_like_a_plain_script(sb) -> None:  # type: ignore[no-untyped-def]
    r = sb.run("def f():\n    return 1 / 0\nf()\n")
    assert r.exit_code == 1
    assert r.stderr.startswith("Traceback (most recent call last):\n  File ")
    assert "<string>" not in r.stderr and "main.py\", line 3" in r.stderr
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    syn = sb.run("def f(:\n")
    assert "SyntaxError" in syn.stderr and "<string>" not in syn.stderr


def test_files_and_stdin(sb) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import sys, helper\n"
        "data = open('data/nested/in.bin', 'rb').read()\n"
        "print(helper.X, len(data), data[:3], sys.stdin.read().upper())\n"
    )
    r = sb.run(code, files={"helper.py": "X = 5\n", "data/nested/in.bin": b"\x00\x01\x02rest"}, stdin="hello")
    assert r.stdout == "5 7 b'\\x00\\x01\\x02' HELLO\n", r


def test_large_stdin_does_not_deadlock(sb) -> None:  # type: ignore[no-untyped-def]
    blob = b"y" * (3 << 20)  # far beyond a pipe buffer, both ways
    r = sb.run("import sys; d = sys.stdin.buffer.read(); print(len(d))",
               stdin=blob, limits=Limits(max_output_bytes=1 << 10))
    assert r.stdout == f"{len(blob)}\n", r


def test_argv_mode_and_python_alias(sb) -> None:  # type: ignore[no-untyped-def]
    r = sb.run(argv=["python", "-c", "import sys; print(sys.argv[1:])", "a", "b"])
    assert r.stdout == "['a', 'b']\n", r
    r = sb.run(argv=["python", "prog.py", "x"], files={"prog.py": "import sys; print(sys.argv)"})
    assert r.stdout == "['prog.py', 'x']\n", r
    r = sb.run(argv=["sh", "-c", "echo $HOME; exit 4"])
    assert r.exit_code == 4 and r.stdout.strip()


def test_input_validation(sb) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        sb.run()
    with pytest.raises(ValueError):
        sb.run("x", argv=["python"])
    for bad in ("/etc/passwd", "../x", "a/../b", ""):
        with pytest.raises(ValueError):
            sb.run("pass", files={bad: "x"})
    with pytest.raises(ValueError):
        sb.run("pass", files={"main.py": "clash"})


def test_output_truncation_marker(sb) -> None:  # type: ignore[no-untyped-def]
    r = sb.run("print('A' * 5000 + 'END')", limits=Limits(max_output_bytes=100))
    assert r.truncated and not r.timed_out and r.exit_code == 0
    assert r.stdout.startswith("A" * 50) and r.stdout.endswith("END\n")
    assert "[actloop: stdout truncated," in r.stdout
    assert len(r.stdout) < 200


def test_clean_environment(sb, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ACTLOOP_LEAK_CHECK", "1")
    r = sb.run("import os; print(sorted(os.environ))")
    keys = eval(r.stdout)  # noqa: S307 - our own output
    assert "ACTLOOP_LEAK_CHECK" not in keys
    assert set(keys) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE",
                         "PYTHONIOENCODING", "PYTHONHASHSEED", "OMP_NUM_THREADS",
                         "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH",
                         "PWD"}  # bwrap --chdir sets PWD


def test_oom_flag_and_timeout_flag(sb) -> None:  # type: ignore[no-untyped-def]
    r = sb.run("x = bytearray(4 << 30)", limits=Limits(memory_mb=128))
    assert r.oom and r.exit_code == 1 and not r.timed_out
    t = 3.0 if sb.tier == "docker" else 0.5  # the timeout includes a container's start (~0.5 s)
    r = sb.run("import time; time.sleep(10)", limits=Limits(timeout_s=t))
    assert r.timed_out and r.exit_code == 137 and 0.9 * t < r.duration_s < t + 2.0, r


def test_bwrap_work_dir_is_private_between_runs(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    bwrap_sandbox.run("open('left.txt', 'w').write('x'); open('/tmp/t', 'w').write('y')")
    r = bwrap_sandbox.run("import os; print(sorted(os.listdir('.')), os.getcwd())")
    assert r.stdout == "['main.py'] /sandbox\n"


def test_bwrap_python_path_binds_a_host_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "extmod.py").write_text("VALUE = 'from host lib'\n")
    tmp_path.chmod(0o755)
    sb = BwrapSandbox(python_path=[str(lib)])
    r = sb.run("import extmod; print(extmod.VALUE)")
    assert r.stdout == "from host lib\n", r
    r = sb.run(f"open({str(lib / 'x')!r}, 'w')")
    assert "Read-only file system" in r.stderr


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system /usr/bin/python3")
def test_bwrap_other_interpreter() -> None:
    r = BwrapSandbox(python="/usr/bin/python3").run("import sys; print(sys.executable)")
    assert r.stdout == "/usr/bin/python3\n", r


def test_rlimit_same_uid_path_runs_benign_code() -> None:
    # The non-root fallback path (no uid switching): only benign code here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sb = RlimitSandbox(switch_uid=False, warn=False)
    r = sb.run("import os; print('ok', os.getcwd().startswith(os.environ['HOME']))")
    assert r.stdout == "ok True\n" and r.tier == "rlimit", r


def test_rlimit_warns_loudly_once(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(rlimit_mod, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match="WITHOUT namespace isolation"):
        RlimitSandbox()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RlimitSandbox()  # second time: silent
    assert "WITHOUT namespace isolation" in caplog.text


def test_init_sets_limits_before_user_code_and_relays_status() -> None:
    src = ("import resource as r, os\n"
           "print(r.getrlimit(r.RLIMIT_NOFILE), r.getrlimit(r.RLIMIT_NPROC), os.getpid() != 1)\n"
           "raise SystemExit(5)")
    init = python_init(Limits(memory_mb=100, max_open_files=33), nproc=7000, source=src, argv=["-c"], init=True)
    r = subprocess.run([sys.executable, "-S", "-c", init], capture_output=True, text=True, timeout=30)
    assert (r.stdout, r.returncode) == ("(33, 33) (7000, 7000) True\n", 5), r.stderr
    init = python_init(Limits(), nproc=None, source="import os, signal; os.kill(os.getpid(), signal.SIGABRT)",
                       init=True)
    r = subprocess.run([sys.executable, "-S", "-c", init], capture_output=True, timeout=30)
    assert r.returncode == 128 + signal.SIGABRT


# ----------------------------------------------------------------------- async, pool
def test_arun_gathers_concurrently(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[ExecResult]:
        return await asyncio.gather(*(bwrap_sandbox.arun(f"print({i} * 2)") for i in range(4)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n", "6\n"]


SLEEPER = "import time\nt0 = time.time()\ntime.sleep(0.4)\nprint(t0, time.time())\n"


def _max_overlap(results: list[ExecResult]) -> int:
    events = []
    for r in results:
        a, b = map(float, r.stdout.split())
        events += [(a, 1), (b, -1)]
    cur = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def test_pool_bounds_concurrency_sync(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    pool = SandboxPool(bwrap_sandbox, size=2)
    results: list[ExecResult] = []
    lock = threading.Lock()

    def worker() -> None:
        r = pool.run(SLEEPER)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert all(r.ok for r in results), results
    assert pool.max_in_flight == 2
    assert _max_overlap(results) == 2  # measured inside the sandboxes, not by our counter
    assert elapsed >= 3 * 0.4


def test_pool_bounds_concurrency_async_and_map(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    with SandboxPool(bwrap_sandbox, size=3) as pool:
        async def main() -> list[ExecResult]:
            return await asyncio.gather(*(pool.arun(SLEEPER) for _ in range(7)))

        results = asyncio.run(main())
        assert all(r.ok for r in results) and _max_overlap(results) <= 3
        assert pool.max_in_flight == 3
        mapped = pool.map(["print(1)", {"code": "print(2)"}, {"argv": ["python", "-c", "print(3)"]}])
        assert [r.stdout for r in mapped] == ["1\n", "2\n", "3\n"]
        assert pool.tier == "bwrap" and pool.isolated


# ------------------------------------------------------------------------- session
@pytest.fixture(params=["bwrap", "rlimit", "docker"])
def session_sandbox(request):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(f"{request.param}_sandbox")


def test_session_persistence_and_notebook_semantics(session_sandbox) -> None:  # type: ignore[no-untyped-def]
    with PythonSession(session_sandbox) as py:
        assert py.execute("x = 20\ndef f(y):\n    return x + y").text == ""
        out = py.execute("print('side', flush=True)\nf(22)")
        assert out.ok and out.text == "side\n42\n" and str(out) == out.text
        assert py.execute("import math\nmath.sqrt(x * 5)").text == "10.0\n"
        err = py.execute("import sys; print('to stderr', file=sys.stderr); import os; os.system('echo from child')")
        assert "to stderr" in err.text and "from child" in err.text
        assert py.tier == session_sandbox.tier


def test_session_errors_keep_state(session_sandbox) -> None:  # type: ignore[no-untyped-def]
    with PythonSession(session_sandbox) as py:
        py.execute("keep = 'still here'")
        e = py.execute("def g():\n    raise ValueError('boom')\ng()")
        assert not e.ok and not e.restarted
        assert 'File "<cell 2>", line 3' in e.text and "raise ValueError('boom')" in e.text
        assert e.text.rstrip().endswith("ValueError: boom") and "_repl" not in e.text
        assert "SyntaxError" in py.execute("def (:").text
        assert "EOFError" in py.execute("input()").text  # stdin is not the protocol
        assert "SystemExit: 3" in py.execute("import sys; sys.exit(3)").text
        assert "MemoryError" in py.execute("b = bytearray(8 << 30)").text
        assert py.execute("keep").text == "'still here'\n"
        assert py.restarts == 0


def test_session_timeout_restarts_with_message(session_sandbox) -> None:  # type: ignore[no-untyped-def]
    with PythonSession(session_sandbox, limits=Limits(timeout_s=0.5, cpu_s=30, memory_mb=1024)) as py:
        py.execute("state = 1")
        t0 = time.monotonic()
        out = py.execute("while True:\n    pass")
        assert time.monotonic() - t0 < 0.5 + 2.0
        assert out.timed_out and out.restarted and not out.ok
        assert "0.5 s" in out.text and "restarted" in out.text
        assert "NameError" in py.execute("state").text  # fresh interpreter
        assert py.execute("1 + 1").text == "2\n"
        assert py.execute("import time; time.sleep(3)", timeout_s=0.3).timed_out  # per-call override
        assert py.restarts == 2


def test_session_crash_restarts(session_sandbox) -> None:  # type: ignore[no-untyped-def]
    with PythonSession(session_sandbox) as py:
        py.execute("a = 1")
        out = py.execute("import os; os._exit(7)")
        assert out.restarted and not out.timed_out and "exit status 7" in out.text
        seg = py.execute("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
        assert seg.restarted and "SIGSEGV" in seg.text
        assert py.execute("a = 2; a").text == "2\n"


def test_session_output_truncated_per_call(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    with PythonSession(bwrap_sandbox, limits=Limits(max_output_bytes=200, memory_mb=1024)) as py:
        out = py.execute("print('H' * 1000 + 'TAIL')")
        assert out.truncated and out.text.startswith("H" * 50) and out.text.endswith("TAIL\n")
        assert "[actloop: output truncated" in out.text
        assert not py.execute("print('short')").truncated


def test_session_close_kills_sandbox_and_survives_spawning_thread(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    holder: list[PythonSession] = []

    def start() -> None:
        s = PythonSession(bwrap_sandbox)
        s.start()
        holder.append(s)

    t = threading.Thread(target=start)
    t.start()
    t.join()  # the thread that spawned the sandbox is gone
    py = holder[0]
    time.sleep(0.2)
    assert py.execute("40 + 2").text == "42\n"
    assert py._proc is not None
    pid = py._proc.pid
    py.close()
    time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    with pytest.raises(SandboxError):
        py.execute("1")


def test_session_async(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[str]:
        with PythonSession(bwrap_sandbox) as a, PythonSession(bwrap_sandbox) as b:
            await asyncio.gather(a.aexecute("v = 'a'"), b.aexecute("v = 'b'"))
            outs = await asyncio.gather(a.aexecute("v"), b.aexecute("v"))
            return [o.text for o in outs]

    assert asyncio.run(main()) == ["'a'\n", "'b'\n"]


# ------------------------------------------------------------------------- factory
def test_get_sandbox_auto_picks_bwrap_here(bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    sb = get_sandbox()
    assert isinstance(sb, BwrapSandbox) and sb.isolated
    assert get_sandbox(require_isolation=True).tier == "bwrap"
    pooled = get_sandbox(pool_size=2)
    assert isinstance(pooled, SandboxPool) and pooled.size == 2


def test_get_sandbox_fallback_and_require_isolation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    down = TierStatus("bwrap", False, True, "simulated: user namespaces disabled")
    monkeypatch.setattr(factory, "probe_bwrap", lambda python=None: down)
    monkeypatch.setattr(rlimit_mod, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match="simulated: user namespaces disabled"):
        sb = get_sandbox()
    assert isinstance(sb, RlimitSandbox) and not sb.isolated
    assert sb.run("print('fallback')").tier == "rlimit"
    with pytest.raises(IsolationUnavailableError, match="simulated"):
        get_sandbox(require_isolation=True)
    with pytest.raises(SandboxError):
        get_sandbox("bwrap")


def test_get_sandbox_explicit_backends() -> None:
    with pytest.raises(IsolationUnavailableError):
        get_sandbox("rlimit", require_isolation=True)
    with pytest.raises(ValueError):
        get_sandbox("firecracker")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert get_sandbox("rlimit").tier == "rlimit"


# ---------------------------------------------------------------------------- docker
def test_docker_command_line_has_the_isolation_flags() -> None:
    sb = DockerSandbox(check=False)
    cmd = sb.command("actloop-sbx-test", Limits(memory_mb=256, max_procs=32, tmpfs_mb=16, timeout_s=5), deadline=123.0)
    joined = " ".join(cmd)
    for flag in ("--network none", "--memory 256m", "--memory-swap 256m", "--pids-limit 33",
                 "--read-only", "--cap-drop ALL", "--security-opt no-new-privileges",
                 "--user 65534:65534", "--rm", "--name actloop-sbx-test", "--pull never",
                 "--ulimit cpu=5:6", "size=16m", "--shm-size 4m", "--label actloop.sandbox.deadline=123.0"):
        assert flag in joined, flag
    assert "--tmpfs" in cmd and any(c.startswith("/sandbox:") and "mode=1777" in c for c in cmd)
    # Docker 20.10 makes a --workdir on the tmpfs root-owned 0755: uid 65534 could not write main.py
    assert "--workdir" not in cmd and "-w" not in cmd
    assert not any(c.startswith("HOSTNAME=") or c.startswith("USER=") for c in cmd)


def test_docker_default_image_is_the_config_default() -> None:
    from actloop.config import SandboxConfig
    from actloop.sandbox.docker import DEFAULT_IMAGE

    assert SandboxConfig().docker_image == DEFAULT_IMAGE  # config cannot import the sandbox layer


def test_docker_start_marker_splits_client_chatter_from_program_stderr() -> None:
    from actloop.sandbox.docker import STARTED, _strip_started

    buf = CappedBuffer(1 << 10)
    buf.feed(b"WARNING: Your kernel does not support swap limit capabilities\n" + STARTED + b"program err\n")
    assert _strip_started(buf) == "WARNING: Your kernel does not support swap limit capabilities\n"
    assert buf.text("stderr") == "program err\n" and not buf.truncated
    nothing = CappedBuffer(1 << 10)
    nothing.feed(b"docker: Error response from daemon: No such image\n")
    assert _strip_started(nothing) is None  # never started: the sandbox's failure


def test_docker_boot_failure_comes_before_the_start_marker() -> None:
    # The preamble that unpacks files inside the container, on the host: /sandbox is absent
    # here, so it must fail as the sandbox (exit 125, a reason, no start marker).
    from actloop.sandbox.docker import _BOOT, STARTED

    assert not os.path.exists("/sandbox")
    header = DockerSandbox(check=False)._header(None, "print(1)", {"main.py": b"print(1)"}, Limits())
    r = subprocess.run([sys.executable, "-S", "-c", _BOOT], input=header, capture_output=True, timeout=30)
    assert r.returncode == 125 and STARTED not in r.stderr
    assert b"actloop-boot: cannot write the work directory /sandbox" in r.stderr


@pytest.fixture
def docker_client() -> str:
    exe = shutil.which("docker")
    if not exe:
        pytest.skip("the docker client is not installed")
    return exe


def test_docker_failures_are_results_not_tracebacks(docker_client, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket

    lim = Limits(timeout_s=3)
    # 1. no daemon at all
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    r = DockerSandbox(check=False).run("print(1)", limits=lim)
    assert r.error and "docker run failed" in r.error and r.exit_code == 125 and not r.ok, r
    with pytest.raises(SandboxError, match="cannot reach a daemon"):
        docker_available.cache_clear()
        DockerSandbox()
    # 2. a daemon that accepts the connection and never answers: back by the start's bound
    # (max(START_TIMEOUT_S, timeout): the program's timeout counts from its start), error set
    monkeypatch.setattr(docker_mod, "START_TIMEOUT_S", 1.0)
    path = tmp_path / "mute.sock"
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(str(path))
    mute.listen(16)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    try:
        t0 = time.monotonic()
        r = DockerSandbox(check=False).run("print(1)", limits=lim)
        wall = time.monotonic() - t0
    finally:
        mute.close()
        docker_available.cache_clear()
    assert wall < lim.timeout_s + 2, wall
    assert r.timed_out and r.error and "did not start" in r.error, r


def test_docker_missing_image_and_fake_infrastructure_exit(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    r = DockerSandbox(image="actloop-no-such-image:0", check=False).run("print(1)")
    assert r.error and "build-image" in r.error and r.exit_code == 125, r
    with pytest.raises(SandboxError, match="not present"):
        DockerSandbox(image="actloop-no-such-image:0")
    # the program's own exit 125 is the program's: it cannot pose as a sandbox failure
    r = docker_sandbox.run("import sys; print('x', file=sys.stderr); sys.exit(125)")
    assert r.exit_code == 125 and r.error is None and r.stderr == "x\n", r


def _containers(label: str = "actloop.sandbox") -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.split()


def test_docker_flood_is_cut_at_the_timeout_and_the_container_removed(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    """The issue's case: a stdout flood (GBs) with a 5 s timeout took 36 s and a traceback."""
    code = "import os\nb = b'x' * (1 << 20)\nwhile True:\n    os.write(1, b)\n"
    before = set(_containers())
    t0 = time.monotonic()
    r = docker_sandbox.run(code, limits=Limits(timeout_s=5))
    wall = time.monotonic() - t0
    assert wall < 5 + 2 and r.timed_out and r.truncated and r.error is None, (wall, r)
    assert len(r.stdout) < Limits().max_output_bytes + 200
    deadline = time.monotonic() + 10
    while set(_containers()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_containers()) - before, "the flooding container outlived its run by 10 s"


def test_docker_cgroup_memory_limit_binds_across_processes(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    # each process stays under RLIMIT_AS (96 MiB of 128), together they pass the cgroup's 128 MiB
    code = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        b = bytearray(90 << 20)\n"
        "        b[::4096] = b'x' * len(b[::4096])\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "print('children', [os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(4)])\n"
    )
    r = docker_sandbox.run(code, limits=Limits(memory_mb=128, timeout_s=20))
    assert not r.timed_out, r
    codes = eval(r.stdout.split("children", 1)[1]) if "children" in r.stdout else None  # noqa: S307
    assert (codes and -9 in codes) or r.oom, r  # the kernel's OOM killer (SIGKILL) hit at least one


def test_docker_stale_containers_are_removed(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    from actloop.sandbox.docker import DEFAULT_IMAGE, remove_stale

    name = f"actloop-sbx-stale-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--network", "none", "--label", "actloop.sandbox",
                    "--label", "actloop.sandbox.deadline=1000.0", "--entrypoint", "sleep", DEFAULT_IMAGE, "300"],
                   check=True, capture_output=True, timeout=60)
    try:
        assert remove_stale() >= 1
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"name={name}"], capture_output=True, text=True,
                              timeout=30).stdout.split()
        assert left == []
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def _docker_cli_only(sb) -> None:  # type: ignore[no-untyped-def]
    """The CLI and the config key use the `docker` client; skip when the suite runs another."""
    if sb.docker != shutil.which("docker"):
        pytest.skip(f"the CLI and config use the docker client; this run tests {sb.docker}")


def test_docker_config_key_selects_the_tier(docker_sandbox, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _docker_cli_only(docker_sandbox)
    import actloop.rewards.code as code
    from actloop.config import load_config
    from actloop.tasks.registry import _use_configured_sandbox

    monkeypatch.setattr(code, "_DEFAULT_SANDBOX", None)
    cfg = load_config(None, ["sandbox.backend=docker", f"sandbox.docker_image={docker_sandbox.image}"])
    _use_configured_sandbox(cfg)
    sb = code.default_sandbox()
    assert isinstance(sb, DockerSandbox) and sb.image == docker_sandbox.image
    assert sb.run("print(1)").tier == "docker"


# ------------------------------------------------------------------------------- CLI
runner = CliRunner()


def test_cli_run_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prog = tmp_path / "p.py"
    prog.write_text("import sys\nprint('hi', sys.stdin.read())\nsys.exit(4)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("there")
    res = runner.invoke(app, ["run", str(prog), "--json", "--timeout", "5", "--memory-mb", "256",
                              "--stdin", str(stdin)])
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["stdout"] == "hi there\n" and data["exit_code"] == 4 and data["tier"] == "bwrap"
    assert set(data) >= {"stdout", "stderr", "exit_code", "timed_out", "oom", "duration_s", "tier"}


def test_cli_run_plain_and_timeout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prog = tmp_path / "slow.py"
    prog.write_text("print('start', flush=True)\nimport time\ntime.sleep(10)\n")
    res = runner.invoke(app, ["run", str(prog), "--timeout", "0.5"])
    assert res.exit_code == 137
    assert "start" in res.stdout
    assert "timed_out" in res.output and "tier=bwrap" in res.output


def test_cli_require_isolation_refuses_rlimit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prog = tmp_path / "p.py"
    prog.write_text("print(1)\n")
    res = runner.invoke(app, ["run", str(prog), "--backend", "rlimit", "--require-isolation"])
    assert res.exit_code == 2 and "require_isolation" in res.output


def test_cli_doctor() -> None:
    res = runner.invoke(app, ["doctor", "--no-docker"])
    assert res.exit_code == 0, res.output
    assert "bwrap" in res.output and "rlimit" in res.output and "auto ->" in res.output


# ------------------------------------------------------------- hosts whose pid 1 does not reap
NON_REAPING_HOST = r"""
import ctypes, os, sys, warnings
sys.path.insert(0, {root!r})
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, and we never reap orphans
from actloop.sandbox import BwrapSandbox, RlimitSandbox, Limits
warnings.simplefilter("ignore")
sb = BwrapSandbox() if sys.argv[1] == "bwrap" else RlimitSandbox(warn=False)
code = ("import os\nif os.fork() == 0:\n    if os.fork() == 0:\n        os._exit(0)\n    os._exit(0)\n"
        "os.wait()\nimport subprocess\nprint(subprocess.run(['true']).returncode)")
bad = [r for r in (sb.run(code, limits=Limits(max_procs=6)) for _ in range(20)) if r.stdout != "0\n"]
zombies = 0
for e in os.scandir("/proc"):
    if e.name.isdigit():
        try:
            f = open(f"/proc/{{e.name}}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        zombies += f[0] == "Z" and int(f[1]) == os.getpid()
print(len(bad), zombies, bad[:1])
"""


@pytest.mark.parametrize("tier", ["bwrap", "rlimit"])
def test_no_zombies_left_for_a_non_reaping_host(tier, bwrap_sandbox) -> None:  # type: ignore[no-untyped-def]
    """A trainer started as a container's pid 1 never reaps orphans. A run must not leave
    one behind: each zombie would keep counting against the sandbox uid's RLIMIT_NPROC."""
    if tier == "rlimit" and os.geteuid() != 0:
        pytest.skip("rlimit tier sweeps leftovers only with a throw-away uid (root)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", NON_REAPING_HOST.format(root=root), tier],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    failed, zombies = r.stdout.split()[:2]
    assert (failed, zombies) == ("0", "0"), r.stdout


_CTRL_C_SCRIPT = """
import os, signal, threading, time, json
from actloop.sandbox import BwrapSandbox, Limits
signal.signal(signal.SIGINT, lambda *a: None)  # the trainer catches Ctrl-C and finishes its step
sb = BwrapSandbox(Limits(timeout_s=10))
out = {}
t = threading.Thread(target=lambda: out.update(r=sb.run(code="import time; time.sleep(1.5); print('done')")))
t.start()
time.sleep(0.7)
os.killpg(0, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole foreground process group
t.join()
print(json.dumps({"exit": out["r"].exit_code, "stdout": out["r"].stdout}))
"""


def test_ctrl_c_at_the_terminal_does_not_kill_the_steps_sandboxes(bwrap_sandbox) -> None:
    # run in its own session so that its killpg cannot reach pytest
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_SCRIPT], capture_output=True, text=True, timeout=60,
                          start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"exit": 0, "stdout": "done\n"}


# ----------------------------------------------------------------------- CLI, Docker tier
def test_cli_docker_backend_image_and_errors(docker_sandbox, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _docker_cli_only(docker_sandbox)
    prog = tmp_path / "p.py"
    prog.write_text("import os\nprint('uid', os.getuid())\n")
    res = runner.invoke(app, ["run", str(prog), "--backend", "docker", "--image", docker_sandbox.image, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["stdout"] == "uid 65534\n" and data["tier"] == "docker" and data["error"] is None
    res = runner.invoke(app, ["run", str(prog), "--backend", "docker", "--image", "actloop-no-such-image:0"])
    assert res.exit_code == 1 and "not present" in res.output and "build-image" in res.output
    res = runner.invoke(app, ["run", str(prog), "--image", "x:1"])
    assert res.exit_code == 1 and "--image is for --backend docker" in res.output


def test_cli_doctor_reports_the_docker_tier(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    _docker_cli_only(docker_sandbox)
    factory.probe_docker.cache_clear()
    res = runner.invoke(app, ["doctor", "--image", docker_sandbox.image])
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.output.splitlines() if "docker" in ln and "image" in ln)
    assert "yes" in row and "a test run as uid 65534 took" in res.output.replace("\n", " ").replace("│", "")
    res = runner.invoke(app, ["doctor", "--image", "actloop-no-such-image:0"])
    assert "build-image" in res.output


def test_cli_build_image_is_cached(docker_sandbox) -> None:  # type: ignore[no-untyped-def]
    _docker_cli_only(docker_sandbox)
    res = runner.invoke(app, ["build-image", "--image", docker_sandbox.image])
    assert res.exit_code == 0 and "already present (cached" in res.output, res.output


def test_doctor_says_why_bwrap_falls_back_for_an_unreachable_interpreter(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # as a non-root user the venv's base interpreter below /root (0700) is unreachable:
    # the doctor must say so, not "does not exist" (issue 16)
    down = TierStatus("bwrap", False, True, "interpreter /root/.pyenv/bin/python3.11 is not reachable by uid 60500: "
                                            "/root is drwx------ owned by uid 0")
    monkeypatch.setattr(factory, "probe_bwrap", lambda python=None: down)
    res = runner.invoke(app, ["doctor", "--no-docker"])
    text = " ".join(res.output.split())
    assert "auto -> rlimit" in text and "because bwrap does not work here" in text and "not reachable by uid" in text


def test_bwrap_unreachable_interpreter_is_named(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    import tempfile
    from pathlib import Path

    outer = Path(tempfile.mkdtemp(prefix="actloop-interp-"))  # pytest's own tmp root is 0700
    outer.chmod(0o755)
    locked = outer / "locked"
    (locked / "bin").mkdir(parents=True)
    py = locked / "bin" / "python3"
    py.symlink_to(sys.executable)
    locked.chmod(0o700)
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from actloop.sandbox import BwrapSandbox, SandboxError\n"
              "try:\n    sb = BwrapSandbox(python=sys.argv[2])\nexcept SandboxError as e:\n    print('ERR', e)\n"
              "sb = BwrapSandbox()\nprint('NOTE', sb.python_note or '-')\n")
    from _as_user import RUNNER_UID, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(why)
    python = _proc.find_reachable_python(sys.executable)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        r = subprocess.run(["setpriv", f"--reuid={RUNNER_UID}", f"--regid={RUNNER_UID}", "--clear-groups", "--",
                            python, "-S", "-c", script, root, str(py)], capture_output=True, text=True, timeout=60,
                           cwd="/")
    finally:
        shutil.rmtree(outer, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert f"is not reachable by uid {RUNNER_UID}: {locked} is drwx------ owned by uid 0" in r.stdout, r.stdout
    assert "NOTE -" in r.stdout  # its own default interpreter is reachable: no fallback needed
