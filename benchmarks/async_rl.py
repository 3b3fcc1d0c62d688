"""Asynchronous RL: steps and samples per minute at rollout.max_staleness K = 0, 1, 2 on a tool task
whose tool answers in 1-2 s, as a remote API would.

    python benchmarks/async_rl.py [--ks 0,1,2] [--repeats 1] [--steps 8] [--turns 3] [--prompts 4]
                                  [--max-new-tokens 128] [--engine vllm] [key=value ...]

Each run is `actloop train` in a subprocess (a fresh engine: vLLM, the engine of in-flight updates, at every K;
`rollout.engine=auto` would take the HF engine for this step size at K = 0 on a CPU) on
`TASK` below: every assistant turn (one short sentence) "calls" a lookup tool that sleeps
uniform(1, 2) s, for `--turns` turns, then the episode ends (earlier when a reply runs into
max_new_tokens: `turns_per_episode` says how many turns were made); the reward (distinct words /
words of the last reply) differs within groups, so every step really updates. `--prompts` x 4
samples a step, `--max-new-tokens` a turn. Steps/min and samples/min come from the median
`step_s` of the steps between the first (whose time includes the engine's warm-up) and the last
(in which nothing more is sampled ahead): 60 / median; the mean (`steps_per_min_mean`) is printed too,
and `turns_per_min` (samples/min x turns an episode), the measure to compare when the runs' episodes
made different numbers of turns. K = 0 is the synchronous loop; K > 0 samples ahead. Runs
alternate K (0, 1, 2, 0, 1, 2, ... with --repeats) and every run's numbers are printed as a JSON
line, then the speed-up of each K over K = 0 (means over repeats; min-max in brackets).
Hold `flock /tmp/actloop-bench.lock` while it runs on a shared machine.

`--engine vllm-server` starts one `vllm serve` (vLLM's API server, as docs/engines.md starts it)
for all the runs, on the cores `--server-cpus` names (its OpenMP threads bound there), and each
run's trainer on `--trainer-cpus` with that many torch threads: the engine in a process of its
own, which decodes while the trainer updates. `--baseline-engine vllm` adds a K = 0 run on that
(colocated) engine first, the baseline of the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actloop import Task  # noqa: E402
from actloop.envs.base import StepResult  # noqa: E402
from actloop.types import Message  # noqa: E402

TURNS = int(os.environ.get("ASYNC_RL_TURNS", "3"))
TOPICS = ["lighthouses", "volcanoes", "honeybees", "glaciers", "comets", "coral reefs", "deserts", "owls",
          "tides", "bamboo", "thunderstorms", "penguins"]


class RemoteLookupEnv:
    """Every assistant turn calls a remote lookup that answers in uniform(1, 2) s; the episode ends
    after TURNS turns."""

    def __init__(self):
        self.n = 0

    def reset(self, row):
        return [Message("user", f"Tell me one fact about {row['topic']} in one short sentence. You will get "
                                "lookup results; add one new fact each time, in one short sentence.")], []

    def step(self, message):
        self.n += 1
        time.sleep(random.uniform(1.0, 2.0))  # the remote API's latency
        return StepResult([Message("tool", f"lookup result {self.n}: found. Add another fact in one short sentence.")], done=self.n >= TURNS)


def distinct_words(prompts, completions, **kwargs):
    """Distinct words / words of the last reply: varies within a group, so groups carry signal."""
    return [len(set(c.split())) / (len(c.split()) + 1) for c in completions]


def splits(train_size, eval_size, seed, split):
    rng = random.Random(f"{split}-{seed}")
    return [{"topic": rng.choice(TOPICS)} for _ in range(train_size)], [{"topic": t} for t in TOPICS[:eval_size]]


TASK = Task(name="remote_lookup", env=RemoteLookupEnv, rewards=[distinct_words], splits=splits,
            description="benchmark: a tool that answers in 1-2 s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cpus: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`vllm serve` of the default model on `cpus`, ready for path syncs (docs/engines.md)."""
    import urllib.request

    from actloop.config import Config
    from actloop.models import resolve_model
    from actloop.rollout.vllm_engine import WORKER_EXTENSION, vllm_dtype

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_USE_AOT_COMPILE": "0",
           "VLLM_CPU_OMP_THREADS_BIND": cpus}
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", resolve_model(Config().model), "--port", str(port), "--dtype", vllm_dtype(Config().train.precision),
           "--max-model-len", "4096", "--logprobs-mode", "processed_logprobs", "--worker-extension-cls",
           WORKER_EXTENSION]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return proc, url
        except OSError:
            time.sleep(2)


