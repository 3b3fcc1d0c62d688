"""Failure isolation: an environment that raises, a sandbox that times out or cannot start, a
judge whose endpoint fails, a policy that emits no parsable answer. Each is recorded, counted
and (except `parse`) masked; the step goes on. The fast tests drive `run_episodes` and the
rubric with a scripted engine; the slow one runs the trainer on the embedded model."""

import dataclasses
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from actloop.config import FailuresConfig, load_config
from actloop.envs.base import ChatEnv, StepResult
from actloop.envs.tools import ToolEnv, tool
from actloop.rewards.code import CodeGrader
from actloop.rewards.judge import Judge, JudgeConfig, PassFail, judge_usage
from actloop.rewards.rubric import RewardTerm, Rubric, text_trajectory
from actloop.rollout.engine import Completion, EngineBase, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.types import Message
from actloop.sandbox import ExecResult, get_sandbox
from actloop.sandbox import clock as sandbox_clock
from actloop.train.runtime.failures import (FailureGuard, FailureLog, classify, failure_metrics, masked_line, no_answer,
                                    tool_line)
from actloop.train.runtime.run import _usage, usage_delta


def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)


class ScriptedEngine(EngineBase):
    """Answers every prompt with the same ids; `finish` "length" imitates a cut-off reply."""

    def __init__(self, ids, finish="stop"):
        self.ids, self.finish = tuple(ids), finish

    def generate(self, prompts, params):
        return [Completion(self.ids, (-1.0,) * len(self.ids), self.finish) for _ in prompts]

    def sync_weights(self, model):
        pass


class FlakyEnv(ChatEnv):
    """Raises in `step` on rows marked `boom` (a tool server that went down)."""

    def reset(self, row):
        self.row = row
        return super().reset(row)

    def step(self, message):
        if self.row.get("boom"):
            raise RuntimeError("tool server down")
        return StepResult([], True)


def rows(n, boom=()):
    return [{"id": f"r{i}", "prompt": [{"role": "user", "content": f"Say hi {i}."}], "boom": i in boom}
            for i in range(n)]


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return Renderer(tokenizer)


def answer_ids(tokenizer, renderer, text="Hi there."):
    return tokenizer.encode(text, add_special_tokens=False) + [renderer.eos_token_ids[0]]


def test_env_that_raises_is_recorded_masked_and_counted(tokenizer, renderer, tmp_path):
    engine = ScriptedEngine(answer_ids(tokenizer, renderer))
    trajs = run_episodes(engine, renderer, FlakyEnv, rows(4, boom={1, 3}), SamplingParams(8), max_turns=1)
    scored = Rubric([RewardTerm("constant", constant)]).score(trajs)
    assert [s.masked for s in scored] == [False, True, False, True]
    failures = classify(7, scored)
    assert [(f.kind, f.index, f.row_id, f.masked) for f in failures] == [("env", 1, "r1", True), ("env", 3, "r3", True)]
    assert failures[0].message == "RuntimeError: tool server down" and "Traceback" in failures[0].traceback
    m = failure_metrics(failures, len(scored), FailuresConfig())
    assert m == {"failures/env": 2, "failures/engine": 0, "failures/sandbox": 0, "failures/judge": 0, "failures/reward": 0,
                 "failures/truncated": 0, "failures/parse": 0, "failures/tool": 0, "failures/masked": 2, "failures/rate": 0.5,
                 "failures/any": 0.5}
    log = FailureLog(tmp_path / "failures.jsonl")
    log.write(failures)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["row_id"]) for r in lines] == [(7, "env", "r1"), (7, "env", "r3")]
    assert "tool server down" in lines[0]["traceback"]


class BrokenToolEnv(ToolEnv):
    """A user's tool with a bug: it raises on every call."""

    def prompt(self, row):
        return [Message("user", "What is 2 + 2?")]

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b + undefined_name  # noqa: F821


