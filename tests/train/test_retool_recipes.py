"""The ReTool recipes (maths with a Python tool): an SFT cold start on gsm8k-tool gold traces
(recipes/retool_sft.yaml), then GRPO from its checkpoint (recipes/retool.yaml). They load, the
SFT recipe's data is the task's gold traces and fits the rollout settings both recipes share,
and one tiny real SFT step runs end to end (slow)."""

import json
import math
from pathlib import Path

import pytest

from actloop.config import load_config
from actloop.rollout.renderer import Renderer
from actloop.tasks import build_task
from actloop.train.offline.pairs import gold_sequences, masked_spans
from actloop.data.sampler import PromptSampler
from actloop.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
SFT, GRPO = ROOT / "recipes" / "retool_sft.yaml", ROOT / "recipes" / "retool.yaml"


def test_retool_recipes_chain_sft_final_into_grpo():
    """The chain the recipes' headers give: the SFT recipe under run_name=retool_sft writes a whole
    model to RUN_DIR/final, and the GRPO recipe with model= that directory starts from it."""
    sft = load_config(SFT, ["run_name=retool_sft"])
    final = Path(sft.output_dir) / sft.run_name / "final"
    grpo = load_config(GRPO, [f"model={final}", "run_name=retool"])
    assert (sft.algo, sft.data.task, grpo.algo, grpo.data.task) == ("sft", "gsm8k-tool", "grpo", "gsm8k-tool")
    assert sft.train.save_final and not sft.lora.enabled and grpo.model == str(final) == "runs/retool_sft/final"
    # the policy GRPO starts from was evaluated, and trained, with the same turn budget
    assert (sft.rollout.max_new_tokens, sft.rollout.max_turns) == (grpo.rollout.max_new_tokens, grpo.rollout.max_turns)
    assert grpo.train.eval_every > 0 and grpo.train.eval_every_rows > 0 and grpo.data.eval_size > 0


@pytest.mark.data("gsm8k")
def test_retool_sft_recipe_trains_on_gold_traces_that_fit_its_rollout_settings(tokenizer):
    cfg = load_config(SFT, ["data.eval_size=2"])
    task = build_task(cfg)
    rows = PromptSampler(task.train_rows, cfg.seed).next(64)  # as sft_data samples them
    seqs, skipped = gold_sequences(task.definition.gold_trace, task.make_env, rows, Renderer.from_config(tokenizer, cfg))
    assert len(seqs) + skipped == 64 and len(seqs) >= 60
    turns = [masked_spans(s.ids, s.mask) for s in seqs]
    assert all(1 < len(t) <= cfg.rollout.max_turns for t in turns)  # calls, then the answer
    lengths = sorted(len(span) for t in turns for span in t)
    assert lengths[int(0.95 * len(lengths))] <= cfg.rollout.max_new_tokens
    assert max(len(s.ids) for s in seqs) <= cfg.rollout.max_context


@pytest.mark.slow
@pytest.mark.data("gsm8k")
def test_one_tiny_sft_step_on_gsm8k_tool_gold_traces(tmp_path):
    """20-45 s on a shared CPU: the recipe, one step of two traces, greedy evaluation of two test
    problems before and after (their reports carry every rubric component)."""
    cfg = load_config(SFT, ["train.steps=1", "sft.batch_size=2", "train.threads=1", "data.eval_size=2",
                            "checkpoint.every=0", "train.save_final=false", f"output_dir={tmp_path}", "run_name=sft"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    [line] = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and line["conversations"] == 2 and math.isfinite(line["loss"]) and line["loss"] > 0
    data = res.summary["sft_data"]
    assert (data["source"], data["conversations"], data["skipped"]) == ("gsm8k-tool gold traces", 2, 0)
    assert line["tokens"] == data["assistant_tokens"]
    for label in ("eval_before", "eval_after"):
        ev = res.summary[label]
        assert ev["n"] == 2 and "tool_calls_per_episode" in ev
        assert set(ev["components"]) == {"correct", "format", "used_tool", "tool_errors", "answer_from_tool"}
    assert not (res.run_dir / "final").exists()
