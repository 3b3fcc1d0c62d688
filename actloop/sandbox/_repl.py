"""The REPL server that `PythonSession` runs *inside* the sandbox (stdlib only).

Protocol, one JSON object per line: the host writes ``{"code": str, "max_output_bytes":
int}`` to stdin; the server answers ``{"output": str, "error": bool, "truncated": bool}``
on the original stdout, after a first ``{"ready": true}``.

The cell's own stdout/stderr (fds 1 and 2, so subprocesses and C extensions are captured
too, in order) go to a memfd that is emptied before each cell; stdin is /dev/null so
`input()` cannot eat the protocol. Like a notebook, the value of a final expression is
printed. Variables live in one `__main__` module for the whole session.
"""

import ast
import json
import linecache
import os
import sys
import traceback
import types


def _send(out, msg):
    out.write(json.dumps(msg, ensure_ascii=False).encode() + b"\n")


def _flush():
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            s.flush()
        except Exception:
            pass


def _read_capped(fd, limit):
    size = os.fstat(fd).st_size
    if size <= limit:
        return os.pread(fd, size, 0).decode("utf-8", "replace"), False
    tail_n = limit // 2
    head = os.pread(fd, limit - tail_n, 0).decode("utf-8", "replace")
    tail = os.pread(fd, tail_n, size - tail_n).decode("utf-8", "replace")
    dropped = size - limit
    return f"{head}\n[actloop: output truncated, {dropped} bytes omitted]\n{tail}", True


def _run_cell(code, ns, n):
    fname = f"<cell {n}>"
    linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
    try:
        tree = ast.parse(code, fname, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, fname, "exec"), ns)
        if last is not None:
            value = eval(compile(last, fname, "eval"), ns)
            if value is not None:
                ns["_"] = value
                print(repr(value))
        return False
    except SystemExit as e:
        if e.code in (None, 0):
            return False
        print(f"SystemExit: {e.code}", file=sys.stderr)
        return True
    except BaseException as e:  # noqa: BLE001 - report everything to the model
        tb = e.__traceback__
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
            tb = tb.tb_next  # hide the server's own frames
        traceback.print_exception(type(e), e, tb)
        return True


def main():
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    nul = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    cap = os.memfd_create("actloop-cell")
    os.dup2(cap, 1)
    os.dup2(cap, 2)
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    ns = module.__dict__
    sys.argv[:] = [""]
    sys.path[0] = os.getcwd()
    _send(out, {"ready": True})
    n = 0
    for line in inp:
        req = json.loads(line)
        n += 1
        os.ftruncate(cap, 0)
        os.lseek(cap, 0, os.SEEK_SET)
        error = _run_cell(req["code"], ns, n)
        _flush()
        text, truncated = _read_capped(cap, int(req["max_output_bytes"]))
        _send(out, {"output": text, "error": error, "truncated": truncated})


if __name__ == "__main__":
    main()
