"""GRPO seconds per step: actloop vs TRL's GRPOTrainer at identical settings, on one machine.

Both run the same single-turn task — GSM8K training questions (the chat `prompt` of each row),
scored by the same TRL-signature reward function `gsm8k_reward` below — on the same model (the
embedded SmolLM2-135M-Instruct, from `actloop.models.resolve_model`), with the same prompts per
step P, group size G, max new tokens, temperature (top-p 1, no top-k), learning rate (constant,
no warm-up, AdamW, no weight decay, grad-norm clip 1.0), KL beta, number of steps, precision
(bf16 autocast over fp32 master weights, or fp32), thread count, and loss: per-sequence mean of
the clipped token objective (TRL `loss_type="grpo"` = actloop `train.loss_agg=seq_mean`), group
std scaling, one update per batch (TRL `num_iterations=1`, actloop `train.epochs=1`). One step =
P x G completions for both (TRL: per_device_train_batch_size = P*G, gradient_accumulation 1,
no vLLM). With `--mode lora` both train the same peft adapter (actloop's `lora.*` defaults:
r 16, alpha 32, dropout 0, all attention and MLP projections).

Each (framework, mode, repeat) runs in its own child process, so neither warms the other's
caches and each reports its own peak RSS; TRL and actloop alternate back to back (the order
flips every repeat), because this box is shared and its load drifts. A step is the interval
between two step ends — TRL's `on_step_end` callback, actloop's metrics line landing — so the
first (warm-up) step is excluded for both; each is reported as wall seconds and as process CPU
seconds (steadier under a neighbour's load; with 1 thread, the wall time on an idle core).

The KL term is on by default (beta 0.04, k3 in the loss for both, as users train: the KL
constraint is the usual guard against reward collapse); `--beta 0` times the KL-free step.

    python benchmarks/grpo_vs_trl.py                       # full FT and LoRA, 2 x 4, 64 tokens, beta 0.04
    python benchmarks/grpo_vs_trl.py --mode full --repeats 2 --steps 4 --threads 2
    python benchmarks/grpo_vs_trl.py --only actloop --precision fp32    # default auto: bf16 where native

TRL's fastest documented setting, `use_vllm=True, vllm_mode="colocate"`, cannot run on vLLM's
x86 CPU build (0.31.0, inside TRL 1.16's supported range, and 0.32.0): TRL syncs weights by
calling the model's `load_weights` per parameter, and the CPU build has by then moved each linear
layer's weights into a packed oneDNN copy, leaving a `weight` without a `weight_loader`
(`AttributeError: 'Parameter' object has no attribute 'weight_loader'` at the first sync; the same
with `vllm_model_impl="transformers"`). It runs only with TRL's sync patched to vLLM's layerwise
`reload_weights`, which is no longer TRL as shipped, so this benchmark does not offer it; on a GPU,
compare against it there. docs/performance.md has the details.

Needs the `bench` extra (trl, datasets) for the TRL side, in this interpreter or in the one
`--trl-python` (or ACTLOOP_TRL_PYTHON) names: a separate environment for TRL alone, e.g. a venv
whose .pth file adds this one's site-packages (the same torch and transformers for both).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = Path(os.environ.get("ACTLOOP_DATA_DIR", ROOT.parent / "shared" / "data")) / "gsm8k" / "train.jsonl"
INSTRUCTION = "Solve the problem. End your reply with '#### <number>'."


def _text(completion) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]; actloop a string."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def gsm8k_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the completion equals the row's answer, plus 0.05 per number
    written (at most 0.5: "shows its working"). The dense part keeps groups from having all-equal
    rewards, which would let either framework skip work (actloop skips zero-advantage rows)."""
    out = []
    for c, a in zip(completions, answer):
        nums = re.findall(r"-?\d[\d,]*\.?\d*", _text(c))
        correct = bool(nums) and nums[-1].replace(",", "").rstrip(".") == a
        out.append(float(correct) + min(0.05 * len(nums), 0.5))
    return out


def write_rows(path: Path, n: int) -> Path:
    rows = []
    with open(DATA) as f:
        for line in f:
            r = json.loads(line)
            rows.append({"prompt": [{"role": "user", "content": f"{r['question']}\n{INSTRUCTION}"}],
                         "answer": r["answer"].split("####")[-1].strip().replace(",", "")})
            if len(rows) >= n:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------- children

def now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared box the CPU time is the steadier
    measure of the work a step does; with 1 thread it is the time the step would take alone."""
    return time.perf_counter(), time.process_time()


class StepClock(threading.Thread):
    """Stamps `now()` each time a line is appended to a metrics file (polled every 20 ms, and once more at
    `stop()`: a last step whose line landed in the final 20 ms was dropped before, so some runs timed
    two steps instead of three)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.ends, self.done = path, [], threading.Event()

    def run(self):
        size, lines = -1, 0
        while True:
            stopping = self.done.wait(0.02)  # one last look after stop(): the last line may land just before it
            try:
                st = self.path.stat().st_size
            except FileNotFoundError:
                st = size
            if st != size:
                size, n = st, self.path.read_text().count("\n")
                self.ends += [now()] * (n - lines)
                lines = n
            if stopping:
                return

    def stop(self):
        self.done.set()
        self.join()


