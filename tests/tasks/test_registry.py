"""The one task registry: built-in names, `module:OBJECT`, `file.py:OBJECT`; rows from a task's
generator or from data.path; mixtures; a task's own rollout; the demo's prompt unchanged."""

import hashlib
import json

import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.config import ConfigError, load_config
from actloop.rewards.base import load_object
from actloop.rollout.engine import Completion, EngineBase, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.tasks import BUILTIN, Task, build_task, resolve
from actloop.train.runtime.evaluate import evaluate
from actloop.data.sampler import PromptSampler
from actloop.train.rl.loop import rollout_groups

USER_TASK = '''
import random
from actloop import Message, PromptEnv, Task


def rows(train_size, eval_size, seed, split):
    rng = random.Random(f"{split}-{seed}")
    held = [{"word": f"w{rng.randint(0, 10**6)}"} for _ in range(eval_size)]
    train = [{"word": f"t{i}-{seed}"} for i in range(train_size)]
    return train, held


def echoed(prompts, completions, word, **kw):
    return [float(w in c) for c, w in zip(completions, word)]


TASK = Task(name="echo", env=lambda: PromptEnv("Repeat the word.", [], lambda r: r["word"]), rewards=[echoed],
            splits=rows, gold=lambda r: r["word"], description="say the word back")
NOT_A_TASK = 3


def from_config(cfg):  # a function cfg -> Task, for tasks built from the configuration
    return Task(name=f"echo-{cfg.seed}", env=TASK.env, rewards=[echoed], splits=rows)
'''


def build(*over):
    return build_task(load_config(None, list(over)))


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "echo_task.py"
    path.write_text(USER_TASK)
    return path


def test_actloop_tasks_lists_every_builtin_on_one_line():
    res = CliRunner().invoke(app, ["tasks"])
    assert res.exit_code == 0
    lines = res.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(BUILTIN) == [
        "calculator", "gsm8k", "gsm8k-tool", "mbpp", "humaneval", "instructions", "countdown"]
    assert all(len(ln.split(None, 1)[1]) > 20 for ln in lines)  # each has its description


def test_resolve_names_modules_and_files(user_file):
    assert resolve("countdown") is BUILTIN["countdown"]
    assert resolve("actloop.tasks.countdown:TASK") is BUILTIN["countdown"]
    t = resolve(f"{user_file}:TASK")
    assert isinstance(t, Task) and t.name == "echo"
    assert resolve(f"{user_file}:TASK") is t  # a file is imported once
    with pytest.raises(ConfigError, match="unknown task `poetry`.*file.py:OBJECT"):
        resolve("poetry")
    with pytest.raises(ConfigError, match="has no object `NOPE`"):
        resolve(f"{user_file}:NOPE")
    with pytest.raises(ConfigError, match=r"has no object `TAKS`; did you mean `.*:TASK`\?"):
        resolve(f"{user_file}:TAKS")
    assert resolve(f"{user_file}:from_config", load_config(None, ["seed=7"])).name == "echo-7"
    assert build(f"data.task={user_file}:from_config", "seed=3", "data.train_size=2").name == "echo-3"
    with pytest.raises(ConfigError, match="is a int, not an actloop Task"):
        resolve(f"{user_file}:NOT_A_TASK")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve("missing_task.py:TASK")


def test_a_user_task_gets_its_rows_its_rubric_and_tagging(user_file, tmp_path):
    t = build(f"data.task={user_file}:TASK", "data.train_size=5", "data.eval_size=3")
    assert t.name == "echo" and len(t.train_rows) == 5 and len(t.eval_rows) == 3
    assert {r["source"] for r in t.train_rows + t.eval_rows} == {"echo"}
    assert [x.name for x in t.rubric.terms] == ["echoed"]
    assert t.rubric.validate(t.eval_rows, t.definition.gold, n=None).ok
    messages, tools = t.make_env().reset(t.eval_rows[0])
    assert messages[-1].content == t.eval_rows[0]["word"] and tools == []
    # data.path: the user's rows with the task's environment and rubric
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"word": f"file{i}"}) + "\n" for i in range(10)))
    t = build(f"data.task={user_file}:TASK", f"data.path={rows}", "data.eval_size=2")
    assert t.name == "echo" and len(t.eval_rows) == 2 and len(t.train_rows) == 8
    assert all(r["word"].startswith("file") for r in t.train_rows)


def test_a_user_task_mixes_with_a_builtin(user_file):
    t = build(f"data.mix=[{user_file}:TASK:1,countdown:1]", "data.train_size=20", "data.eval_size=4")
    assert t.name == "mix" and {r["source"] for r in t.train_rows} == {"echo", "countdown"}
    assert set(t.rubric.parts) == {"echo", "countdown"}


