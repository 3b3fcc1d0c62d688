import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.config import ConfigError, all_keys, choices, get_key, load_config

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


@pytest.mark.parametrize("over", [["train.group_size=1"], ["algo=rloo", "train.group_size=1"],
                                  ["algo=dpo", "dpo.online=true", "train.group_size=1"]])
def test_a_group_of_one_is_refused_where_the_algorithm_compares_within_the_group(over):
    with pytest.raises(ConfigError, match=r"train.group_size=1 gives it nothing to compare .* use train.group_size >= 2"):
        load_config(None, over)


@pytest.mark.parametrize("over", [["algo=reinforce_pp"], ["algo=ppo"], ["algo=dpo"], ["algo=sft"]])
def test_a_group_of_one_is_fine_where_nothing_is_compared_within_it(over):
    assert load_config(None, [*over, "train.group_size=1"]).train.group_size == 1


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


def test_config_show_piped_is_one_readable_paragraph_per_key():
    """Piped (CliRunner is not a terminal): plain text, no table squeezed into 80 columns (it
    wrapped the doc column to ~10 characters: 1,334 lines), and no text eaten as rich markup."""
    res = CliRunner().invoke(app, ["config", "show"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    keys = [k for k, *_ in all_keys()]
    assert len(lines) < 4 * len(keys) and max(len(ln) for ln in lines if ln.startswith("    ")) <= 100  # docs wrap at 100
    assert "data.mix (list[str]) = []" in lines
    assert "e.g. [gsm8k:0.7,mbpp:0.3]" in res.output
    assert "train.lr (float) = 1e-05" in CliRunner().invoke(app, ["config", "show", "train.lr=1e-5"]).output


def test_config_show_table_in_a_wide_terminal_keeps_brackets(monkeypatch):
    import io

    from rich.console import Console

    import actloop.cli as cli

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, force_terminal=True, width=250, color_system=None))
    res = CliRunner().invoke(app, ["config", "show"])
    assert res.exit_code == 0, res.output
    text = out.getvalue()
    assert "┃ key" in text and "[gsm8k:0.7,mbpp:0.3]" in text  # a table, brackets intact
    plain = CliRunner().invoke(app, ["config", "show", "--plain"])  # asked for: plain even in a wide terminal
    assert "data.mix (list[str]) = []" in plain.output.splitlines()


def test_config_show_yaml_has_every_doc_as_a_comment_and_loads_back(tmp_path):
    res = CliRunner().invoke(app, ["config", "show", "--yaml", "train.lr=1e-5", "data.mix=[gsm8k:0.7,mbpp:0.3]"])
    assert res.exit_code == 0, res.output
    text = res.output
    assert "# Weighted mixture, `name:weight` entries, e.g. [gsm8k:0.7,mbpp:0.3]" in text
    assert "  lr: 1.0e-05\n" in text and "  mix: ['gsm8k:0.7', 'mbpp:0.3']\n" in text
    comments = sum(line.lstrip().startswith("# ") for line in text.splitlines())
    assert comments >= len(all_keys())  # at least one comment line per key
    p = tmp_path / "resolved.yaml"
    p.write_text(text)
    assert load_config(p).to_dict() == load_config(None, ["train.lr=1e-5", "data.mix=[gsm8k:0.7,mbpp:0.3]"]).to_dict()


def test_explicit_keys_are_the_ones_the_file_and_overrides_set(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 7\n  lr: 2.0e-5\n")  # lr at its default, as `config show --yaml` writes it
    assert load_config(p, ["dpo.epochs=2", "train.group_size=8"]).explicit_keys == {
        "train.steps", "dpo.epochs", "train.group_size"}
    assert load_config(None, []).explicit_keys == set()


CHOICE_KEYS = [(k, choices(tp)) for k, tp, _, _ in all_keys() if choices(tp)]


def test_the_fixed_choice_keys_are_typed_with_their_values():
    keys = dict(CHOICE_KEYS)
    assert keys["rollout.engine"] == ("auto", "hf", "vllm", "vllm-server", "ray")
    assert {"train.optimizer", "train.precision", "sandbox.backend", "kl.mode", "data.bad_rows"} <= set(keys)


@pytest.mark.parametrize("key,values", CHOICE_KEYS, ids=[k for k, _ in CHOICE_KEYS])
def test_a_choice_key_loads_each_of_its_values_and_names_the_closest_for_a_typo(key, values):
    for v in values:
        assert get_key(load_config(None, [f"{key}={v}"]), key) == v
    typo = values[-1][:-1] + "_"  # one character off the last value
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={typo}"])
    assert str(e.value) == f"{key} must be one of {', '.join(values)}; got `{typo}`; did you mean `{values[-1]}`?"


def test_a_list_of_choices_checks_each_entry():
    assert load_config(None, ["failures.count=[env,tool]"]).failures.count == ["env", "tool"]
    with pytest.raises(ConfigError, match=r"failures.count\[1\] must be one of .*; got `sandbx`; did you mean `sandbox`"):
        load_config(None, ["failures.count=[env,sandbx]"])


def test_a_registry_choice_gets_the_closest_name_too():
    with pytest.raises(ConfigError, match=r"kl.controller must be one of fixed, adaptive; got `adaptiv`; did you mean `adaptive`"):
        load_config(None, ["kl.controller=adaptiv"])


def test_config_show_lists_each_choice_keys_values():
    res = CliRunner().invoke(app, ["config", "show", "--plain"])
    assert res.exit_code == 0, res.output
    for key, values in CHOICE_KEYS:
        assert f"{key} ({'|'.join(values)}) = " in res.output, key
    yaml_text = CliRunner().invoke(app, ["config", "show", "--yaml"]).output  # each key's doc as comments above it
    comments = " ".join(ln.strip().removeprefix("# ") for ln in yaml_text.splitlines() if ln.strip().startswith("#"))
    assert "One of: auto, hf, vllm, vllm-server, ray." in comments


def test_the_sandbox_offers_exactly_the_backends_the_config_accepts():
    """The stdlib-only sandbox keeps its own tuple (it loads without the config's yaml/torch)."""
    from actloop.config import SandboxBackend
    from actloop.sandbox.factory import BACKENDS

    assert BACKENDS == choices(SandboxBackend)