def test_a_tool_that_raises_is_shown_to_the_model_and_reported_to_the_user(tokenizer, renderer, tmp_path):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    engine = ScriptedEngine(answer_ids(tokenizer, renderer, call))
    trajs = run_episodes(engine, renderer, BrokenToolEnv, rows(4), SamplingParams(32), max_turns=2)
    assert all(t.info["tool_errors"] == 2 for t in trajs)  # each call answered with an Error message
    scored = Rubric([RewardTerm("constant", constant)]).score(trajs)
    failures = [f for f in classify(3, scored) if f.kind == "tool"]
    raising_line = BrokenToolEnv.add.__code__.co_firstlineno + 8
    assert len(failures) == 4 and not any(f.masked for f in failures)
    assert failures[0].message == (f"tool `add` raised NameError: name 'undefined_name' is not defined "
                                   f"({__file__}:{raising_line})")
    assert f'File "{__file__}", line {raising_line}, in add' in failures[0].traceback
    assert failure_metrics(failures, 4, FailuresConfig())["failures/tool"] == 4
    line = tool_line(3, failures, 4, tmp_path / "failures.jsonl")
    assert line.startswith("step 3: a tool raised in 4 of 4 episodes (the model was shown the error); first: tool `add`")
    assert tool_line(3, failures[:1], 4, tmp_path / "failures.jsonl") is None  # 1 in 4: the model's business


class BadReplyEnv(ChatEnv):
    """Answers with something that is not a Message (a bug in the environment)."""

    def step(self, message):
        return StepResult(["not a message"], False)


def test_env_reply_that_cannot_be_rendered_is_an_env_failure(tokenizer, renderer):
    engine = ScriptedEngine(answer_ids(tokenizer, renderer))
    trajs = run_episodes(engine, renderer, BadReplyEnv, rows(2), SamplingParams(8), max_turns=3)
    assert all(t.error and len(t.turns) == 1 for t in trajs)
    failures = classify(1, Rubric([RewardTerm("constant", constant)]).score(trajs))
    assert [(f.kind, f.masked) for f in failures] == [("env", True)] * 2


def test_cut_off_policy_counts_as_truncated_not_parse_and_is_not_masked(tokenizer, renderer):
    junk = tokenizer.encode(" ]]] ;; ]]]", add_special_tokens=False)[:4]
    trajs = run_episodes(ScriptedEngine(junk, "length"), renderer, ChatEnv, rows(4), SamplingParams(4), max_turns=2)
    scored = Rubric([RewardTerm("constant", constant)]).score(trajs)
    assert not any(s.masked for s in scored)  # the policy must learn from it
    failures = classify(1, scored)
    assert [f.kind for f in failures] == ["truncated"] * 4 and not any(f.masked for f in failures)
    assert failures[0].message == "cut off at max_new_tokens (4 tokens)"
    m = failure_metrics(failures, 4, FailuresConfig())
    assert m["failures/truncated"] == 4 and m["failures/parse"] == 0 and m["failures/masked"] == 0
    assert m["failures/rate"] == 0.0 and m["failures/any"] == 1.0  # not in failures.count, but recorded
    assert failure_metrics(failures, 4, FailuresConfig(count=["truncated"]))["failures/rate"] == 1.0
    assert masked_line(1, failures, 4, Path("failures.jsonl")) is None  # trained on: nothing to say per step


def test_garbage_policy_that_stops_without_an_answer_counts_as_parse(tokenizer, renderer):
    empty = [tokenizer.eos_token_id]
    trajs = run_episodes(ScriptedEngine(empty, "stop"), renderer, ChatEnv, rows(2), SamplingParams(4), max_turns=1)
    failures = classify(1, Rubric([RewardTerm("constant", constant)]).score(trajs))
    assert [(f.kind, f.message) for f in failures] == [("parse", "empty reply")] * 2
    # the other ways to give no answer, and an answer
    ok = text_trajectory("The answer is 4.")
    assert no_answer(ok) is None
    assert no_answer(text_trajectory("   ")) == "empty reply"
    assert no_answer(dataclasses.replace(ok, turns=())) == "no assistant turn"
    assert no_answer(ok, ["no_answer"]) == "no_answer"


