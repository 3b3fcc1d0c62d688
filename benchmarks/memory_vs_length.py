"""Peak memory of one training forward + backward against sequence length (1k to 8k tokens).

It runs the actloop update path — `actloop.train.numerics.logprobs.token_logprobs` then a
sequence-mean policy-gradient loss and `backward()` — on one sequence of L tokens (a 64-token
prompt, then L - 64 sampled tokens that carry the loss), on the embedded model in fp32 master
weights with bf16 autocast, under four settings:

  plain          full [N, vocab] logits kept for the backward (train.logits_chunk=0), every
                 decoder layer's activations kept
  chunked        the lm_head + log-softmax in chunks of 1024 rows, recomputed in the backward
  checkpointing  per-layer gradient checkpointing (train.gradient_checkpointing=true)
  both           chunked + checkpointing

Each measurement runs in its own process. Peak = the process's resident-set high-water mark
(VmHWM, reset through /proc/self/clear_refs just before the forward) minus its RSS at that
moment (the loaded model and optimizer-free state): the memory the step itself adds. A setting
whose peak, extrapolated from its shorter lengths, would not fit in the machine's available
memory is skipped and its row says so (this box is shared).

    python benchmarks/memory_vs_length.py                    # 1024 2048 4096 8192, all settings
    python benchmarks/memory_vs_length.py --lengths 1024 2048 --settings plain both
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {  # name -> (logits_chunk, gradient_checkpointing)
    "plain": (0, False),
    "chunked": (1024, False),
    "checkpointing": (0, True),
    "both": (1024, True),
}
PROMPT = 64


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(a) -> None:
    import torch

    from actloop.models import load_models
    from actloop.train.numerics.logprobs import token_logprobs
    from actloop.train.runtime.memory import reset_rss_peak, rss_peak_mb

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    chunk, ckpt = SETTINGS[a.child]
    policy = load_models("smollm2-135m-instruct").policy
    policy.train()
    seq = torch.randint(0, policy.config.vocab_size, (a.length,)).tolist()
    mask = [0] * PROMPT + [1] * (a.length - PROMPT)
    base = rss_mb()
    if not reset_rss_peak():
        sys.exit("cannot reset the RSS high-water mark (/proc/self/clear_refs); Linux only")
    t0 = time.perf_counter()
    out = token_logprobs(policy, [seq], [mask], 1.0, a.precision, chunk=chunk, checkpointing=ckpt)
    loss = -(out.logp * out.mask).sum() / out.mask.sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    grad_mb = sum(p.grad.numel() * p.grad.element_size() for p in policy.parameters() if p.grad is not None) / 2**20
    print("RESULT " + json.dumps({"setting": a.child, "length": a.length, "peak_mb": rss_peak_mb() - base,
                                  "base_mb": base, "grad_mb": grad_mb, "seconds": seconds}), flush=True)


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def predict(points: list[tuple[int, float]], length: int) -> float:
    """Extrapolate peak MB to `length` from measured (length, MB): a power law through the last
    two points (exponent 1.5 until there are two: activations and chunked logits grow linearly,
    and the attention kernels here keep no L x L matrix)."""
    if not points:
        return 0.0
    first = (points[-1][0] / 2, points[-1][1] / 2**1.5)
    (l1, m1), (l2, m2) = points[-2] if len(points) > 1 else first, points[-1]
    exponent = max(math.log(max(m2, 1.0) / max(m1, 1.0)) / math.log(l2 / l1), 1.0)
    return m2 * (length / l2) ** exponent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-fraction", type=float, default=0.6,
                    help="skip a run predicted to need more than this share of MemAvailable")
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)

    results: dict[tuple[str, int], dict | str] = {}
    for setting in a.settings:
        points: list[tuple[int, float]] = []
        for L in sorted(a.lengths):
            need, have = predict(points, L), available_mb() * a.budget_fraction
            if need > have:
                results[(setting, L)] = f"skipped (~{need:.0f} MB predicted, {have:.0f} MB allowed)"
                print(f"  {setting:13s} {L:5d}: {results[(setting, L)]}", file=sys.stderr, flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", setting, "--length", str(L), "--precision", a.precision,
                   "--threads", str(a.threads)]
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                results[(setting, L)] = f"failed (exit {p.returncode})"
                print(f"  {setting} {L}: failed\n{p.stderr[-2000:]}", file=sys.stderr, flush=True)
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            results[(setting, L)] = r
            points.append((L, r["peak_mb"]))
            print(f"  {setting:13s} {L:5d}: +{r['peak_mb']:.0f} MB over {r['base_mb']:.0f} MB loaded, "
                  f"{r['seconds']:.1f} s", file=sys.stderr, flush=True)

    print(f"\nPeak memory added by one forward + backward ({a.precision} autocast, fp32 weights, batch 1, "
          f"{a.threads} threads), MB over the loaded model; growth = factor per doubling of length\n")
    print("| setting | " + " | ".join(f"{L} tokens" for L in sorted(a.lengths)) + " | growth per doubling | "
          + " | ".join(f"s @ {L}" for L in sorted(a.lengths)) + " |")
    print("|---" * (2 + 2 * len(a.lengths)) + "|")
    for setting in a.settings:
        mbs, secs, measured = [], [], []
        for L in sorted(a.lengths):
            r = results.get((setting, L))
            if isinstance(r, dict):
                mbs.append(f"{r['peak_mb']:.0f}")
                secs.append(f"{r['seconds']:.1f}")
                measured.append(r["peak_mb"])
            else:
                mbs.append(r or "-")
                secs.append("-")
        growth = [b / a_ for a_, b in zip(measured, measured[1:]) if a_ > 0]
        g = " / ".join(f"{x:.2f}x" for x in growth) or "-"
        print(f"| {setting} | {' | '.join(mbs)} | {g} | {' | '.join(secs)} |")


if __name__ == "__main__":
    main()