def test_eval_only_task_refuses_training():
    with pytest.raises(ConfigError, match="humaneval has no training split"):
        build("data.task=humaneval")


class _NoEngine:
    def generate(self, prompts, params):
        raise AssertionError("a task with its own rollout must not reach the standard loop")


AGENT_TASK = USER_TASK.replace('description="say the word back"', 'rollout=own_rollout').replace("import random", """\
import random
from actloop.rewards.rubric import text_trajectory

CALLS = []


def own_rollout(engine, renderer, make_env, rows, params, max_turns, max_context=4096):
    CALLS.append(len(rows))  # e.g. an unmodified agent behind the gateway
    return [text_trajectory(r["word"], r) for r in rows]
""")


def test_a_task_can_supply_its_own_rollout(tmp_path, tokenizer):
    """Task.rollout replaces the standard episode loop in eval and training (the gateway's agent
    tasks use it)."""
    path = tmp_path / "agent_task.py"
    path.write_text(AGENT_TASK)
    spec = f"{path}:TASK"
    t = build(f"data.task={spec}", "data.train_size=4", "data.eval_size=3")
    res = evaluate(_NoEngine(), Renderer(tokenizer), t, t.eval_rows, max_new_tokens=8, max_turns=1)
    assert res["success"] == 1.0
    cfg = load_config(None, [f"data.task={spec}", "train.group_size=2", "train.prompts_per_step=2"])
    scored = rollout_groups(cfg, t, _NoEngine(), None, PromptSampler(t.train_rows, 0), SamplingParams())[0]
    assert len(scored) == 4 and all(s.reward == 1.0 for s in scored)
    assert load_object(f"{path}:CALLS") == [3, 4]
    with pytest.raises(ConfigError, match="runs its own episodes"):
        build(f"data.mix=[{spec}:1,countdown:1]")


DEMO_PROMPT_SHA256 = "696ae99f5fcc910fabccaa481e6c6d1132a73a020da6d334a1bb05495f117334"


class _PromptRecorder(EngineBase):
    """An engine that records the prompts it is asked to continue and ends every episode there."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return [Completion((), (), "length") for _ in prompts]


def test_the_demo_prompt_ids_are_unchanged(tokenizer):
    """The calculator demo's prompts (4 training, 4 held-out rows), as an episode renders them
    (`run_episodes` with the tool schemas the environment declares, the renderer the trainer
    builds from the default config), hash to what they were before the task registry (measured
    on main at f81623b, when the tool format was hand-written in the system prompt): its
    +53-point learning result holds."""
    t = build()
    cfg = load_config(None, [])
    engine, rows = _PromptRecorder(), t.train_rows[:4] + t.eval_rows[:4]
    trajs = run_episodes(engine, Renderer.from_config(tokenizer, cfg), t.make_env, rows, SamplingParams(), max_turns=1)
    assert [list(tr.prompt_ids) for tr in trajs] == engine.prompts and len(engine.prompts) == 8
    assert all(tr.error is None for tr in trajs)
    h = hashlib.sha256()
    for ids in engine.prompts:
        h.update(json.dumps(ids).encode())
    assert h.hexdigest() == DEMO_PROMPT_SHA256


def test_rows_missing_a_column_a_reward_function_takes_fail_before_the_run(tmp_path):
    reward = tmp_path / "needs_answer.py"
    reward.write_text("def exact(prompts, completions, answer, **kw):\n"
                      "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
                      "def lenient(prompts, completions, answer=None, **kw):\n"
                      "    return [0.0 for _ in completions]\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)}) + "\n"
                            for i in range(6)) + json.dumps({"prompt": [{"role": "user", "content": "Say 7."}]}) + "\n")
    with pytest.raises(ConfigError, match=rf"rows.jsonl: a row \(row \d+ as loaded, .*\) has no column `answer`, "
                                          rf"which reward function `exact` \({reward}:1\) takes; its columns: prompt"):
        build(f"data.path={rows}", f"reward.funcs=[{reward}:exact]")
    assert build(f"data.path={rows}", f"reward.funcs=[{reward}:lenient]").name == "custom"  # a default: optional
    # `actloop grade` on such a row: the same error, exit 2 (it was a masked "missing 1 required positional argument")
    user_task = tmp_path / "qa.py"
    user_task.write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom actloop import PromptEnv, Task\n"
                         "from needs_answer import exact\n"
                         "TASK = Task('qa', env=lambda: PromptEnv('Answer.', [], str), rewards=[exact])\n")
    answer = tmp_path / "a.txt"
    answer.write_text("7")
    res = CliRunner().invoke(app, ["grade", "--task", f"{user_task}:TASK", "--id", "6", "--data", str(rows),
                                   "--completion", str(answer)])
    assert res.exit_code == 2 and "has no column `answer`" in res.output
