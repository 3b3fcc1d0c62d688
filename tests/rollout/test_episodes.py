"""Multi-turn episode flow with a scripted engine (no model): tool calls, malformed calls,
environment failures."""

from actloop.envs.base import StepResult
from actloop.tasks.calculator import CalculatorEnv
from actloop.rollout.engine import Completion, EngineBase, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.types import Message


class ScriptedEngine(EngineBase):
    """Answers turn k of every episode with script[k] (ids via the tokenizer). The turn is read
    off the prompt (its assistant turns beyond the opening prompt's), so episodes may arrive in
    any order and batching (the continuous schedule sends each episode's turns on their own)."""

    def __init__(self, renderer, script, eos=True):
        self.r, self.script, self.eos, self.base = renderer, list(script), eos, None

    def _turn(self, prompt):
        n = self.r.decode(prompt).count("<|im_start|>assistant")
        self.base = n if self.base is None else min(self.base, n)
        return n - self.base

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.script[self._turn(p)]
            ids = self.r.encode(text)
            stop = text.endswith("</tool_call>")
            if not stop and self.eos:
                ids = ids + [self.r.eos_token_ids[0]]
            out.append(Completion(tuple(ids), tuple([-0.5] * len(ids)), "stop_string" if stop else "stop"))
        return out

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


def test_lockstep_schedule_gives_the_same_episodes(tokenizer):
    r = Renderer(tokenizer)
    rows = [ROW, {"question": "boom", "answer": 0}, ROW]
    runs = [run_episodes(ScriptedEngine(r, [CALL, "The answer is 161."]), r, ExplodingEnv, rows,
                         SamplingParams(max_new_tokens=64), max_turns=3, schedule=s) for s in ("continuous", "lockstep")]
    for a, b in zip(*runs):
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask and (a.error is None) == (b.error is None)
