"""Sandbox throughput: executions per second, sandboxed vs a naive subprocess.

Workloads:
  trivial  ``print(1)``
  mbpp     an MBPP-sized test run: one function and three asserts

Modes (all run the same code string, written to a file, with the same interpreter):
  naive      ``subprocess.run([python, file])`` — the baseline the issue names
  naive -S   the same with ``-S`` (no ``site``): isolates the cost of isolation itself,
             because the sandbox runs Python with ``-S``
  bwrap      `BwrapSandbox.run` (namespaces, tmpfs, rlimits, watchdog, capped capture)
  rlimit     `RlimitSandbox.run` (the fallback tier)
  docker     `DockerSandbox.run` (a container per run; with ``--docker``, fewer runs per cell
             since each costs ~0.5 s: ``--docker-runs``)

Concurrency N = N threads issuing runs. Modes are interleaved round by round so that a
neighbour's load (this box is shared) hits all of them alike; the table reports the
median of the rounds. Usage::

    python benchmarks/sandbox_throughput.py [--runs 40] [--rounds 3] [--conc 1 2 4] [--docker [IMAGE]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from actloop.sandbox import BwrapSandbox, DockerSandbox, Limits, RlimitSandbox  # noqa: E402
from actloop.sandbox.docker import DEFAULT_IMAGE  # noqa: E402
from actloop.sandbox.bwrap import default_python  # noqa: E402

WORKLOADS = {
    "trivial": "print(1)\n",
    "mbpp": (
        "def remove_Occ(s, ch):\n"
        "    for i in range(len(s)):\n"
        "        if s[i] == ch:\n"
        "            s = s[0:i] + s[i + 1:]\n"
        "            break\n"
        "    for i in range(len(s) - 1, -1, -1):\n"
        "        if s[i] == ch:\n"
        "            s = s[0:i] + s[i + 1:]\n"
        "            break\n"
        "    return s\n"
        "\n"
        "assert remove_Occ('hello', 'l') == 'heo'\n"
        "assert remove_Occ('abcda', 'a') == 'bcd'\n"
        "assert remove_Occ('PHP', 'P') == 'H'\n"
    ),
}


def naive(python: str, flags: list[str]) -> Callable[[str], bool]:
    def run(code: str) -> bool:
        with tempfile.TemporaryDirectory(prefix="naive-") as d:
            path = os.path.join(d, "main.py")
            with open(path, "w") as f:
                f.write(code)
            r = subprocess.run([python, *flags, path], capture_output=True, timeout=10, cwd=d)
        return r.returncode == 0

    return run


def sandboxed(sb: BwrapSandbox | RlimitSandbox | DockerSandbox) -> Callable[[str], bool]:
    def run(code: str) -> bool:
        return sb.run(code).exit_code == 0

    return run


def throughput(fn: Callable[[str], bool], code: str, conc: int, runs: int) -> float:
    fn(code)  # warm up (page cache, lazily created user namespaces)
    with ThreadPoolExecutor(conc) as ex:
        t0 = time.perf_counter()
        ok = list(ex.map(lambda _: fn(code), range(runs)))
        dt = time.perf_counter() - t0
    if not all(ok):
        raise RuntimeError(f"{sum(not o for o in ok)} runs failed")
    return runs / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--no-rlimit", action="store_true", help="skip the fallback tier")
    ap.add_argument("--docker", nargs="?", const=DEFAULT_IMAGE, default=None, metavar="IMAGE",
                    help=f"also the Docker tier, with this image (default {DEFAULT_IMAGE})")
    ap.add_argument("--docker-runs", type=int, default=12, help="runs per cell and round for docker")
    args = ap.parse_args()

    python = default_python()
    limits = Limits(timeout_s=10)
    modes: dict[str, Callable[[str], bool]] = {
        "naive": naive(python, []),
        "naive -S": naive(python, ["-S"]),
        "bwrap": sandboxed(BwrapSandbox(limits)),
    }
    if not args.no_rlimit:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            modes["rlimit"] = sandboxed(RlimitSandbox(limits, warn=False))
    if args.docker:
        modes["docker"] = sandboxed(DockerSandbox(limits, image=args.docker))

    results: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for wl, code in WORKLOADS.items():
            for conc in args.conc:
                for mode, fn in modes.items():
                    n = args.docker_runs if mode == "docker" else args.runs
                    results.setdefault((wl, conc, mode), []).append(throughput(fn, code, conc, n))

    load = os.getloadavg()
    print(f"python: {python}; cpus: {os.cpu_count()}; load average at end: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} rounds x {args.runs} runs per cell "
          "(median of rounds)\n")
    names = list(modes)
    head = ["workload", "conc", *[f"{m} exec/s" for m in names], "bwrap vs naive", "bwrap vs naive -S"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for wl in WORKLOADS:
        for conc in args.conc:
            med = {m: statistics.median(results[(wl, conc, m)]) for m in names}
            cost = lambda base: f"{(med[base] / med['bwrap'] - 1) * 100:+.0f}%"  # noqa: E731
            row = [wl, str(conc), *[f"{med[m]:.1f}" for m in names], cost("naive"), cost("naive -S")]
            print("| " + " | ".join(row) + " |")
    print("\n'bwrap vs X' = extra wall time per run of bwrap relative to X (negative: bwrap is faster).")


if __name__ == "__main__":
    main()
