"""DPO: rendering of preference rows, the online loss, and offline/online training runs (tiny)."""

import json
import math

import pytest
import torch

from actloop.config import load_config
from actloop.data.jsonl import DataError
from actloop.rollout.renderer import Renderer
from actloop.train.offline.pairs import load_preference_pairs, masked_spans

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
SYSTEM = {"role": "system", "content": "Use the calculator tool, then answer as: The answer is N."}


def pair_rows() -> list[dict]:
    """Six preference rows in the three accepted shapes: chat prompt + multi-turn chosen, string
    prompt + string completions, OpenAI-style tool_calls."""
    rows = []
    for i, (a, b, c) in enumerate([(12, 13, 5), (21, 34, 9), (45, 17, 30), (23, 29, 11), (38, 14, 7), (56, 19, 40)]):
        q, expr, ans = f"What is {a} times {b}, plus {c}?", f"{a} * {b} + {c}", a * b + c
        if i % 3 == 0:
            chosen = [{"role": "assistant", "content": CALL % expr}, {"role": "tool", "content": str(ans)},
                      {"role": "assistant", "content": f"The answer is {ans}."}]
            rows.append({"prompt": [SYSTEM, {"role": "user", "content": q}], "chosen": chosen,
                         "rejected": f"The answer is {ans + 17}."})
        elif i % 3 == 1:
            rows.append({"prompt": q, "chosen": f"The answer is {ans}.", "rejected": f"I think it is {ans - 3}."})
        else:
            chosen = [{"role": "assistant", "content": None,
                       "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                        "arguments": json.dumps({"expression": expr})}}]},
                      {"role": "tool", "content": str(ans), "name": "calculator"},
                      {"role": "assistant", "content": f"The answer is {ans}."}]
            rows.append({"prompt": [SYSTEM, {"role": "user", "content": q}], "chosen": chosen,
                         "rejected": [{"role": "assistant", "content": "No idea."}]})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_preference_rows_train_on_assistant_tokens_only(tokenizer, tmp_path):
    r = Renderer(tokenizer)
    pairs = load_preference_pairs(write_jsonl(tmp_path / "p.jsonl", pair_rows()), r)
    assert len(pairs) == 6
    # multi-turn chosen: the tool call (no end-of-turn token: generation stops at </tool_call>)
    # and the final answer; the tool result and prompt are masked out
    spans = [r.decode(s) for s in masked_spans(pairs[0].chosen.ids, pairs[0].chosen.mask)]
    assert spans == [CALL % "12 * 13 + 5", "The answer is 161.<|im_end|>"]
    assert "161" in r.decode(pairs[0].chosen.ids) and "<tool_response>\n161\n</tool_response>" in r.decode(
        pairs[0].chosen.ids)
    assert [r.decode(s) for s in masked_spans(pairs[0].rejected.ids, pairs[0].rejected.mask)] == [
        "The answer is 178.<|im_end|>"]
    # a string prompt is one user turn; OpenAI tool_calls become a Hermes call
    assert [r.decode(s) for s in masked_spans(pairs[1].chosen.ids, pairs[1].chosen.mask)] == [
        "The answer is 723.<|im_end|>"]
    spans = [r.decode(s) for s in masked_spans(pairs[2].chosen.ids, pairs[2].chosen.mask)]
    assert spans[0] == CALL % "45 * 17 + 30" and spans[1] == "The answer is 795.<|im_end|>"
    # chosen and rejected share the prompt tokens exactly
    first = pairs[0].chosen.mask.index(1)
    assert first == pairs[0].rejected.mask.index(1) and pairs[0].chosen.ids[:first] == pairs[0].rejected.ids[:first]


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "q", "chosen": "a"}', "`rejected` is missing"),
    ('{"prompt": "q", "chosen": [{"role": "tool", "content": "1"}], "rejected": "b"}', "must start with an assistant"),
    ('{"prompt": 3, "chosen": "a", "rejected": "b"}', "`prompt` must be a non-empty list"),
    ("not json", "not valid JSON"),
])
def test_bad_preference_rows_fail_with_file_and_line(tokenizer, tmp_path, line, msg):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        load_preference_pairs(path, Renderer(tokenizer))
    assert f"{path}:2" in str(e.value) and msg in str(e.value)