def test_reward_function_that_raises_masks_the_batch_with_its_traceback():
    def broken(prompts, completions, **kwargs):
        raise ZeroDivisionError("division by zero in the grader")

    rubric = Rubric([RewardTerm("constant", constant), RewardTerm("broken", broken)])
    scored = rubric.score([text_trajectory("a"), text_trajectory("b")])
    failures = classify(2, scored, rubric.errors)
    assert [(f.kind, f.masked) for f in failures] == [("reward", True)] * 2
    # the user's own file and line, not actloop's shim: in the message and as the traceback's first frame
    raising_line = broken.__code__.co_firstlineno + 1
    assert failures[0].message == (f"reward `broken` raised ZeroDivisionError: division by zero in the grader "
                                   f"({__file__}:{raising_line})")
    tb = failures[0].traceback
    assert "Traceback (most recent call last)" in tb and f'File "{__file__}", line {raising_line}, in broken' in tb
    assert "actloop/rewards" not in tb
    # the one line the step prints: how many, which kind, the first message, where the tracebacks are
    line = masked_line(2, failures, 3, Path("runs/x/failures.jsonl"))
    assert line.startswith("step 2: 2 of 3 trajectories masked from the loss (2 reward failures); "
                           "first: reward `broken` raised ZeroDivisionError")
    assert "division by zero in the grader" in line and line.endswith("tracebacks in runs/x/failures.jsonl")
    # an evaluation of that batch says it graded nothing instead of printing a bare 0%
    from actloop.train.runtime.evaluate import _first_reason, eval_line

    res = {"success": 0.0, "n": 2, "seconds": 1.0, "masked": 2, "masked_reason": _first_reason(scored)}
    assert eval_line("eval_before", res) == (
        "eval_before: greedy success 0.0% on 2 held-out problems (1s); 2 of 2 masked, not graded: "
        f"reward `broken` raised ZeroDivisionError: division by zero in the grader ({__file__}:{raising_line})")
    assert eval_line("eval_before", {**res, "masked": 0}).endswith("held-out problems (1s)")


class FailingSandbox:
    """A sandbox that cannot start (what a broken bwrap or a dead Docker daemon looks like)."""

    tier, isolated = "rlimit", False

    def run(self, code=None, **kw):
        return ExecResult("", "", -1, False, False, 0.0, self.tier, error="cannot create namespace: EPERM")


class TightSandbox:
    """The host's sandbox with a 1 s wall clock, whatever the grader asks for."""

    def __init__(self):
        self.inner = get_sandbox()
        self.tier, self.isolated = self.inner.tier, self.inner.isolated

    def run(self, code=None, **kw):
        kw["limits"] = dataclasses.replace(kw["limits"], timeout_s=1.0)
        return self.inner.run(code, **kw)


CODE_ROW = {"test_list": ["assert f(1) == 1", "assert f(2) == 2"], "test_setup_code": "", "challenge_test_list": []}


def code_rubric(sandbox):
    return Rubric([RewardTerm("tests", CodeGrader(sandbox=sandbox, max_workers=1))])


def test_sandbox_that_cannot_start_is_masked_and_counted():
    scored = code_rubric(FailingSandbox()).score([text_trajectory("```python\ndef f(x):\n    return x\n```", CODE_ROW)])
    assert scored[0].masked
    (f,) = classify(1, scored)
    assert (f.kind, f.masked) == ("sandbox", True) and "EPERM" in f.message


