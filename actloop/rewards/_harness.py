"""The two programs the code grader runs inside the sandbox. Kept as source strings: they are
shipped to the sandbox, never imported on the host.

PARENT (``python -I -S harness.py``) never runs candidate code. It
- marks itself non-dumpable first (``prctl(PR_SET_DUMPABLE, 0)``), so the candidate, which
  runs as the same uid, cannot read its memory, its environment or its file descriptors
  through ``/proc`` or ptrace;
- reads the whole job from stdin, nonce included, before any child starts (the nonce is on
  no command line, in no file and in no environment variable);
- hashes the protected files before the first test and after each one;
- runs each test in a fresh ``python -I -S -c CHILD`` process (isolated mode: no
  ``sitecustomize``, no ``.pth``, no script directory or ``PYTHON*`` variables on the path)
  with its own fresh working directory (an unpredictable name) and session, stdout and stderr thrown away, and a private
  pipe for the one result message; kills whatever the test left running;
- prints one ``<nonce> <json>`` line per test. The host reads only those lines.

CHILD runs the candidate's code (then the task's setup code), evaluates the test's probe
expressions — the parts of the assert that need the candidate, e.g. ``f([1, 2])`` — and writes
their values as type-tagged canonical JSON to its result pipe. It never sees an expected value:
the comparison happens on the host.

A *batch* (differential testing: many generated inputs in one process) gives each probe its
own time limit (a repeating ``ITIMER_REAL`` that raises ``_ProbeTimeout``, reported with kind
``timeout``) and all of them a budget; probes past the budget are reported as timed out
without running. The parent's wait for that child is the budget plus a grace.
"""

PARENT = r'''
import ctypes, hashlib, json, os, signal, subprocess, sys, tempfile, threading, time
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
except Exception:
    pass
job = json.loads(sys.stdin.buffer.read())
nonce = job.pop("nonce")
out = sys.stdout
root = os.getcwd()
MAX_MESSAGE = 4 << 20
HOOKS = ("conftest.py", "sitecustomize.py", "usercustomize.py")


def emit(rec):
    out.write(nonce + " " + json.dumps(rec) + "\n")
    out.flush()


def digest(paths):
    h = {}
    for p in paths:
        try:
            with open(os.path.join(root, p), "rb") as f:
                h[p] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            h[p] = None
    return h


def hooks():
    found = []
    for d, _, files in os.walk(root):
        found += [os.path.relpath(os.path.join(d, f), root) for f in files if f in HOOKS or f.endswith(".pth")]
        if len(found) > 20:
            break
    return found


# In a sandbox with its own pid namespace (bwrap, docker; the host says which) every process
# but pid 1 (the sandbox's init) and us belongs to the candidate. Elsewhere only the test's
# process group is ours to kill.
in_ns = bool(job.get("own_pid_namespace")) and os.getppid() == 1


def sweep(child):
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    if in_ns:
        me = os.getpid()
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in (1, me):
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass


before = digest(job["protected"])
emit({"ready": True, "hashes": before})
for i, probes in enumerate(job["tests"]):
    wd = tempfile.mkdtemp(prefix="test%d-" % i, dir=root)  # unpredictable: cannot be planted
    r, w = os.pipe()
    chunks, size = [], [0]

    def reader(r=r, chunks=chunks, size=size):
        while True:
            b = os.read(r, 65536)
            if not b:
                return
            size[0] += len(b)
            if size[0] <= MAX_MESSAGE:
                chunks.append(b)

    t0 = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", job["child"], str(w)], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=wd, pass_fds=(w,), start_new_session=True,
    )
    os.close(w)
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    payload = json.dumps({"code": job["code"], "setup": job["setup"], "probes": probes, "name": job["module_name"],
                          "batch": job["batch"][i]})
    try:
        child.stdin.write(payload.encode())
        child.stdin.close()
    except OSError:
        pass
    timed_out = False
    try:
        rc = child.wait(timeout=job["timeouts"][i])
    except subprocess.TimeoutExpired:
        timed_out = True
        sweep(child)
        rc = child.wait()
    sweep(child)
    th.join(1.0)
    lines = b"".join(chunks).split(b"\n")
    msgs = [ln for ln in lines if ln.strip()]
    rec = {"i": i, "rc": rc, "timeout": timed_out, "seconds": round(time.monotonic() - t0, 4),
           "messages": len(msgs), "oversize": size[0] > MAX_MESSAGE}
    if len(msgs) == 1 and not rec["oversize"]:
        try:
            rec["result"] = json.loads(msgs[0])
        except ValueError:
            rec["bad_message"] = True
    after = digest(job["protected"])
    rec["tampered"] = sorted(p for p in after if after[p] != before[p])
    rec["hooks"] = hooks()
    emit(rec)
emit({"done": True})
'''

