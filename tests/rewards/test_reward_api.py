from pathlib import Path

import pytest

from actloop.rewards import RewardError, RewardTerm, Rubric, call_reward_func, load_reward_func
from actloop.types import Message, Trajectory, Turn

HERE = Path(__file__).parent


def traj(text, **row):
    return Trajectory(prompt_messages=(Message("user", "q"),), prompt_ids=(1,),
                      turns=(Turn(Message("assistant", text), (5, 6), (-0.1, -0.2), "stop"),), row=row)


def test_blog_reward_runs_unchanged_on_answer_keys_column():
    fn = load_reward_func(f"{HERE / 'blog_reward.py'}:reasoning_reward_func")
    trajs = [
        traj("<thought>6*7</thought>\n### Final Answer\n42", answer_keys="42"),
        traj("<thought>hmm</thought>\n### Final Answer\n41", answer_keys="42"),
        traj("42", answer_keys="42"),
    ]
    assert call_reward_func(fn, trajs) == [2.0, 0.5, -1.0]


def test_module_path_spec_and_trajectories_argument():
    fn = load_reward_func("actloop.tasks.calculator:used_tool")
    assert call_reward_func(fn, [traj("no tool")]) == [0.0]


def test_prompts_arrive_in_conversational_form():
    seen = {}

    def f(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions, kw=kw)
        return [1.0] * len(completions)

    call_reward_func(f, [traj("hello", extra=3)])
    assert seen["prompts"] == [[{"role": "user", "content": "q"}]]
    assert seen["completions"] == ["hello"] and seen["kw"] == {"extra": [3]}


@pytest.mark.parametrize("spec,msg", [("nocolon", "module:function"), ("json:nope", "has no function"),
                                      ("no_such_module_xyz:f", "cannot import"), ("missing.py:f", "does not exist")])
def test_bad_reward_specs_fail_clearly(spec, msg):
    with pytest.raises(RewardError, match=msg):
        load_reward_func(spec)


@pytest.mark.parametrize("ret,msg", [([1.0], "must return a list of 2"), (["x", 1.0], "expected a number"),
                                     ([float("nan"), 1.0], "nan"), (None, "must return a list")])
def test_bad_return_values_fail_clearly(ret, msg):
    with pytest.raises(RewardError, match=msg):
        call_reward_func(lambda prompts, completions, **kw: ret, [traj("a"), traj("b")])


def test_rubric_weights_components_and_none():
    def a(prompts, completions, **kw):
        return [1.0, 0.0]

    def b(prompts, completions, **kw):
        return [0.5, None]  # None: not applicable, left out of the total

    scored = Rubric([RewardTerm("a", a, 2.0), RewardTerm("b", b, 1.0), RewardTerm("log", a, 0.0)]).score([traj("x"), traj("y")])
    assert [s.reward for s in scored] == [2.5, 0.0]
    assert scored[0].components == {"a": 1.0, "b": 0.5, "log": 1.0} and "b" not in scored[1].components


def test_a_raising_reward_masks_the_batch_and_is_counted_not_zeroed():
    def boom(prompts, completions, **kw):
        raise ConnectionError("judge down")

    rubric = Rubric([RewardTerm("boom", boom)])
    scored = rubric.score([traj("x")])
    assert scored[0].masked and "reward_error" in scored[0].flags
    assert len(rubric.errors) == 1 and "judge down" in rubric.errors[0]


def test_a_function_can_ask_for_the_whole_transcript():
    t = Trajectory(prompt_messages=(Message("user", "q"),), prompt_ids=(1,),
                   turns=(Turn(Message("assistant", "call"), (5,), (-0.1,), "tool_call",
                               (Message("tool", "42", name="calc"),), (7,)),
                          Turn(Message("assistant", "The answer is 42."), (6,), (-0.1,), "stop")))

    def f(prompts, completions, transcripts, **kw):
        return [float("tool: 42" in transcripts[0] and completions[0] == "The answer is 42.")]

    assert call_reward_func(f, [t]) == [1.0]


def test_module_in_the_current_directory_loads_as_the_readme_writes_it(tmp_path, monkeypatch):
    """`reward.funcs=[my_rewards:f]` with my_rewards.py in the current directory: the `actloop`
    script does not put the current directory on sys.path (`python -m` does), so the loader
    searches it last itself — without shadowing installed packages."""
    import sys

    (tmp_path / "papercut_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "papercut_rewards", raising=False)
    fn = load_reward_func("papercut_rewards:f")
    assert call_reward_func(fn, [traj("x")]) == [0.5]
    assert str(tmp_path) not in sys.path and "" not in sys.path  # searched, not left behind
    assert load_reward_func("papercut_rewards.py:f")(prompts=[], completions=["a"]) == [0.5]  # the file form too
    with pytest.raises(RewardError, match=r"No module named 'nope_rewards' \(looked in the installed packages and "
                                          r"in the current directory .*path/to/nope_rewards.py:f"):
        load_reward_func("nope_rewards:f")
