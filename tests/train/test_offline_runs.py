"""What a user of algo=dpo / algo=sft is told and given (issue 18): train.steps honoured over
data.path (cap or extend) instead of silently ignored, the evaluation task said at start,
offline figures (no "generated tokens/s: 0.0"), and bad data or config refused before a run
directory exists (for the online loop too)."""

import json

import pytest

from actloop.config import ConfigError, load_config
from actloop.data.jsonl import DataError
from actloop.rewards import RewardError
from actloop.train.offline.common import offline_schedule

CONVERSATION = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]}


def plan(*over):
    said = []
    steps = offline_schedule(load_config(None, list(over)), 5, 2, 2, "pairs", "dpo.epochs", said.append)
    return steps, said


def test_offline_steps_default_to_epochs_and_say_how_to_choose():
    steps, said = plan("algo=dpo", "data.path=pairs.jsonl")
    assert [(s, e) for s, e, _ in steps] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    assert sorted(i for _, e, idx in steps if e == 1 for i in idx) == [0, 1, 2, 3, 4]  # each pair once per pass
    assert said == ["dpo: 6 steps = dpo.epochs=2 x 3 batches of 2 over 5 pairs; set train.steps to choose the number "
                    "of steps"]


@pytest.mark.parametrize("steps,epochs", [(2, [1, 1]), (7, [1, 1, 1, 2, 2, 2, 3])])
def test_train_steps_set_by_the_user_caps_or_extends_an_offline_run(steps, epochs):
    plan_, said = plan("algo=dpo", "data.path=pairs.jsonl", f"train.steps={steps}")
    assert [s for s, _, _ in plan_] == list(range(1, steps + 1)) and [e for _, e, _ in plan_] == epochs
    assert said[0].startswith(f"dpo: train.steps={steps} steps of 2 over 5 pairs") and "dpo.epochs is not used" in said[0]
    # the same seed gives the same batches as the default plan, as far as both go
    assert plan_[:2] == plan("algo=dpo", "data.path=pairs.jsonl")[0][:2]


def test_train_steps_without_data_path_keeps_its_meaning():
    """Without data.path, train.steps sizes the sampled pairs or gold traces (docs/compare.md)."""
    steps, said = plan("algo=dpo", "train.steps=7")
    assert len(steps) == 6 and "set train.steps" not in said[0]


def test_bad_data_and_config_fail_before_a_run_directory_exists(tmp_path):
    from actloop.train.trainer import train

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CONVERSATION) + "\n" + '{"messages": [}\n')
    reward = tmp_path / "r.py"
    reward.write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    out = tmp_path / "runs"
    quiet = dict(progress=False, print_fn=lambda *a: None)
    cases = [
        (DataError, "bad.jsonl:2: not valid JSON", ["algo=sft", f"data.path={bad}"]),
        (DataError, "bad.jsonl:2: not valid JSON", ["algo=dpo", f"data.path={bad}"]),
        (DataError, "bad.jsonl:1: field `prompt`", [f"data.path={bad}", f"reward.funcs=[{reward}:one]"]),
        (RewardError, "No module named 'no_such_module_xyz'", [f"data.path={bad}", "reward.funcs=[no_such_module_xyz:f]"]),
        (ConfigError, "`countdown` has none: set data.path", ["algo=sft", "data.task=countdown"]),  # no gold traces
    ]
    for error, msg, over in cases:
        with pytest.raises(error, match=msg):
            train(load_config(None, over + [f"output_dir={out}", "run_name=r"]), **quiet)
        assert not out.exists(), over  # nothing left behind that holds only config.yaml


@pytest.mark.slow
def test_sft_on_user_data_honours_train_steps_and_reports_offline_figures(tmp_path):
    from actloop.train.trainer import train

    data = tmp_path / "sft.jsonl"
    data.write_text((json.dumps(CONVERSATION) + "\n") * 2)
    said = []
    cfg = load_config(None, ["algo=sft", f"data.path={data}", "train.steps=3", "sft.batch_size=2", "train.threads=1",
                             "train.eval_after=false", "data.eval_size=1", "train.save_final=false",
                             f"output_dir={tmp_path}", "run_name=sft"])
    res = train(cfg, progress=False, print_fn=said.append)
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and [r["epoch"] for r in lines] == [1, 2, 3]
    assert "evaluating on 1 held-out problems of data.task=calculator (data.path holds the training data; set " \
           "data.eval_path to evaluate on your own rows)" in said
    assert any(s.startswith("sft: train.steps=3 steps of 2 over 2 conversations") for s in said), said
    assert res.summary["steps"] == 3 and res.summary["trained_tokens_per_s"] > 0
    assert "generated_tokens_per_s" not in res.summary  # nothing was generated: no 0.0 to print
