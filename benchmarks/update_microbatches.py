"""The update's micro-batch budget: seconds and peak RSS of one update under each budget.

Runs `actloop train` with the default recipe (the demo's: calculator tool task, 4 prompts x 8
samples, gradient checkpointing) and, at every update from --from-step on, times the update of
that step's batch under each `train.max_tokens_per_microbatch` of --budgets, alternating (the
order flips every repeat), from the same weights and optimizer state (restored before each timed
update; the run then goes on with the weights of the last one). It counts what each budget's
micro-batches run: micro-batches, prompts run (`prefix_plan`: one per distinct prefix of a
micro-batch) and token positions (each prefix once + rows x the longest suffix, as
`hidden_at_targets` runs a full-attention model), and reads the RSS high-water mark of each
update (reset before it).

    python benchmarks/update_microbatches.py --steps 6 --budgets 4096 16384
    python benchmarks/update_microbatches.py --steps 4 -- train.gradient_checkpointing=false

Prints one line per timed update and each budget's median and range of seconds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--from-step", type=int, default=2, help="first step whose update is timed (1 = warm-up too)")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per budget and step")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096, 16384],
                    help="train.max_tokens_per_microbatch values to compare (0 = no budget)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), after --")
    a = ap.parse_args()

    import actloop.train.rl.loop as loop
    import actloop.train.trainer as trainer
    import actloop.train.rl.update as update
    from actloop.config import load_config
    from actloop.train.numerics.logprobs import prefix_plan
    from actloop.train.runtime.memory import reset_rss_peak, rss_peak_mb

    counts = {"micro": 0, "prompts": 0, "positions": 0}
    real_logprobs = update.token_logprobs

    def counting_logprobs(model, seqs, masks, *args, **kw):
        P_row, prefixes, _ = prefix_plan(seqs, masks)
        S = max(max(len(s) - P - 1 for s, P in zip(seqs, P_row)), 1)
        counts["micro"] += 1
        counts["prompts"] += len(prefixes)
        counts["positions"] += max((len(p) for p in prefixes), default=0) * len(prefixes) + len(seqs) * S
        return real_logprobs(model, seqs, masks, *args, **kw)

    update.token_logprobs = counting_logprobs
    real_update = loop.rl_update
    step = [0]
    results: dict[int, list[float]] = {b: [] for b in a.budgets}

    def timed_update(ctx, scored, group_size):
        step[0] += 1
        if step[0] < a.from_step:
            return real_update(ctx, scored, group_size)
        policy = ctx.models.policy
        weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        opt_state = copy.deepcopy(ctx.optimizer.state_dict())
        out = None
        keep = ctx.cfg.train.max_tokens_per_microbatch
        for rep in range(a.repeats):
            for budget in (a.budgets if rep % 2 == 0 else a.budgets[::-1]):
                with torch.no_grad():
                    policy.load_state_dict(weights)
                ctx.optimizer.load_state_dict(copy.deepcopy(opt_state))
                ctx.cfg.train.max_tokens_per_microbatch = budget
                for k in counts:
                    counts[k] = 0
                reset_rss_peak()
                t0 = time.perf_counter()
                out = real_update(ctx, scored, group_size)
                dt = time.perf_counter() - t0
                results[budget].append(dt)
                print(f"step {step[0]} budget {budget:6d} {dt:7.2f} s  trained {out['trained_trajectories']:2d}  "
                      f"micro-batches {counts['micro']}  prompts run {counts['prompts']:2d}  "
                      f"positions {counts['positions']:5d}  peak RSS {rss_peak_mb():.0f} MB", flush=True)
        ctx.cfg.train.max_tokens_per_microbatch = keep
        return out

    loop.rl_update = timed_update
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [f"train.steps={a.steps}", "train.eval_before=false", "train.eval_after=false",
                                 "train.eval_every=0", "train.save_final=false", "checkpoint.every=0",
                                 "checkpoint.at_end=false",
                                 f"output_dir={d}", "run_name=bench"] + a.overrides)
        trainer.train(cfg, progress=False, print_fn=lambda *_: None)
    for budget, ts in results.items():
        if ts:
            print(f"budget {budget:6d} median {statistics.median(ts):.2f} s  range {min(ts):.2f}-{max(ts):.2f}  "
                  f"sum {sum(ts):.1f} s  n={len(ts)}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
