"""A real tiny run (2 steps of the calculator task on the embedded model, eval off) watched by the
Monitor, then `actloop report` on its directory."""

from __future__ import annotations

import json
import re

import pytest

from actloop.config import load_config
from actloop.monitor.report import build_report


@pytest.mark.slow
def test_real_run_then_report(tmp_path):
    from actloop.train.trainer import train

    cfg = load_config(None, [
        f"output_dir={tmp_path}", "run_name=calc", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
        "data.train_size=8", "data.eval_size=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
        "train.eval_before=false", "train.eval_after=false", "train.save_final=false", "train.threads=1",
        "monitor.sample_every=2", "monitor.samples_per_step=2", "checkpoint.every=0", "checkpoint.at_end=false"])
    printed = []
    result = train(cfg, progress=False, print_fn=lambda m: printed.append(str(m)))
    run = result.run_dir
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("response_tokens_per_episode", "hack_flag_rate", "total/tokens", "tokens_per_s",
                "time/rollout_frac", "time/update_frac", "total/step_s"):
        assert key in metrics[1], key
    assert metrics[1]["total/response_tokens"] == metrics[0]["response_tokens"] + metrics[1]["response_tokens"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]  # step 1, then every 2 steps
    assert all(any(m["role"] == "assistant" for m in s["messages"]) for s in samples)
    assert result.summary["monitor"]["total_step_s"] > 0

    page = build_report(run)
    text = page.read_text()
    # KL is not measured without a reference model (train.beta=0); entropy and grad norm only on
    # steps that trained something (a step whose groups all had equal rewards trains nothing)
    expected = {"reward", "success", "length", "flags", "time"}
    if any(m["trained_trajectories"] > 0 for m in metrics):
        expected |= {"entropy", "grad_norm"}
    assert {p.stem for p in (run / "report").glob("*.png")} == expected
    assert len(re.findall(r"<img [^>]*src='data:image/png;base64,", text)) == len(expected)
    for name in expected:
        assert (run / "report" / f"{name}.png").stat().st_size > 5000, name
    assert "Sample trajectories (4)" in text and "calculator" in text
    assert not (run / "report" / "kl.png").exists() and "kl" in re.search("not recorded in this run: ([^<]*)", text)[1]
