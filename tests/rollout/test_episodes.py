"""Multi-turn episode flow with a scripted engine (no model): tool calls, malformed calls,
environment failures."""

from actloop.envs.base import StepResult
from actloop.tasks.calculator import CalculatorEnv
from actloop.rollout.engine import Completion, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.types import Message


class ScriptedEngine:
    """Answers each call with the next scripted text for every row (ids via the tokenizer)."""

    def __init__(self, renderer, script, eos=True):
        self.r, self.script, self.calls, self.eos = renderer, list(script), 0, eos

    def generate(self, prompts, params):
        text = self.script[self.calls]
        self.calls += 1
        ids = self.r.encode(text)
        stop = text.endswith("</tool_call>")
        if not stop and self.eos:
            ids = ids + [self.r.eos_token_ids[0]]
        return [Completion(tuple(ids), tuple([-0.5] * len(ids)), "stop_string" if stop else "stop") for _ in prompts]

    def sync_weights(self, model):
        pass


ROW = {"question": "What is 12 times 13, plus 5?", "answer": 161}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 13 + 5"}}</tool_call>'


def test_tool_call_then_answer(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(r, [CALL, "The answer is 161."])
    [t] = run_episodes(eng, r, CalculatorEnv, [ROW], SamplingParams(max_new_tokens=64), max_turns=3)
    assert t.error is None and len(t.turns) == 2 and t.num_tool_calls == 1
    assert t.turns[0].env_messages == (Message("tool", "161", name="calculator"),)
    assert t.final_text == "The answer is 161." and t.info["answer"] == 161
    assert "<tool_response>\n161\n</tool_response>" in r.decode(t.turns[0].env_ids)


def test_malformed_call_is_answered_with_an_error_and_counted(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(r, ['<tool_call>{"name": calculator}</tool_call>', "The answer is 161."])
    [t] = run_episodes(eng, r, CalculatorEnv, [ROW], SamplingParams(max_new_tokens=64), max_turns=3)
    assert t.num_malformed_calls == 1 and t.turns[0].malformed_tool_call
    assert t.turns[0].env_messages[0].content.startswith("Error: tool call is not valid JSON")
    assert t.error is None and len(t.turns) == 2


class ExplodingEnv(CalculatorEnv):
    def step(self, message):
        if self.row["question"] == "boom":
            raise RuntimeError("environment bug")
        return super().step(message)


def test_env_exception_is_recorded_on_that_trajectory_only(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(r, [CALL, "The answer is 161."])
    rows = [ROW, {"question": "boom", "answer": 0}]
    good, bad = run_episodes(eng, r, ExplodingEnv, rows, SamplingParams(max_new_tokens=64), max_turns=3)
    assert good.error is None and good.final_text == "The answer is 161."
    assert "environment bug" in bad.error and len(bad.turns) == 1


def test_turn_budget_ends_the_episode(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(r, [CALL, CALL, CALL])
    [t] = run_episodes(eng, r, CalculatorEnv, [ROW], SamplingParams(max_new_tokens=64), max_turns=2)
    assert len(t.turns) == 2 and t.turns[-1].env_ids == ()


class RewardingEnv(CalculatorEnv):
    def step(self, message):
        res = super().step(message)
        return StepResult(res.messages, res.done, res.info, reward=0.25)


def test_per_turn_rewards_are_kept(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(r, [CALL, "The answer is 161."])
    [t] = run_episodes(eng, r, RewardingEnv, [ROW], SamplingParams(max_new_tokens=64), max_turns=3)
    assert [turn.reward for turn in t.turns] == [0.25, 0.25]
