"""Multi-turn tool episodes of the tiny GPT-OSS with gpt-oss's own vocabulary on the HF engine.

The model was taught one calculator episode (tests/fixtures/calling_gpt_oss.py): greedy, it
writes a call on the analysis channel, which is executed, then the answer. Sampled at T = 1 it
wanders, and every episode, whatever it wrote, is trained on exactly the ids the engine sampled:
the loss mask covers the sampled turns and nothing else, the rest is the library's rendering,
and the trainer's log-probs of those ids are the engine's (fp32 both).
"""

from __future__ import annotations

import pytest
import torch

from actloop.rollout.engine import HFEngine, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.tasks.calculator import CalculatorEnv
from actloop.train.offline.pairs import masked_spans
from actloop.types import Message
from fixtures.calling_gpt_oss import ROW, episode_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(calling_gpt_oss):
    from transformers import AutoTokenizer

    path, model = calling_gpt_oss
    r = Renderer(AutoTokenizer.from_pretrained(path))
    assert r.format.token_exact  # gpt-oss's vocabulary: the library's ids are the model's
    return model, r, HFEngine(model, r.tokenizer, r.eos_token_ids, precision="fp32", weights="live")


def test_the_call_on_the_analysis_channel_is_executed_greedy(setup):
    model, r, engine = setup
    [t] = run_episodes(engine, r, lambda: CalculatorEnv(shots=[]), [ROW], SamplingParams(max_new_tokens=64,
                                                                                           greedy=True), 3)
    assert t.error is None and len(t.turns) == 2 and not t.turns[0].malformed_tool_call
    assert [(c.name, c.arguments) for c in t.turns[0].message.tool_calls] == [("calculator",
                                                                              {"expression": "12 * 13 + 5"})]
    assert t.turns[0].env_messages == (Message("tool", "161", name="calculator"),)
    assert t.turns[1].message.content == "The answer is 161."
    assert (t.input_ids, t.loss_mask) == episode_ids(r)


def test_sampled_episodes_train_on_exactly_the_sampled_ids(setup):
    from actloop.train.numerics.logprobs import token_logprobs

    model, r, engine = setup
    torch.manual_seed(0)
    trajs = run_episodes(engine, r, lambda: CalculatorEnv(shots=[]), [ROW] * 6,
                         SamplingParams(max_new_tokens=48, temperature=1.0), 3)
    assert all(t.error is None for t in trajs)
    assert sum(len(t.turns) for t in trajs) > len(trajs)  # some went on after a call (or a malformed one)
    for t in trajs:
        assert masked_spans(t.input_ids, t.loss_mask) == [list(x.token_ids) for x in t.turns]
    with torch.no_grad():
        out = token_logprobs(model, [t.input_ids for t in trajs], [t.loss_mask for t in trajs], precision="fp32")
    engine_lp = [torch.tensor([lp for x in t.turns for lp in x.logprobs]) for t in trajs]
    gap = max(float((e - out.logp[i][out.mask[i]]).abs().max()) for i, e in enumerate(engine_lp))
    print(f"HF engine vs trainer, tiny o200k GPT-OSS, {len(trajs)} episodes: max |gap| {gap:.2e}")
    assert gap < 1e-3