@pytest.fixture
def one_thread():
    """Training runs pin torch to one thread (much faster on a CPU shared with other jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _trajectory(r: Renderer, question: str, answer: str):
    from actloop.types import Message, Trajectory, Turn

    prompt = (Message("system", "Answer briefly."), Message("user", question))
    ids = tuple(r.encode(answer) + [r.eos_token_ids[0]])
    return Trajectory(prompt_messages=prompt, prompt_ids=tuple(r.prompt_ids(list(prompt))),
                      turns=(Turn(Message("assistant", answer), ids, (0.0,) * len(ids), "stop"),))


@pytest.mark.slow
def test_online_dpo_loss_builds_best_vs_worst_pairs(tokenizer, fp32_model, one_thread):
    """Policy == reference: every implicit reward is 0 and the sigmoid loss is exactly log 2; one
    pair per group with distinct rewards, tied groups skipped; the loss carries gradient."""
    from actloop.models import Models
    from actloop.train.offline.dpo import online_dpo_loss
    from actloop.types import Scored

    r = Renderer(tokenizer)
    answers = ["The answer is 161.", "It is 150.", "Maybe 170?", "161", "161.", "One hundred sixty-one."]
    scored = [Scored(_trajectory(r, "What is 12 * 13 + 5?", a), rw, {}) for a, rw in
              zip(answers, [1.0, 0.0, 0.5, 1.0, 1.0, 1.0])]
    models = Models(policy=fp32_model, tokenizer=tokenizer, reference=fp32_model, lora=False)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [1.0, 1.0, 1.0]])
    try:
        loss, m = online_dpo_loss(models, scored, rewards, precision="fp32")
        assert m["pairs"] == 1.0 and loss.requires_grad
        assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
        assert m["reward_margin"] == pytest.approx(0.0, abs=1e-5) and m["kl"] == pytest.approx(0.0, abs=1e-6)
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in fp32_model.parameters())
        tied, m = online_dpo_loss(models, scored, torch.ones(2, 3), precision="fp32")
        assert not tied.requires_grad and m["pairs"] == 0.0
    finally:
        fp32_model.zero_grad(set_to_none=True)


def finite_lines(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:
        for k, v in rec.items():
            assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
    return lines


@pytest.mark.slow
def test_offline_dpo_on_jsonl_pairs_learns_and_scores_the_reference_once(tmp_path, monkeypatch, one_thread):
    import actloop.train.offline.dpo as dpo
    from actloop.train.trainer import train

    calls = []
    real = dpo.sequence_logps

    def counting(model, seqs, *a, **kw):
        calls.append((torch.is_grad_enabled(), len(seqs)))
        return real(model, seqs, *a, **kw)

    monkeypatch.setattr(dpo, "sequence_logps", counting)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    cfg = load_config(None, ["algo=dpo", f"data.path={data}", "dpo.batch_size=6", "dpo.epochs=3", "train.lr=5e-5",
                             "train.threads=1", "data.eval_size=2", "data.train_size=10", "rollout.max_new_tokens=40",
                             "rollout.max_turns=2", f"output_dir={tmp_path}", "run_name=dpo"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    lines = finite_lines(res.run_dir)
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["pairs"] == 6 for r in lines)
    for key in ["loss", "reward_margin", "reward_accuracy", "grad_norm", "kl", "step_s", "lr"]:
        assert key in lines[0], key
    # three full-batch steps on one fixed set of pairs: the loss goes down from log 2
    losses = [r["loss"] for r in lines]
    assert losses[0] == pytest.approx(math.log(2), abs=0.02)
    assert losses[2] < losses[1] < losses[0] and losses[2] < 0.6, losses
    assert lines[2]["reward_margin"] > lines[0]["reward_margin"]
    # the reference is scored once per pair (12 sequences), without gradient, before training;
    # every later forward is the policy's, with gradient
    assert sum(n for grad, n in calls if not grad) == 12
    assert sum(n for grad, n in calls if grad) == 12 * 3
    assert calls[0][0] is False
    s = json.loads((res.run_dir / "summary.json").read_text())
    assert 0 <= s["eval_before"]["success"] <= 1 and 0 <= s["eval_after"]["success"] <= 1 and s["seconds_per_step"] > 0
    assert s["pair_data"]["pairs"] == 6 and (res.run_dir / "final" / "config.json").exists()


@pytest.mark.slow
def test_offline_dpo_samples_its_pairs_from_the_policy_once(tmp_path, one_thread):
    from actloop.train.trainer import train

    cfg = load_config(None, ["algo=dpo", "train.steps=1", "train.prompts_per_step=3", "train.group_size=4",
                             "dpo.batch_size=2", "train.threads=1", "train.eval_before=false", "train.eval_after=false",
                             "train.save_final=false", "data.train_size=20", "data.eval_size=2",
                             f"output_dir={tmp_path}", "run_name=dpo"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    info = res.summary["pair_data"]
    assert info["prompts"] == 3 and info["pairs"] + info["tied_groups"] == 3
    saved = [json.loads(x) for x in (res.run_dir / "pairs.jsonl").read_text().splitlines()]
    assert len(saved) == info["pairs"]
    for row in saved:  # best vs worst of a group: the chosen earned more
        assert row["chosen_reward"] > row["rejected_reward"] and row["chosen"][0]["role"] == "assistant"
    assert len(finite_lines(res.run_dir)) == math.ceil(info["pairs"] / 2)


@pytest.mark.slow
def test_online_dpo_runs_the_rollout_loop(tmp_path, one_thread):
    from actloop.train.trainer import train

    cfg = load_config(None, ["algo=dpo", "dpo.online=true", "train.steps=2", "train.prompts_per_step=2",
                             "train.group_size=3", "train.threads=1", "train.eval_before=false",
                             "train.eval_after=false", "data.train_size=20", "data.eval_size=2",
                             f"output_dir={tmp_path}", "run_name=online"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    lines = finite_lines(res.run_dir)
    assert [r["step"] for r in lines] == [1, 2]
    for key in ["reward_mean", "success", "pairs", "loss", "reward_margin", "kl", "grad_norm", "rollout_s", "update_s"]:
        assert key in lines[0], key
    assert all(0 <= r["pairs"] <= 2 for r in lines)
    assert res.summary["seconds_per_step"] > 0 and (res.run_dir / "final" / "config.json").exists()