CHILD = r'''
import sys, os, json, builtins, collections, decimal, fractions, signal, time
_fd = int(sys.argv[1])
_job = json.loads(sys.stdin.buffer.read())
del sys.argv[1:]
# Everything used after the candidate's code has run is bound now: the candidate may rebind
# builtins (`builtins.isinstance = ...`), which the module-level names below do not see.
_type, _write, _exit, _len, _eval, _compile = type, os.write, os._exit, len, eval, compile
_isinstance, _list, _any, _enumerate, _range, _mv = isinstance, list, any, enumerate, range, memoryview
_esc = json.encoder.encode_basestring_ascii
_mro = type.__dict__["__mro__"].__get__
_cdict = type.__dict__["__dict__"].__get__
_tname = type.__dict__["__qualname__"].__get__
_tmod = type.__dict__["__module__"].__get__
_irepr, _frepr, _sstr, _biter = int.__repr__, float.__repr__, str.__str__, bytes.hex
_titer, _liter, _ditems, _siter = tuple.__iter__, list.__iter__, dict.items, set.__iter__
_fsiter = frozenset.__iter__
_DICTS = (collections.OrderedDict, collections.Counter, collections.defaultdict)
_DEQUE, _FRAC, _DEC = collections.deque, fractions.Fraction, decimal.Decimal
_PLAIN = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
_SEMANTIC = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__len__", "__contains__")
_Exc, _StdExc = BaseException, Exception
_setitimer, _REAL, _clock = signal.setitimer, signal.ITIMER_REAL, time.monotonic


class _ProbeTimeout(BaseException):
    pass


_armed = [False]


def _alarm(signum, frame):
    if _armed[0]:
        raise _ProbeTimeout("time limit for this input")


try:
    sys.set_int_max_str_digits(0)
except AttributeError:
    pass


class _TooBig(Exception):
    pass


def _enc(v):
    """JSON for the tagged values (str, bool, None, int, list, dict with str keys) without the
    json module, whose encoder looks builtins up at call time."""
    t = _type(v)
    if t is str:
        return _esc(v)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if t is int:
        return _irepr(v)
    if t is list:
        return "[" + ",".join([_enc(x) for x in v]) + "]"
    return "{" + ",".join([_esc(k) + ":" + _enc(x) for k, x in _ditems(v)]) + "}"


def _report(obj):
    data = _enc(obj).encode() + b"\n"
    view = _mv(data)
    while view:
        view = view[_write(_fd, view):]
    _exit(0)


def _describe(e):
    try:
        name = _tname(_type(e))
    except _Exc:
        name = "?"
    try:
        msg = _Exc.__str__(e)[:300]
    except _Exc:
        msg = "<unprintable>"
    kind = "error"
    if _isinstance(e, _ProbeTimeout):
        kind = "timeout"
    elif _isinstance(e, (SystemExit, KeyboardInterrupt, GeneratorExit)):
        kind = "exit"
    else:
        try:
            if _any(["skip" in _tname(k).lower() for k in _mro(_type(e))]):
                kind = "skip"
            elif not _isinstance(e, _StdExc):  # past `except Exception`: an escape, not an error
                kind = "escape"
        except _Exc:
            pass
    return {"err": name + ": " + msg, "kind": kind}


def _base(t):
    """The builtin type `t` behaves as for ==, or None when `t` redefines comparison."""
    if t in _DICTS:
        return dict
    mro = _mro(t)
    for i, k in _enumerate(mro):
        if k in _PLAIN:
            for c in mro[:i]:
                d = _cdict(c)
                if _any([n in d for n in _SEMANTIC]):
                    return None
            return k
    return None


_count = [0]


def _ser(v, depth=0):
    _count[0] += 1
    if _count[0] > 200000 or depth > 100:
        raise _TooBig("value too large or too deeply nested to grade")
    if v is None:
        return ["none"]
    t = _type(v)
    if t is _FRAC:
        return ["fraction", _irepr(v.numerator), _irepr(v.denominator)]
    if t is _DEC:
        return ["decimal", _DEC.__str__(v)]
    if t is _range:
        return ["range", v.start, v.stop, v.step]
    if t is _DEQUE:
        return ["deque", [_ser(x, depth + 1) for x in _list(_DEQUE.__iter__(v))]]
    b = _base(t)
    if b is None:
        try:
            name = _tmod(t) + "." + _tname(t)
        except _Exc:
            name = "?"
        return ["opaque", name]
    if b is bool:
        return ["bool", v is True]
    if b is int:
        return ["int", _irepr(v)]
    if b is float:
        return ["float", _frepr(v)]
    if b is complex:
        return ["complex", _frepr(complex.real.__get__(v)), _frepr(complex.imag.__get__(v))]
    if b is str:
        return ["str", _sstr(v)]
    if b is bytes:
        return ["bytes", _biter(v)]
    if b is tuple:
        return ["tuple", [_ser(x, depth + 1) for x in _list(_titer(v))]]
    if b is list:
        return ["list", [_ser(x, depth + 1) for x in _list(_liter(v))]]
    if b is dict:
        return ["dict", [[_ser(k, depth + 1), _ser(x, depth + 1)] for k, x in _list(_ditems(v))]]
    if b is set:
        return ["set", [_ser(x, depth + 1) for x in _list(_siter(v))]]
    return ["frozenset", [_ser(x, depth + 1) for x in _list(_fsiter(v))]]


_ns = {"__name__": _job["name"], "__builtins__": builtins}
try:
    exec(compile(_job["code"], "solution.py", "exec"), _ns)
except _Exc as e:
    _report({"load_error": _describe(e)})
try:
    if _job["setup"]:
        exec(compile(_job["setup"], "setup.py", "exec"), _ns)
except _Exc as e:
    _report({"setup_error": _describe(e)})
_vals = []
_batch = _job["batch"]  # a batch of generated inputs: a time limit per probe and for them all
if _batch:
    signal.signal(signal.SIGALRM, _alarm)
    _t0 = _clock()
for _src in _job["probes"]:
    if _batch and _clock() - _t0 > _batch["budget"]:
        _vals.append({"err": "_ProbeTimeout: time budget for all inputs spent", "kind": "timeout"})
        continue
    try:
        try:
            if _batch:  # re-fires until it lands outside any `except:` of the candidate's
                _armed[0] = True
                _setitimer(_REAL, _batch["probe_timeout"], 0.05)
            _v = _eval(_compile(_src, "test.py", "eval"), _ns)
        finally:
            _armed[0] = False  # an alarm from here on is ignored
    except _Exc as e:
        _vals.append(_describe(e))
        continue
    if _batch:
        _setitimer(_REAL, 0)
    try:
        _count[0] = 0
        _vals.append({"ok": _ser(_v)})
    except _Exc as e:
        _vals.append(_describe(e))
_report({"values": _vals})
'''