def run_actloop(a, rows: Path, out_dir: Path) -> list[float]:
    from actloop.config import load_config
    from actloop.train.trainer import train

    overrides = [
        "model=smollm2-135m-instruct", f"data.path={rows}", f"reward.funcs=[{Path(__file__).resolve()}:gsm8k_reward]",
        "rollout.max_turns=1", f"rollout.max_new_tokens={a.max_new_tokens}", f"rollout.temperature={a.temperature}",
        "rollout.top_p=1.0", f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}",
        f"train.group_size={a.group}", f"train.lr={a.lr}", f"train.beta={a.beta}", "train.loss_agg=seq_mean",
        "train.adv_scale=group", "train.epochs=1", "train.minibatch_size=0", "train.weight_decay=0.0",
        "train.max_grad_norm=1.0", "train.warmup_steps=0", "train.optimizer=adamw",  # fp32 moments, as TRL's
        f"train.precision={a.precision}",
        f"train.threads={a.threads}", "train.eval_before=false", "train.eval_after=false", "train.save_final=false",
        f"lora.enabled={str(a.mode == 'lora').lower()}", f"seed={a.seed}", f"output_dir={out_dir}", "run_name=actloop",
        f"train.gradient_checkpointing={str(bool(a.gradient_checkpointing)).lower()}",  # both frameworks alike
    ] + list(a.actloop_override)
    cfg = load_config(None, overrides)
    clock = StepClock(out_dir / "actloop" / "metrics.jsonl")  # a step ends when its metrics line lands
    clock.start()
    try:
        res = train(cfg, progress=False, print_fn=lambda *_: None)
    finally:
        clock.stop()
    with open(res.run_dir / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    keys = ("rollout_s", "update_s", "ref_s", "old_logp_s", "peak_mem_mb", "trained_trajectories", "response_tokens")
    print("PARTS " + json.dumps([{k: r.get(k) for k in keys} for r in recs]), file=sys.stderr, flush=True)
    # actloop resets the RSS high-water mark after every update (its per-step peak_mem_mb), so the
    # process peak is the largest step window, not the VmHWM left at the end
    print("TOKENS " + json.dumps([r["response_tokens"] for r in recs]), flush=True)
    return clock.ends, max(r["peak_mem_mb"] for r in recs)


def run_trl(a, rows: Path, out_dir: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from actloop.config import LoraConfig as ActloopLora
    from actloop.models import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    data = Dataset.from_list([json.loads(line) for line in rows.read_text().splitlines()])
    peft_config = None
    if a.mode == "lora":
        from peft import LoraConfig

        d = ActloopLora()
        peft_config = LoraConfig(r=d.r, lora_alpha=d.alpha, lora_dropout=d.dropout,
                                 target_modules=list(d.target_modules), task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group,
        gradient_accumulation_steps=1, num_generations=a.group, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=a.beta, num_iterations=1, loss_type="grpo",
        scale_rewards="group", epsilon=0.2, use_vllm=False, bf16=a.precision == "bf16", use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=1, seed=a.seed, disable_dropout=True,
        log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=a.gradient_checkpointing,  # both frameworks default to on: set alike
    )
    ends: list[tuple[float, float]] = []
    tokens: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(now())

        def on_step_end(self, *_, **__):
            ends.append(now())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                tokens.append(float(logs["completions/mean_length"]) * a.prompts * a.group)

    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=args, train_dataset=data,
                          processing_class=tok, peft_config=peft_config, callbacks=[Clock()])
    trainer.train()
    from actloop.train.runtime.memory import rss_peak_mb

    print("TOKENS " + json.dumps(tokens), flush=True)
    return ends[1:], rss_peak_mb()  # step ends only, as for actloop; TRL never resets VmHWM


def child(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        rows = write_rows(Path(tmp) / "rows.jsonl", max(64, a.prompts * a.steps * 2))
        fn = run_trl if a.child == "trl" else run_actloop
        ends, peak = fn(a, rows, Path(tmp) / "out")  # the end of each step: intervals are steps 2..n
    wall = [b[0] - a_[0] for a_, b in zip(ends, ends[1:])]
    cpu = [b[1] - a_[1] for a_, b in zip(ends, ends[1:])]
    print("RESULT " + json.dumps({"framework": a.child, "mode": a.mode, "step_s": wall, "cpu_s": cpu,
                                  "peak_rss_mb": peak}), flush=True)


# ------------------------------------------------------------------------------------------ parent

def launch(a, framework: str, mode: str) -> dict:
    python = a.trl_python if framework == "trl" else sys.executable
    cmd = [python, __file__, "--child", framework, "--mode", mode] + [
        x for k in ("steps", "prompts", "group", "max_new_tokens", "precision", "threads", "lr", "beta",
                    "temperature", "seed") for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
    if a.gradient_checkpointing or (framework == "trl" and a.trl_gradient_checkpointing):
        cmd.append("--gradient-checkpointing")
    for o in a.actloop_override:
        cmd += ["--actloop-override", o]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for ln in p.stderr.splitlines():
        if ln.startswith("PARTS ") and a.verbose:
            print(f"  {framework} {mode} per step: {ln[6:]}", file=sys.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.exit(f"{framework}/{mode} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    toks = [json.loads(ln[len("TOKENS "):]) for ln in p.stdout.splitlines() if ln.startswith("TOKENS ")]
    r["tokens"] = (toks[-1] if toks else [])[1:]  # generated tokens of steps 2..n, the timed ones
    r["s_per_step"], r["cpu_per_step"] = statistics.mean(r["step_s"]), statistics.mean(r["cpu_s"])
    r["tokens_per_step"] = statistics.mean(r["tokens"]) if r["tokens"] else float("nan")
    print(f"  {framework:7s} {mode:4s} {r['s_per_step']:6.2f} s/step wall, {r['cpu_per_step']:6.2f} CPU  "
          f"{r['tokens_per_step']:.0f} tokens  steps {[round(x, 1) for x in r['step_s']]}  peak RSS {r['peak_rss_mb']:.0f} MB  "
          f"({time.time() - t0:.0f} s wall)", file=sys.stderr, flush=True)
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where this machine computes it natively, else fp32 (actloop's train.precision=auto), "
                         "resolved here so that both get the same")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for both")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient for both (TRL's k3 in the loss)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="on for both (TRL's own default is on)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="on for TRL only (TRL's default; actloop's default is on too, this flag leaves actloop off)")
    ap.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    ap.add_argument("--only", choices=["actloop", "trl"], default=None)
    ap.add_argument("--trl-python", default=os.environ.get("ACTLOOP_TRL_PYTHON", sys.executable),
                    help="the interpreter of the TRL runs (an environment with trl; default this one)")
    ap.add_argument("--repeats", type=int, default=1, help="back-to-back repeats of each pair")
    ap.add_argument("--actloop-override", action="append", default=[], help="extra actloop key=value (ablations)")
    ap.add_argument("--verbose", action="store_true", help="print actloop's per-step rollout/update split")
    ap.add_argument("--child", choices=["actloop", "trl"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.precision == "auto":  # an AVX2-only CPU emulates bf16 (several times slower than fp32 there)
        from actloop.rollout.engine import use_bf16

        a.precision = "bf16" if use_bf16("auto") else "fp32"
    if a.child:
        return child(a)

    frameworks = [a.only] if a.only else ["trl", "actloop"]
    modes = ["full", "lora"] if a.mode == "both" else [a.mode]
    results: dict[tuple[str, str], list[dict]] = {}
    for mode in modes:
        for rep in range(a.repeats):
            for fw in (frameworks if rep % 2 == 0 else frameworks[::-1]):
                results.setdefault((fw, mode), []).append(launch(a, fw, mode))

    print(f"\nGRPO, {a.prompts} prompts x {a.group} samples, {a.max_new_tokens} new tokens, {a.precision}, "
          f"{a.threads} thread(s), beta {a.beta}, {a.steps} steps (the first excluded), median of {a.repeats} "
          "run(s); wall = seconds per step, CPU = process CPU seconds per step, tokens = generated tokens per step\n")
    cols = " | ".join(f"{fw} wall | {fw} CPU | {fw} tokens | {fw} peak RSS MB" for fw in frameworks)
    two = len(frameworks) == 2
    print(f"| mode | {cols} |" + (" speed-up wall (TRL / actloop) | speed-up CPU | speed-up CPU per token |"
                                 if two else ""))
    print("|---" * (1 + 4 * len(frameworks) + 3 * two) + "|")
    for mode in modes:
        cells, w, c, k = [], {}, {}, {}
        for fw in frameworks:
            rs = results[(fw, mode)]
            w[fw] = statistics.median(r["s_per_step"] for r in rs)
            c[fw] = statistics.median(r["cpu_per_step"] for r in rs)
            k[fw] = statistics.median(r["tokens_per_step"] for r in rs)
            cells.append(f"{w[fw]:.2f} | {c[fw]:.2f} | {k[fw]:.0f} | "
                         f"{statistics.median(r['peak_rss_mb'] for r in rs):.0f}")
        ratio = (f" {w['trl'] / w['actloop']:.2f}x | {c['trl'] / c['actloop']:.2f}x | "
                 f"{(c['trl'] / k['trl']) / (c['actloop'] / k['actloop']):.2f}x |") if two else ""
        print(f"| {'full fine-tuning' if mode == 'full' else 'LoRA'} | {' | '.join(cells)} |{ratio}")


if __name__ == "__main__":
    main()
