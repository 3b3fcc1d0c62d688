import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.config import ConfigError, all_keys, load_config

REQUIRED = ["model", "seed", "output_dir", "data.path", "reward.funcs", "train.steps", "train.prompts_per_step",
            "train.group_size", "train.lr", "train.beta", "rollout.max_new_tokens", "rollout.temperature", "lora.enabled"]


def test_contract_keys_exist_and_are_documented():
    keys = {k: doc for k, _, _, doc in all_keys()}
    for k in REQUIRED:
        assert k in keys and keys[k], k


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 0.001\n  steps: 3\nreward:\n  funcs: [a.b:c]\n")
    cfg = load_config(p, ["train.steps=7", "lora.enabled=true", "data.path=rows.jsonl"])
    assert (cfg.train.lr, cfg.train.steps, cfg.lora.enabled, cfg.reward.funcs, cfg.data.path) == (
        0.001, 7, True, ["a.b:c"], "rows.jsonl")


@pytest.mark.parametrize("override,msg", [
    ("train.lrr=1", "unknown config key `train.lrr`; did you mean `train.lr`?"),
    ("trian.steps=1", "did you mean `train.steps`?"),
    ("train.steps=abc", "train.steps: expected an integer"),
    ("lora.enabled=maybe", "lora.enabled: expected true/false"),
    ("train.group_size=0", "train.group_size must be >= 1"),
    ("algo=a2c", "algo must be one of grpo, rloo"),
    ("noequals", "key=value"),
])
def test_bad_overrides_fail_with_the_key(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert msg in str(e.value)


def test_bad_yaml_names_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key `train.stepz`; did you mean `train.steps`"):
        load_config(p)


def test_config_show_lists_every_key():
    res = CliRunner().invoke(app, ["config", "show"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    for k in REQUIRED:
        assert k in res.output


def test_cli_unknown_key_exits_2_with_hint():
    res = CliRunner().invoke(app, ["train", "train.setps=3"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "train.steps" in res.output
