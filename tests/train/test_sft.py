"""SFT: gold traces rendered as rollouts are, loss on assistant tokens only, the loss goes down,
and the SFT -> GRPO chain runs from the recipes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actloop.config import load_config
from actloop.data.jsonl import DataError
from actloop.tasks.calculator import CalculatorEnv, gold_trace, make_splits
from actloop.rollout.engine import SamplingParams
from fixtures.teacher import TeacherEngine
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.train.offline.pairs import gold_conversation, gold_sequences, load_sft_sequences, masked_spans

ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def test_gold_trace_masks_exactly_the_assistant_turns_as_a_rollout_would(tokenizer):
    r = Renderer(tokenizer)
    rows, _ = make_splits(5, 2, seed=0)
    for row in rows:
        [seq], skipped = gold_sequences(gold_trace, CalculatorEnv, [row], r)
        assert skipped == 0
        spans = [r.decode(s) for s in masked_spans(seq.ids, seq.mask)]
        # the tool call (no end-of-turn: the engine stops at </tool_call>) and the final answer
        assert spans == [CALL % row["expression"], f"The answer is {row['answer']}.<|im_end|>"]
        text = r.decode(seq.ids)
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in text  # the tool result, mask 0
        assert text.count(row["question"]) == 1 and text.index(row["question"]) < text.rindex(spans[0])
        # identical ids and mask to a rollout of the same turns through the real environment
        prompt, completion, _tools, _wording = gold_conversation(gold_trace, CalculatorEnv, row)
        turns = [r.assistant_text(m)[0] for m in completion if m.role == "assistant"]  # as the policy samples them
        [traj] = run_episodes(TeacherEngine(r, turns), r, CalculatorEnv, [row], SamplingParams(max_new_tokens=64), 3)
        assert list(seq.ids) == traj.input_ids and list(seq.mask) == traj.loss_mask
        # and the chat template renders the very same text for that conversation
        full = r.history_text(prompt + completion, CalculatorEnv().reset(row)[1], CalculatorEnv.tool_prompt)
        assert text == full.rstrip("\n")


def test_gold_traces_score_full_marks(tokenizer):
    """The calculator rubric gives the gold trace reward 1 (a gold answer that scored 0 would be
    a grader bug, and SFT on it a waste)."""
    from actloop.tasks import build_task

    r = Renderer(tokenizer)
    task = build_task(load_config(None, ["data.train_size=4", "data.eval_size=2"]))
    trajs = []
    for row in task.train_rows:
        completion = task.definition.gold_trace(row)
        turns = [r.assistant_text(m)[0] for m in completion if m.role == "assistant"]  # as the policy samples them
        trajs += run_episodes(TeacherEngine(r, turns), r, task.make_env, [row], SamplingParams(max_new_tokens=64), 3)
    assert [s.reward for s in task.rubric.score(trajs)] == [1.0] * 4


def test_sft_rows_with_messages_and_tool_calls(tokenizer, tmp_path):
    r = Renderer(tokenizer)
    rows = [
        {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12*13?"},
                      {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "12*13"}'}}]},
                      {"role": "tool", "content": "156", "name": "calculator"},
                      {"role": "assistant", "content": "The answer is 156."},
                      {"role": "user", "content": "Plus one?"},
                      {"role": "assistant", "content": "157."}]},
        {"prompt": "Say hi.", "completion": "Hi!"},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    a, b = load_sft_sequences(path, r)
    assert [r.decode(s) for s in masked_spans(a.ids, a.mask)] == [
        CALL % "12*13", "The answer is 156.<|im_end|>", "157.<|im_end|>"]
    assert "Plus one?" in r.decode(a.ids) and "Use tools." in r.decode(a.ids)
    assert [r.decode(s) for s in masked_spans(b.ids, b.mask)] == ["Hi!<|im_end|>"]


@pytest.mark.parametrize("row, msg", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "before the first assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 must be"),
    ({"text": "hi"}, "needs `messages`"),
])
def test_bad_sft_rows_fail_with_file_and_line(tokenizer, tmp_path, row, msg):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        load_sft_sequences(path, Renderer(tokenizer))
    assert f"{path}:2" in str(e.value) and msg in str(e.value)


@pytest.fixture
def one_thread():
    """Training runs pin torch to one thread (much faster on a CPU shared with other jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_sft_on_calculator_gold_traces_lowers_the_loss(tmp_path, one_thread):
    from actloop.train.trainer import train

    cfg = load_config(None, ["algo=sft", "train.steps=1", "sft.batch_size=2", "sft.epochs=3", "train.lr=1e-4",
                             "train.threads=1", "train.eval_before=false", "train.eval_after=false",
                             "data.train_size=20", "data.eval_size=2", f"output_dir={tmp_path}", "run_name=sft"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and [r["epoch"] for r in lines] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in lines)
    # the same two traces three times: the loss on their assistant tokens must fall
    losses = [r["loss"] for r in lines]
    # down from the first epoch; by the last ones the loss sits near 2e-4, where an epoch may tie or tick up
    assert losses[-1] < 0.1 * losses[0], losses
    assert res.summary["sft_data"]["conversations"] == 2
    assert lines[0]["tokens"] == res.summary["sft_data"]["assistant_tokens"]  # mask tokens only, both traces
    assert (res.run_dir / "final" / "config.json").exists()


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "actloop", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_sft_then_grpo_chain_from_the_recipes(tmp_path):
    tiny = ["train.threads=1", "train.eval_before=false", "train.eval_after=false", "data.train_size=20",
            "data.eval_size=2", f"output_dir={tmp_path}", "--no-progress"]
    run_cli("train", "recipes/sft.yaml", "train.steps=1", "sft.batch_size=2", "run_name=sft", *tiny)
    final = tmp_path / "sft" / "final"
    assert (final / "config.json").exists() and (final / "tokenizer_config.json").exists()
    run_cli("train", "recipes/grpo_after_sft.yaml", f"model={final}", "train.steps=1", "train.prompts_per_step=1",
            "train.group_size=2", "run_name=grpo", *tiny)
    lines = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and math.isfinite(lines[0]["reward_mean"])
    assert json.loads((tmp_path / "grpo" / "summary.json").read_text())["model"] == str(final)


def test_sft_micro_batches_keep_the_token_budget_and_the_gradient(tiny_qwen3_dir):
    """train.max_tokens_per_microbatch bounds each SFT forward (long tool traces); the accumulated
    step is the same as one forward over the whole batch."""
    from types import SimpleNamespace

    from actloop.models import load_models
    from actloop.train.offline import sft
    from actloop.train.offline.pairs import Sequence

    seqs = [Sequence(tuple(range(5, 5 + n)), (0,) * 3 + (1,) * (n - 3)) for n in (12, 7, 20, 9)]
    changes, sizes = [], []
    for budget in (0, 24):
        models = load_models(tiny_qwen3_dir)
        start = {k: v.clone() for k, v in models.policy.state_dict().items()}
        opt = torch.optim.SGD(models.policy.parameters(), lr=1e-2)

        def step(cfg, models, optimizer, scheduler):  # no clipping: the two gradients are compared as they are
            optimizer.step()
            return 0.0

        seen = []
        real, clip_and_step = sft.token_logprobs, sft.clip_and_step

        def recording(policy, ids, mask, *a, **kw):
            seen.append(sorted(len(x) for x in ids))
            return real(policy, ids, mask, *a, **kw)

        cfg = load_config(None, ["algo=sft", "train.precision=fp32", f"train.max_tokens_per_microbatch={budget}"])
        sft.token_logprobs, sft.clip_and_step = recording, step
        try:
            m = sft.sft_step(cfg, SimpleNamespace(models=models), opt, None, seqs)
        finally:
            sft.token_logprobs, sft.clip_and_step = real, clip_and_step
        sizes.append(seen)
        changes.append({k: v - start[k] for k, v in models.policy.state_dict().items()})
        assert m["tokens"] == sum(s.num_loss_tokens for s in seqs)
    assert sizes[0] == [[7, 9, 12, 20]]                        # no budget: one forward
    assert sizes[1] == [[7, 9], [12], [20]]                    # by length, each <= 24 padded tokens (or alone)
    assert max(float((changes[0][k] - changes[1][k]).abs().max()) for k in changes[0]) < 1e-5
    assert max(float(v.abs().max()) for v in changes[0].values()) > 1e-4  # the step changed the weights
