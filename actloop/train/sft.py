"""SFT: supervised fine-tuning on (multi-turn, tool-using) conversations, loss on assistant tokens.

    conversations ─► Renderer (as a rollout renders them; `actloop.train.pairs`) ─► ids + mask
                  ─► batches of sft.batch_size, sft.epochs passes ─► token-mean NLL ─► AdamW

The data is `data.path` (JSONL rows with `messages`, or `prompt` + `completion`) or, without it,
gold traces of the calculator task — the ReTool-style cold start before RL: for
`train.steps * sft.batch_size` training problems, the environment's own prompt, then

    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "<row expression>"}}</tool_call>
    tool       <result>                       (rendered as the template renders tool results)
    assistant  The answer is <result>.

so one epoch is `train.steps` optimizer steps. Tool results and prompts have mask 0: the model
learns to call the tool and to read its answer, not to predict the tool's output. The loss is
the mean NLL over all assistant tokens of a batch (each token counts once, long traces more),
accumulated exactly over micro-batches of `train.micro_batch_size` conversations.

The final checkpoint (RUN_DIR/final, LoRA merged) is a plain model directory: chain RL after it
with `actloop train model=RUN_DIR/final` (see docs/compare.md).
"""

from __future__ import annotations

from actloop.config import Config, ConfigError
from actloop.train.common import Run, Timer, offline_schedule, progress_bar
from actloop.train.logprobs import token_logprobs
from actloop.train.pairs import Sequence, calculator_gold_sequences, check_rows, load_sft_sequences, parse_sft_row
from actloop.train.trainer import PromptSampler, RunResult


def sft_step(cfg: Config, run: Run, optimizer, scheduler, batch: list[Sequence]) -> dict[str, float]:
    """One optimizer step: mean NLL over every assistant token of the batch."""
    policy = run.models.policy
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    n_tokens = max(1, sum(s.num_loss_tokens for s in batch))
    nll_sum, ent_sum = 0.0, 0.0
    mb = max(1, cfg.train.micro_batch_size)
    for i in range(0, len(batch), mb):
        chunk = batch[i : i + mb]
        out = token_logprobs(policy, [list(s.ids) for s in chunk], [list(s.mask) for s in chunk], 1.0,
                             cfg.train.precision)
        nll = -(out.logp * out.mask).sum()  # [] summed over the chunk's assistant tokens
        (nll / n_tokens).backward()
        nll_sum += float(nll.detach())
        ent_sum += float((out.entropy * out.mask).sum())
    grad_norm = run.clip_and_step(optimizer, scheduler)
    return {"loss": nll_sum / n_tokens, "entropy": ent_sum / n_tokens, "tokens": n_tokens,
            "conversations": len(batch), "grad_norm": grad_norm}


def sft_data(cfg: Config, run: Run, print_fn=print) -> list[Sequence]:
    if cfg.data.path:
        seqs = load_sft_sequences(cfg.data.path, run.renderer)
        source = cfg.data.path
    else:
        if run.task.name != "calculator":
            raise ConfigError(f"algo=sft without data.path has gold traces for data.task=calculator only, "
                              f"not `{run.task.name}`: set data.path to a JSONL of conversations")
        n = min(cfg.train.steps * cfg.sft.batch_size, len(run.task.train_rows))
        rows = PromptSampler(run.task.train_rows, cfg.seed).next(n)
        seqs = calculator_gold_sequences(rows, run.renderer)
        source = "calculator gold traces"
    run.summary["sft_data"] = {"source": source, "conversations": len(seqs),
                               "assistant_tokens": sum(s.num_loss_tokens for s in seqs)}
    print_fn(f"SFT data: {len(seqs)} conversations ({source}), "
             f"{run.summary['sft_data']['assistant_tokens']} assistant tokens")
    return seqs


def train_sft(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """`algo=sft`."""
    if cfg.data.path:
        check_rows(cfg.data.path, parse_sft_row)  # bad data fails before a run directory exists
    run = Run(cfg, print_fn)
    run.evaluate("eval_before")
    seqs = sft_data(cfg, run, print_fn)
    optimizer, scheduler = run.optimizer()
    plan = offline_schedule(cfg, len(seqs), cfg.sft.batch_size, cfg.sft.epochs, "conversations", "sft.epochs", print_fn)
    with progress_bar(len(plan), progress) as bar:
        tid = bar.add_task("sft", total=len(plan), loss=0.0)
        for step, epoch, idx in plan:
            timer = Timer()
            m = sft_step(cfg, run, optimizer, scheduler, [seqs[i] for i in idx])
            run.log({"step": step, "epoch": epoch, **m, "lr": scheduler.get_last_lr()[0], "step_s": round(timer(), 3)},
                    timer())
            bar.update(tid, advance=1, loss=m["loss"])
    return run.finish()