def run(k: int, args, out_dir: Path, engine: str) -> dict:
    name = f"k{k}-{int(time.time() * 1000) % 10**8}"
    server = []
    if engine == "vllm-server":
        server = [f"rollout.vllm_server_url={args.server_url}", f"rollout.vllm_weights_dir={out_dir / name / 'weights'}",
                  f"train.threads={len(args.trainer_cpus.split(','))}"]
    cmd = [*(["taskset", "-c", args.trainer_cpus] if server else []),
           sys.executable, "-m", "actloop", "train", f"data.task={Path(__file__).resolve()}:TASK",
           f"rollout.max_staleness={k}", f"rollout.engine={engine}", f"train.steps={args.steps}", *server,
           f"train.prompts_per_step={args.prompts}", "train.group_size=4", f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_turns={args.turns}",
           "rollout.temperature=1.0", "data.train_size=64", "data.eval_size=2", "train.eval_before=false",
           "train.eval_after=false", "train.save_final=false", "checkpoint.every=0", "checkpoint.at_end=false",
           f"output_dir={out_dir}", f"run_name={name}", "--no-progress", *args.extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ASYNC_RL_TURNS": str(args.turns)}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"K={k} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    # the first step's time includes the engine's warm-up; in the last, nothing more is sampled ahead
    steady = lines[1:-1]
    step_s = [r["step_s"] for r in steady]
    samples = sum(r["trained_trajectories"] for r in steady)
    # the median step: a step slowed by another process on a shared machine does not move it
    med = statistics.median(step_s)
    rec = {"K": k, "engine": engine, "steps_per_min": round(60 / med, 2), "samples_per_min": round(60 / med * samples / len(steady), 1),
           "steps_per_min_mean": round(60 * len(steady) / sum(step_s), 2),
           "step_s_min": min(step_s), "step_s_max": max(step_s), "wall_s": round(time.time() - t0, 1),
           "load_1min_after": round(os.getloadavg()[0], 2),
           "reward_mean_last": lines[-1]["reward_mean"],
           # turns an episode (TURNS unless a reply ran into max_new_tokens, which ends the episode)
           "turns_per_episode": round(statistics.mean(r["turns_per_episode"] for r in steady), 2),
           # the engine's log-probs against the trainer's (staleness and, with kv_after_update=keep, old KV)
           "mismatch_kl_k1_mean": round(statistics.mean(r["mismatch_kl_k1"] for r in steady), 5)}
    if k > 0:
        rec.update(staleness_mean=round(sum(r["staleness_mean"] for r in steady) / len(steady), 2),
                   staleness_max=max(r["staleness_max"] for r in steady),
                   stale_dropped_groups=sum(r["stale_dropped_groups"] for r in lines),
                   trainer_wait_s=round(sum(r["trainer_wait_s"] for r in steady), 1),
                   engine_wait_s=round(sum(r["engine_wait_s"] for r in steady), 1))
        hist: dict[int, int] = {}
        for line in (out_dir / name / "groups.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "trained":
                hist[e["staleness"]] = hist.get(e["staleness"], 0) + 1
        rec["staleness_histogram"] = dict(sorted(hist.items()))
    rec["update_s_mean"] = round(sum(r["update_s"] for r in steady) / len(steady), 2)
    # of which the engine decoded between micro-batches (rollout.decode_during_update, K > 0)
    rec["decode_in_update_s_mean"] = round(statistics.mean(r.get("decode_in_update_s", 0.0) for r in steady), 2)
    rec["rollout_s_mean"] = round(statistics.mean(r["rollout_s"] for r in steady), 2)
    # assistant turns (tool calls) a minute: what a step holds when episodes end early on a length cut
    rec["turns_per_min"] = round(rec["samples_per_min"] * rec["turns_per_episode"], 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="train.prompts_per_step (4 samples each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--engine", default="vllm", help="vllm (colocated) or vllm-server (started here)")
    ap.add_argument("--baseline-engine", default="", help="a K = 0 run on this engine first, the baseline")
    ap.add_argument("--server-cpus", default="1", help="vllm-server: the server's cores (taskset list)")
    ap.add_argument("--trainer-cpus", default="0", help="vllm-server: the trainer's cores (its torch threads)")
    ap.add_argument("extra", nargs="*", help="more `key=value` overrides for every run")
    args = ap.parse_args()
    runs = [(0, args.baseline_engine)] if args.baseline_engine else []
    runs += [(int(k), args.engine) for k in args.ks.split(",")]
    load = os.getloadavg()
    print(json.dumps({"load_before": [round(x, 2) for x in load]}), flush=True)
    results: dict[tuple[int, str], list[dict]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        proc = None
        if args.engine == "vllm-server":
            proc, args.server_url = start_server(args.server_cpus, Path(tmp) / "server.log")
        try:
            for _ in range(args.repeats):
                for k, engine in runs:
                    rec = run(k, args, Path(tmp), engine)
                    results[(k, engine)].append(rec)
                    print(json.dumps(rec), flush=True)
        finally:
            if proc is not None:
                os.killpg(proc.pid, 15)
                proc.wait(60)
    print(json.dumps({"load_after": [round(x, 2) for x in os.getloadavg()]}))
    first = results[runs[0]]
    base = sum(r["steps_per_min"] for r in first) / len(first)
    base_turns = sum(r["turns_per_min"] for r in first) / len(first)
    for (k, engine), recs in results.items():
        spm = [r["steps_per_min"] for r in recs]
        tpm = sum(r["turns_per_min"] for r in recs) / len(spm)
        print(f"K={k} ({engine}): {sum(spm) / len(spm):.2f} steps/min [{min(spm):.2f}-{max(spm):.2f}], "
              f"{sum(r['samples_per_min'] for r in recs) / len(spm):.1f} samples/min, {tpm:.1f} turns/min, "
              f"x{sum(spm) / len(spm) / base:.2f} over K={runs[0][0]} ({runs[0][1]}) in steps, "
              f"x{tpm / base_turns:.2f} in turns")


if __name__ == "__main__":
    main()
