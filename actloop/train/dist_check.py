"""Does N-process training equal one-process training? A self-check on a fixed batch.

    python -m actloop.train.dist_check --out one.pt                                   # 1 process
    torchrun --nproc_per_node 2 -m actloop.train.dist_check --out two.pt              # 2 processes
    python -m actloop.train.dist_check --compare one.pt two.pt                        # max differences

The batch is built from the tokenizer, not sampled: `prompts` prompts x `group_size` completions
of different lengths with fixed rewards (groups in `--flat` have none to learn from; group g's
sequences are all shorter than group g+1's, so with micro_batch_size = group_size the one-process
micro-batches hold the same trajectories as the ranks' micro-batches). `rl_update` runs
`steps` times on it; rank 0 writes the full weights and each step's update metrics.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from actloop.config import load_config
from actloop.models import load_models
from actloop.train.distributed import init_distributed
from actloop.train.update import UpdateContext, rl_update
from actloop.types import Message, Scored, Trajectory, Turn

WORDS = "the cat sat on a warm mat and then it slept for most of the long quiet day".split()


def fixed_batch(tokenizer, prompts: int, group_size: int, flat: tuple[int, ...] = ()) -> list[Scored]:
    """prompts x group_size scored trajectories; rewards 0, 1, 0.5, 0.25, ... within each group,
    except the groups in `flat`, whose rewards are all equal (zero advantage: nothing to train)."""
    out = []
    for g in range(prompts):
        question = " ".join(WORDS[: 1 + 4 * g])  # later groups: longer prompts, longer sequences
        prompt_ids = tuple(tokenizer(question, add_special_tokens=False)["input_ids"])  # short: no chat template
        for k in range(group_size):
            ids = tuple(tokenizer(" ".join(WORDS[g : g + 2 + k]), add_special_tokens=False)["input_ids"])
            turn = Turn(Message("assistant", ""), ids, (0.0,) * len(ids), "stop")
            reward = 1.0 if g in flat else [0.0, 1.0, 0.5, 0.25, 0.75, 0.1, 0.9, 0.3][k % 8]
            out.append(Scored(Trajectory((Message("user", question),), prompt_ids, (turn,)), reward=reward,
                              components={}))
    return out


def run(overrides: list[str], steps: int, prompts: int, group_size: int, optimizer: str,
        flat: tuple[int, ...] = ()) -> dict[str, Any] | None:
    cfg = load_config(None, ["train.precision=fp32", "train.threads=1", f"train.prompts_per_step={prompts}",
                             f"train.group_size={group_size}", *overrides])
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    dist = init_distributed(cfg)
    models = load_models(cfg.model, lora=cfg.lora, need_reference=False)
    scored = fixed_batch(models.tokenizer, prompts, group_size, flat)
    groups = [scored[i : i + group_size] for i in range(0, len(scored), group_size)]
    mine = [s for grp in dist.shard(groups) for s in grp]
    if dist.active and cfg.distributed.fsdp:
        dist.wrap(models.policy, cfg.distributed.reshard_after_forward, cfg.distributed.mixed_precision)
    params = [p for p in models.policy.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=cfg.train.lr))
    ctx = UpdateContext(cfg, models, opt, None, cfg.train.beta, "none", dist=dist if dist.active else None)
    start = {k: v.detach().cpu().clone() for k, v in dist.full_state_dict(models.policy).items()}
    metrics = [rl_update(ctx, mine, group_size) for _ in range(steps)]
    change = {k: v.detach().cpu() - start[k] for k, v in dist.full_state_dict(models.policy).items()}
    dist.close()
    if not dist.is_main:
        return None
    return {"world": dist.world, "change": change, "metrics": metrics}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """How far apart two runs' weight changes are: max |difference|, that over the largest change
    (all weights), the largest such ratio of one tensor, the mean |difference|; and the max
    relative difference of the numeric update metrics."""
    diffs = {k: (a["change"][k] - b["change"][k]).abs() for k in a["change"]}
    moved = {k: float(a["change"][k].abs().max()) for k in a["change"]}
    out = {"max_abs_weight_diff": max(float(d.max()) for d in diffs.values()),
           "max_weight_change": max(moved.values()),
           "worst_tensor_rel_diff": max(float(d.max()) / max(moved[k], 1e-12) for k, d in diffs.items()),
           "mean_abs_weight_diff": float(sum(float(d.sum()) for d in diffs.values())
                                         / sum(d.numel() for d in diffs.values()))}
    out["rel_weight_diff"] = out["max_abs_weight_diff"] / max(out["max_weight_change"], 1e-12)
    rel = 0.0
    for ma, mb in zip(a["metrics"], b["metrics"]):
        for k, va in ma.items():
            if isinstance(va, (int, float)) and not k.startswith(("mem", "peak")) and k in mb:
                rel = max(rel, abs(va - mb[k]) / max(abs(va), 1e-8))
    out["max_rel_metric_diff"] = rel
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write rank 0's weights and metrics here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print the max differences of two --out files")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="sgd",
                    help="sgd: the weight change is the gradient, so differences show directly (AdamW's "
                         "division by sqrt(v) amplifies float noise where a gradient entry is ~0)")
    ap.add_argument("--flat", type=int, nargs="*", default=[],
                    help="groups with all-equal rewards (their rank has fewer micro-batches and pads)")
    ap.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (torch.load(p, weights_only=False) for p in args.compare)
        print(compare(a, b))
        return 0
    res = run(args.overrides, args.steps, args.prompts, args.group_size, args.optimizer, tuple(args.flat))
    if res is not None and args.out:
        torch.save(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
