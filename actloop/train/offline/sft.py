"""SFT: supervised fine-tuning on (multi-turn, tool-using) conversations, loss on assistant tokens.

    conversations ─► Renderer (as a rollout renders them; `actloop.train.offline.pairs`) ─► ids + mask
                  ─► batches of sft.batch_size, sft.epochs passes ─► token-mean NLL ─► AdamW

The data is `data.path` (JSONL rows with `messages`, or `prompt` + `completion`) or, without it,
the task's gold traces (`Task.gold_trace`) — the ReTool-style cold start before RL: for
`train.steps * sft.batch_size` training problems, the environment's own prompt (and tools), then
the gold episode. For the calculator,

    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "<row expression>"}}</tool_call>
    tool       <result>                       (rendered as the template renders tool results)
    assistant  The answer is <result>.

for `gsm8k-tool`, GSM8K's solution lines, each with a python call that prints its calculation
(`actloop.tasks.gsm8k_tool`). Rows without a trace are skipped and counted (`sft_data.skipped`
in the summary), so one epoch is at most `train.steps` optimizer steps. Tool results and prompts
have mask 0: the model learns to call the tool and to read its answer, not to predict the tool's
output. The loss is the mean NLL over all assistant tokens of a batch (each token counts once,
long traces more), accumulated exactly over micro-batches of similar lengths, each of at most
`train.micro_batch_size` conversations and `train.max_tokens_per_microbatch` padded tokens.

The final checkpoint (RUN_DIR/final, LoRA merged) is a plain model directory: chain RL after it
with `actloop train model=RUN_DIR/final` (see docs/compare.md).
"""

from __future__ import annotations

import dataclasses

from actloop.algos.batching import token_budget_batches
from actloop.config import Config, ConfigError
from actloop.data.sampler import PromptSampler
from actloop.tasks.base import LoadedTask
from actloop.tasks.registry import build_task
from actloop.train.offline.common import (clip_and_step, offline_loop, offline_optimizer, offline_run, offline_schedule,
                                          save_full_model)
from actloop.train.numerics.logprobs import token_logprobs
from actloop.train.numerics.mixed_precision import update_precision
from actloop.train.offline.pairs import Sequence, check_rows, gold_sequences, load_sft_sequences, parse_sft_row
from actloop.train.runtime.run import Run, RunResult


def sft_step(cfg: Config, run: Run, optimizer, scheduler, batch: list[Sequence]) -> dict[str, float]:
    """One optimizer step: mean NLL over every assistant token of the batch."""
    policy = run.models.policy
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    n_tokens = max(1, sum(s.num_loss_tokens for s in batch))
    nll_sum, ent_sum = 0.0, 0.0
    # micro-batches of similar lengths, each within train.micro_batch_size conversations and
    # train.max_tokens_per_microbatch padded tokens (long multi-turn traces: a batch of 8 ~1k-token
    # gsm8k-tool traces in one forward held 12.5 GB); the accumulated gradient is the same
    order = sorted(range(len(batch)), key=lambda i: len(batch[i].ids))
    parts = token_budget_batches([len(batch[i].ids) for i in order], max(1, cfg.train.micro_batch_size),
                                 cfg.train.max_tokens_per_microbatch)
    with update_precision(cfg.train.precision, cfg.train.bf16_mode, policy):
        for part in parts:
            chunk = [batch[order[j]] for j in part]
            out = token_logprobs(policy, [list(s.ids) for s in chunk], [list(s.mask) for s in chunk], 1.0,
                                 cfg.train.precision)
            nll = -(out.logp * out.mask).sum()  # [] summed over the chunk's assistant tokens
            (nll / n_tokens).backward()
            nll_sum += float(nll.detach())
            ent_sum += float((out.entropy * out.mask).sum())
    grad_norm = clip_and_step(cfg, run.models, optimizer, scheduler)
    return {"loss": nll_sum / n_tokens, "entropy": ent_sum / n_tokens, "tokens": n_tokens,
            "conversations": len(batch), "grad_norm": grad_norm}


def gold_task(cfg: Config) -> LoadedTask:
    """`data.task` with its training rows, for `algo=sft` without `data.path`: it trains on the
    task's gold traces (`Task.gold_trace`). A task without them is a ConfigError, raised before a
    run directory exists."""
    task = build_task(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=None, eval_path=None)))
    if task.definition is None or task.definition.gold_trace is None:
        raise ConfigError(f"algo=sft without data.path trains on the task's gold traces (`Task.gold_trace`), and "
                          f"`{task.name}` has none: set data.path to a JSONL of conversations")
    return task


def sft_data(cfg: Config, run: Run, gold: LoadedTask | None, print_fn=print) -> list[Sequence]:
    """The rendered conversations to train on: `data.path`'s, or the gold traces of `gold`'s
    task for `train.steps * sft.batch_size` sampled training rows (rows without one are skipped)."""
    skipped = 0
    if gold is None:
        seqs = load_sft_sequences(cfg.data.path, run.renderer)
        source = cfg.data.path
    else:
        n = min(cfg.train.steps * cfg.sft.batch_size, len(gold.train_rows))
        rows = PromptSampler(gold.train_rows, cfg.seed).next(n)
        seqs, skipped = gold_sequences(gold.definition.gold_trace, gold.make_env, rows, run.renderer)
        source = f"{gold.name} gold traces"
    run.summary["sft_data"] = {"source": source, "conversations": len(seqs), "skipped": skipped,
                               "assistant_tokens": sum(s.num_loss_tokens for s in seqs)}
    print_fn(f"SFT data: {len(seqs)} conversations ({source}"
             + (f"; {skipped} rows without a gold trace skipped" if skipped else "")
             + f"), {run.summary['sft_data']['assistant_tokens']} assistant tokens")
    return seqs


def train_sft(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """`algo=sft`."""
    # bad data, or a task without gold traces, fails before a run directory exists
    gold = None if cfg.data.path else gold_task(cfg)
    if cfg.data.path:
        check_rows(cfg.data.path, parse_sft_row)
    run = offline_run(cfg, print_fn)
    run.evaluate("eval_before")
    seqs = sft_data(cfg, run, gold, print_fn)
    optimizer, scheduler = offline_optimizer(cfg, run.models)
    plan = offline_schedule(cfg, len(seqs), cfg.sft.batch_size, cfg.sft.epochs, "conversations", "sft.epochs", print_fn)
    offline_loop(run, plan, "sft", progress, scheduler,
                 lambda idx: sft_step(cfg, run, optimizer, scheduler, [seqs[i] for i in idx]))
    return run.finish(optimizer, lambda out: save_full_model(run.models, out))

