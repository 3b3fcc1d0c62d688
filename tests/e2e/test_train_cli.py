"""`actloop train` end to end on the embedded model, with tiny settings (about a minute each)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "data.eval_size=3", "data.train_size=20",
        "rollout.max_new_tokens=24", "rollout.max_turns=2", "rollout.vllm_enforce_eager=true", "--no-progress"]


def run_cli(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "actloop", *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def blog_data(tmp_path: Path) -> tuple[Path, str]:
    """Rows for the blog's reward function, and `reward.funcs` with it and a term that differs
    between samples: at these budgets the blog reward is -1 for every completion (no closing
    </thought> in 24 tokens), so every group was all-equal and nothing trained."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i}? Think in <thought></thought>, then "
                                                           "write ### Final Answer."}], "answer_keys": str(2 * i)}) + "\n"
        for i in range(10)))
    (tmp_path / "varied.py").write_text("def varied(prompts, completions, **kw):\n"
                                        "    return [len(set(c)) / 100 for c in completions]\n")
    blog = ROOT / "tests" / "rewards" / "blog_reward.py"
    return rows, f"[{blog}:reasoning_reward_func,{tmp_path / 'varied.py'}:varied]"


def trained(lines: list[dict]) -> int:
    """An e2e run must have trained something: a non-zero gradient on some step (all-equal groups
    count in `trained_trajectories` with advantage 0 and give no gradient; masked failures give
    none; `kl >= 0` holds for k3 anyway)."""
    n = sum(r["trained_trajectories"] for r in lines)
    assert n > 0 and any(r["grad_norm"] > 0 for r in lines), [(r["step"], r["grad_norm"], r["reward_std"]) for r in lines]
    return n


def changed_tensors(before: dict, after: dict) -> int:
    import torch

    return sum(not torch.equal(before[k].float(), after[k].float()) for k in after if k in before)


def finite_metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:
        for k, v in rec.items():
            assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
    return lines


