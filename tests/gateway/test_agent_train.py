"""`actloop train agent.entry=...`: agent code trained through the gateway, failures masked."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="agent training needs the `agents` extra")
pytest.importorskip("fastapi", reason="agent training needs the `agents` extra")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"


def tiny(tmp_path, entry, rows=EXAMPLES / "rows.jsonl", *extra):
    return ["train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "rollout.max_new_tokens=24",
            f"agent.entry={entry}", f"data.path={rows}", "data.eval_size=2", "train.eval_before=false",
            "train.eval_after=false", "train.eval_every=0", "train.save_final=false", "checkpoint.at_end=false",
            "checkpoint.every=0", "train.threads=1", "agent.timeout_s=60", f"output_dir={tmp_path}", "run_name=r",
            *extra]


def train(args):
    from actloop.config import load_config
    from actloop.train.trainer import train as run_train

    res = run_train(load_config(None, args), progress=False, print_fn=lambda *a: None)
    return res, [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]


def check_trained(metrics):
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["gateway/calls"] >= 4 for m in metrics)  # every episode called the model
    assert sum(m["trained_trajectories"] for m in metrics) > 0
    assert all(m["failed_rollouts"] == 0 for m in metrics)


@pytest.mark.slow
def test_plain_openai_tool_loop_trains(tmp_path):
    _, metrics = train(tiny(tmp_path, EXAMPLES / "openai_tool_loop.py:run"))
    check_trained(metrics)


@pytest.mark.slow
def test_agent_trains_with_rollouts_ahead_of_training(tmp_path):
    """rollout.max_staleness=1: the agent's episodes run on the producer's threads, through a gateway
    of their own; every token's version reaches the trajectory through the gateway's capture."""
    res, metrics = train(tiny(tmp_path, EXAMPLES / "openai_tool_loop.py:run", EXAMPLES / "rows.jsonl",
                              "rollout.max_staleness=1", "train.steps=3", "monitor.sample_every=1"))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["gateway/calls"] >= 4 and m["staleness_max"] <= 1 for m in metrics)
    assert sum(m["trained_trajectories"] for m in metrics) > 0
    samples = [json.loads(x) for x in (res.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("version_first" in s and s["staleness"] <= 1 for s in samples)


BAD_AGENT = '''
import asyncio

async def run(client, row):
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}],
                                             max_tokens=4)
    if row["mode"] == "raise":
        raise RuntimeError("agent bug")
    if row["mode"] == "hang":
        await asyncio.sleep(3600)
    if row["mode"] == "garbage":
        return "not a number"
    if row["mode"] == "dict":
        return {"reward": 0.5 + 0.1 * len(r.choices[0].message.content or "") % 3, "turns": 1}
    return float(len(r.choices[0].message.content or "") % 2)
'''


@pytest.mark.slow
def test_agents_that_raise_hang_or_return_garbage_are_recorded_and_masked(tmp_path):
    agent = tmp_path / "bad_agent.py"
    agent.write_text(BAD_AGENT)
    rows = tmp_path / "rows.jsonl"
    modes = ["raise", "hang", "garbage", "ok", "dict", "ok"]  # one pass: each row once
    rows.write_text("".join(json.dumps({"id": f"r{i}", "question": "Say hi.", "mode": m}) + "\n"
                            for i, m in enumerate(modes)))
    args = tiny(tmp_path, f"{agent}:run", rows, "train.prompts_per_step=6", "train.group_size=1", "algo=reinforce_pp", "train.steps=1",
                "data.eval_size=0", "agent.timeout_s=5", "failures.max_bad_steps=0")
    res, metrics = train(args)
    failures = [json.loads(x) for x in (res.run_dir / "failures.jsonl").read_text().splitlines()]
    env = [f for f in failures if f["kind"] == "env"]
    text = " ".join(f["message"] + (f["traceback"] or "") for f in env)
    assert len(env) == 3 and all(f["masked"] for f in env)
    assert "agent bug" in text and "timed out after 5 s" in text and "expected a finite number" in text
    assert metrics[0]["failed_rollouts"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("example,module", [("openai_agents_sdk.py", "agents"), ("langgraph_agent.py", "langgraph"),
                                            ("mcp_agent.py", "mcp"), ("verifiers_env.py", "verifiers")])
def test_framework_agent_trains(tmp_path, example, module):
    pytest.importorskip(module, reason=f"{example} needs `{module}` (the `agents` extra)")
    _, metrics = train(tiny(tmp_path, EXAMPLES / f"{example}:run"))
    check_trained(metrics)


@pytest.mark.slow
def test_actloop_eval_runs_an_agent_through_the_gateway(tmp_path):
    import subprocess

    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "actloop", "eval", "--agent",
                           f"{EXAMPLES / 'openai_tool_loop.py'}:run", "--data", str(EXAMPLES / "rows.jsonl"), "--n", "2",
                           "--max-new-tokens", "16", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["task"] == "agent" and res["n"] == 2 and res["masked"] == 0
