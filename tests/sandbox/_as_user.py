"""Run one sandboxed program as an unprivileged user: the host side of the sandbox (the
part a trainer runs) started by a non-root uid, as most users run it.

The tests are root here, so `AsUser` starts this file through ``setpriv`` as an unused uid
with an interpreter that uid can read (the venv's lives below /root, mode 0700), sends the
request as JSON on stdin and reads the `ExecResult` back as JSON on stdout.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

RUNNER_UID = 60500  # unused: not the rlimit tier's 61000+, bwrap's 62000+ or Docker's 65534
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unavailable_reason() -> str | None:
    """Why the unprivileged variants cannot run here, or None."""
    sys.path.insert(0, ROOT)
    from actloop.sandbox import _proc

    if os.geteuid() != 0:
        return "the tests already run as a non-root user: the plain variants are the unprivileged path"
    if not shutil.which("setpriv"):
        return "util-linux setpriv is missing"
    if not _proc.others_can_reach(os.path.join(ROOT, "actloop", "sandbox", "base.py")):
        return f"the checkout {ROOT} is not readable by other users"
    if _proc.find_reachable_python(sys.executable) is None:
        return (f"no Python interpreter an unprivileged user can read ({os.path.realpath(sys.executable)} "
                "is below a 0700 directory and no system python3 exists)")
    return None


class AsUser:
    """A `Sandbox` whose every run happens in a host process of uid `RUNNER_UID`."""

    isolated = True

    def __init__(self, tier: str, limits) -> None:  # type: ignore[no-untyped-def]
        from actloop.sandbox import _proc

        self.tier, self.limits = tier, limits
        self.isolated = tier == "bwrap"
        python = _proc.find_reachable_python(sys.executable)
        assert python is not None
        self._cmd = [shutil.which("setpriv") or "setpriv", f"--reuid={RUNNER_UID}", f"--regid={RUNNER_UID}",
                     "--clear-groups", "--", python, "-S", os.path.abspath(__file__), tier]

    def run(self, code: str | None = None, *, argv: Sequence[str] | None = None,
            files: Mapping[str, str | bytes] | None = None, stdin: str | bytes | None = None, limits=None):  # type: ignore[no-untyped-def]
        from actloop.sandbox import ExecResult

        def b64(x: str | bytes) -> str:
            return base64.b64encode(x.encode() if isinstance(x, str) else x).decode()

        lim = limits or self.limits
        req = {"code": code, "argv": list(argv) if argv else None, "stdin": None if stdin is None else b64(stdin),
               "files": {k: b64(v) for k, v in (files or {}).items()},
               "limits": {k: getattr(lim, k) for k in lim.__dataclass_fields__}}
        # the host process keeps the caller's environment (secrets included), as a trainer would
        env = {**os.environ, "HOME": "/nonexistent", "TMPDIR": "/tmp"}
        t0 = time.monotonic()
        r = subprocess.run(self._cmd, input=json.dumps(req).encode(), capture_output=True, env=env, cwd="/",
                           timeout=lim.timeout_s + 60)
        if r.returncode != 0:
            return ExecResult("", r.stderr.decode(errors="replace"), r.returncode, False, False,
                              time.monotonic() - t0, self.tier, error=f"runner as uid {RUNNER_UID} died")
        return ExecResult(**json.loads(r.stdout))


def _main() -> None:
    sys.path.insert(0, ROOT)
    import warnings

    from actloop.sandbox import BwrapSandbox, Limits, RlimitSandbox

    req = json.load(sys.stdin)
    limits = Limits(**req["limits"])
    if sys.argv[1] == "bwrap":
        sb = BwrapSandbox(limits)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            sb = RlimitSandbox(limits, warn=False)
    assert os.geteuid() != 0
    dec = base64.b64decode
    res = sb.run(req["code"], argv=req["argv"], files={k: dec(v) for k, v in req["files"].items()},
                 stdin=None if req["stdin"] is None else dec(req["stdin"]))
    sys.stdout.write(res.to_json())


if __name__ == "__main__":
    _main()