@pytest.mark.slow
def test_train_calculator_tiny(tmp_path):
    # 48 new tokens: the embedded model can finish a calculator tool call (about 32 tokens), so some
    # episodes succeed; 4 samples per prompt make a group with mixed rewards (something to train on)
    out = run_cli("train", *TINY, "rollout.max_new_tokens=48", "train.group_size=4", "train.eval_every=2",
                  "train.eval_every_rows=2", f"output_dir={tmp_path}", "run_name=calc")
    run_dir = tmp_path / "calc"
    assert f"run directory: {run_dir}" in out.replace("\n", "") or str(run_dir) in out
    assert (run_dir / "config.yaml").exists()
    lines = finite_metrics(run_dir)
    assert [r["step"] for r in lines] == [1, 2]
    # the periodic held-out eval (train.eval_every=2) lands on step 2 only
    assert "eval_success" not in lines[0] and 0.0 <= lines[1]["eval_success"] <= 1.0
    for key in ["reward_mean", "reward_std", "success", "kl", "entropy", "clip_frac", "grad_norm", "response_tokens",
                "tool_tokens", "tool_calls_per_episode", "malformed_call_rate", "rollout_s", "scoring_s", "update_s",
                "reward/correct"]:
        assert key in lines[0], key
    assert sum(r["tool_calls_per_episode"] for r in lines) > 0  # tool calls were made and executed
    trained(lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"]["success"] <= 1.0 and 0.0 <= summary["eval_after"]["success"] <= 1.0
    assert summary["seconds_per_step"] > 0
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actloop.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.model_type == "llama"
    base = load_file(str(Path(resolve_model("smollm2-135m-instruct")) / "model.safetensors"))
    assert changed_tensors(base, model.state_dict()) > 100  # the final weights are trained ones
    # `actloop eval` reads the run directory's final checkpoint
    res = json.loads(run_cli("eval", "--model", str(run_dir), "--n", "2", "--max-new-tokens", "16", "--json").strip().splitlines()[-1])
    assert res["n"] == 2 and 0.0 <= res["success"] <= 1.0


@pytest.mark.slow
def test_train_custom_jsonl_with_blog_reward(tmp_path):
    rows, funcs = blog_data(tmp_path)
    run_cli("train", *TINY, f"output_dir={tmp_path}", "run_name=custom", f"data.path={rows}",
            f"reward.funcs={funcs}", "train.beta=0.04")
    lines = finite_metrics(tmp_path / "custom")
    assert all(-1.0 <= r["reward_mean"] <= 2.5 for r in lines) and "reward/reasoning_reward_func" in lines[0]
    trained(lines)
    assert lines[1]["kl"] > 0  # step 2 samples from updated weights: the policy moved off the reference


@pytest.mark.slow
def test_train_lora_tiny(tmp_path):
    pytest.importorskip("peft")
    rows, funcs = blog_data(tmp_path)
    run_cli("train", *TINY, "train.eval_before=false", "train.eval_after=false", "lora.enabled=true", "lora.r=4",
            "train.beta=0.04", f"output_dir={tmp_path}", "run_name=lora", f"data.path={rows}",
            f"reward.funcs={funcs}")
    lines = finite_metrics(tmp_path / "lora")
    assert len(lines) == 2
    assert (tmp_path / "lora" / "final" / "adapter_config.json").exists()
    trained(lines)
    from safetensors.torch import load_file  # LoRA's B matrices start at zero: a trained adapter moved them

    adapter = load_file(str(tmp_path / "lora" / "final" / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)


def test_malformed_data_row_fails_with_file_and_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "ok", "answer_keys": "1"}\n{"prompt": 3}\n')
    proc = subprocess.run([sys.executable, "-m", "actloop", "train", f"data.path={rows}",
                           "reward.funcs=[actloop.tasks.calculator:used_tool]", f"output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"{rows}:2" in (proc.stdout + proc.stderr)


ALGO_VARIANTS = {
    "ppo_head_kl_reward": ["algo=ppo", "train.beta=0.05", "kl.mode=reward"],
    "ppo_separate_critic": ["algo=ppo", "ppo.critic=separate"],
    "reinforce_pp_token_kl_reward": ["algo=reinforce_pp_token", "train.beta=0.05", "kl.mode=reward"],
    "rloo_gspo_two_epochs": ["algo=rloo", "train.policy_loss=gspo", "train.epochs=2", "train.minibatch_size=2"],
    "reinforce_pp_dapo": ["algo=reinforce_pp", "train.loss_agg=token_mean", "train.clip_high=0.28",
                          "train.dynamic_sampling=true", "train.overlong_buffer=8", "train.entropy_coef=0.01",
                          "train.beta=0.05", "kl.controller=adaptive", "correction.mode=mis_seq"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGO_VARIANTS))
def test_online_algorithms_tiny(tmp_path, name, tiny_qwen3_dir):
    """Each online algorithm completes two steps on the blog reward (which varies within a group)
    with finite metrics and the keys its maths reports, on the tiny random Qwen3
    (tests/fixtures/tiny_models.py): the five took 6 minutes of `make test` on the embedded model,
    whose learning the calculator tests above and tests/train/test_update_learns.py cover."""
    rows, funcs = blog_data(tmp_path)
    run_cli("train", *TINY, f"model={tiny_qwen3_dir}", "train.group_size=4", "train.eval_before=false",
            "train.eval_after=false", "train.save_final=false", f"output_dir={tmp_path}", "run_name=r",
            f"data.path={rows}", f"reward.funcs={funcs}", *ALGO_VARIANTS[name])
    lines = finite_metrics(tmp_path / "r")
    assert len(lines) == 2
    trained(lines)
    for r in lines:  # correction metrics exist whenever something was trained (all-equal groups train nothing)
        assert "is_ratio_mean" in r or not r["trained_trajectories"]
    if "algo=ppo" in ALGO_VARIANTS[name]:
        assert "value_loss" in lines[0]
    if "train.beta=0.05" in ALGO_VARIANTS[name]:
        assert any(r["kl"] > 0 for r in lines)


def test_help_keeps_its_square_brackets():
    # rich markup read `[key=value ...]` as a style tag and printed nothing for it
    from typer.testing import CliRunner

    from actloop.cli import app

    out = CliRunner().invoke(app, ["train", "--help"])
    assert out.exit_code == 0
    text = " ".join(out.output.split())
    assert "[CONFIG.yaml] [key=value ...]" in text and "resume=RUN_DIR [key=value ...]" in text