def test_sandbox_timeout_scores_zero_and_is_counted_not_masked():
    loop = "```python\ndef f(x):\n    while True:\n        pass\n```"
    ok = "```python\ndef f(x):\n    return x\n```"
    rubric = code_rubric(TightSandbox())  # (finding the host's sandbox runs a probe)
    before = sandbox_clock.totals()
    scored = rubric.score([text_trajectory(loop, CODE_ROW), text_trajectory(ok, CODE_ROW)])
    after = sandbox_clock.totals()
    assert [s.reward for s in scored] == [0.0, 1.0] and not any(s.masked for s in scored)
    assert classify(1, scored) == []  # the policy's infinite loop is its own failure: reward 0, trained on
    assert after["timeouts"] - before["timeouts"] == 1 and after["runs"] - before["runs"] == 2
    assert after["seconds"] - before["seconds"] >= 1.0


class JudgeServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: HTTP 500 for responses that contain FAIL_ME, else a
    PASS verdict with 10 prompt and 2 completion tokens."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if b"FAIL_ME" in body:
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"choices": [{"message": {"content": "VERDICT: PASS"}}],
                          "usage": {"prompt_tokens": 10, "completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_judge_endpoint_failing_is_masked_counted_and_tokens_are_per_step(judge_url):
    judge = Judge(JudgeConfig(base_url=judge_url, model="m", api_key_env=None, max_retries=0, timeout_s=5,
                              price_input_per_mtok=1.0, price_output_per_mtok=4.0), PassFail("says hi"))
    rubric = Rubric([RewardTerm("judge", judge)])

    class FakeTask:  # what `_usage` reads: the rubric's reward functions
        pass

    task = FakeTask()
    task.rubric = rubric
    before = _usage(task)
    scored = rubric.score([text_trajectory("hi"), text_trajectory("FAIL_ME"), text_trajectory("hello")])
    delta = usage_delta(before, _usage(task))
    assert [s.masked for s in scored] == [False, True, False] and [s.reward for s in scored] == [1.0, 0.0, 1.0]
    (f,) = classify(3, scored)
    assert (f.kind, f.index, f.masked) == ("judge", 1, True) and "http_5xx" in f.message
    assert delta["judge/requests"] == 3 and delta["judge/failed"] == 1
    assert delta["judge/prompt_tokens"] == 20 and delta["judge/completion_tokens"] == 4
    assert math.isclose(delta["judge/cost_usd"], (20 * 1.0 + 4 * 4.0) / 1e6)
    assert judge_usage([constant]) == {"requests": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                       "cost_usd": 0.0}
    # a data mix scores with its sources' rubrics: their judges are the step's judges too
    from actloop.data.mix import MixedRubric

    task.rubric = MixedRubric(terms=[], parts={"chat": rubric})
    before = _usage(task)
    task.rubric.score([dataclasses.replace(text_trajectory("hi"), row={"source": "chat"})])
    assert usage_delta(before, _usage(task))["judge/requests"] == 1


def test_guard_stops_after_consecutive_bad_steps(tmp_path):
    from actloop.train.runtime.failures import Failure

    guard = FailureGuard(FailuresConfig(max_rate=0.5, max_bad_steps=2))
    bad = [Failure(1, "sandbox", "x", None, i, "r", True) for i in range(3)]
    parse = [Failure(1, "parse", "x", None, i, "r", False) for i in range(4)]
    assert guard.check(1, bad, 4, tmp_path) is None  # 75% > 50%: one bad step
    assert guard.check(2, parse, 4, tmp_path) is None  # parse does not count by default: the streak resets
    assert guard.check(3, bad, 4, tmp_path) is None
    msg = guard.check(4, bad, 4, tmp_path)
    assert "2 consecutive steps" in msg and "3 sandbox failures" in msg and str(tmp_path / "failures.jsonl") in msg
    assert FailureGuard(FailuresConfig(max_bad_steps=0)).check(1, bad, 4, tmp_path) is None  # never stops


BROKEN_REWARD = "def broken(prompts, completions, **kwargs):\n    raise ValueError('grader crashed')\n"
# distinct for every trajectory whatever the 2-token replies say (their characters could tie in a
# group, which then trains nothing): this test is about truncated replies training, not the reward
VARIED_REWARD = "def varied(prompts, completions, **kwargs):\n    return [i / 10 for i in range(len(completions))]\n"


@pytest.mark.slow
def test_training_through_failures_then_stopping_cleanly(tmp_path):
    """On the embedded model: (1) 2-token replies (nothing parses) train and the run finishes;
    (2) a reward function that always raises masks every trajectory: the steps train nothing,
    log finite metrics, and the run stops after failures.max_bad_steps with a checkpoint."""
    from actloop.train.runtime.checkpoint import list_checkpoints
    from actloop.train.runtime.failures import RunAborted
    from actloop.train.trainer import train

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                            for i in range(10)))
    (tmp_path / "rewards.py").write_text(VARIED_REWARD + BROKEN_REWARD)
    base = ["train.prompts_per_step=2", "train.group_size=2", f"data.path={data}", "data.eval_size=2",
            "rollout.max_new_tokens=2", "rollout.max_turns=1", "train.eval_before=false", "train.eval_after=false",
            "train.save_final=false", "train.threads=1", f"output_dir={tmp_path}", "checkpoint.every=0"]
    quiet = dict(progress=False, print_fn=lambda *a: None)

    res = train(load_config(None, base + ["train.steps=1", "run_name=garbage",
                                          f"reward.funcs=[{tmp_path / 'rewards.py'}:varied]"]), **quiet)
    (rec,) = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rec["failures/truncated"] == 4 and rec["failures/masked"] == 0 and rec["trained_trajectories"] > 0
    assert res.summary["failures"] == {"truncated": 4}

    # adaptive KL: a step with nothing to train measured no KL, so beta must not move
    cfg = load_config(None, base + ["train.steps=5", "run_name=broken", "failures.max_bad_steps=2",
                                    "train.beta=0.1", "kl.controller=adaptive", "kl.horizon=10",
                                    f"reward.funcs=[{tmp_path / 'rewards.py'}:broken]"])
    said = []
    with pytest.raises(RunAborted, match="stopping at step 2: 2 consecutive steps .* 4 reward failures"):
        train(cfg, progress=False, print_fn=said.append)
    masked = [s for s in said if "masked from the loss" in s]
    assert [s.split(":")[0] for s in masked] == ["step 1", "step 2"], said  # one line per step, saying why
    assert "(4 reward failures); first: reward `broken` raised ValueError: grader crashed" in masked[0]
    assert f"({tmp_path / 'rewards.py'}:" in masked[0]  # the user's own file and line
    run_dir = tmp_path / "broken"
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["failures/reward"] == 4 and r["failures/masked"] == 4 and r["trained_trajectories"] == 0
        assert r["beta"] == 0.1, r["beta"]  # was 0.092 at step 2: the controller read the unmeasured KL as 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    logged = [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]
    assert len(logged) == 8 and all("grader crashed" in f["traceback"] for f in logged)
    assert [c.step for c in list_checkpoints(run_dir)] == [2]  # checkpoint first, then stop
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"]["step"] == 2 and summary["failures"] == {"reward": 8}

    # fewer steps than failures.max_bad_steps, every one masked: the run must not end as a success
    cfg = load_config(None, base + ["train.steps=1", "run_name=nothing", f"reward.funcs=[{tmp_path / 'rewards.py'}:broken]"])
    with pytest.raises(RunAborted, match=r"no step trained anything: every trajectory of steps 1-1 was masked \(4 reward failures"):
        train(cfg, **quiet)
    assert json.loads((tmp_path / "nothing" / "summary.json").read_text())["stopped"]["step"] == 1
    train(load_config(None, base + ["train.steps=1", "run_name=ignored", "failures.nothing_trained=ignore",
                                    f"reward.funcs=[{tmp_path / 'rewards.py'}:broken]"]), **quiet)  # asked for
