"""The Ray path on a local CPU Ray session: rollout actors sample what the trainer would score
(on-policy check), follow weight syncs, drive a tiny training run through the same loop, and
sandbox actors return the local ExecResult with its limits enforced. One Ray session for the
module (startup is slow here); every actor uses one torch thread."""

import copy
import dataclasses
import json
import math

import pytest
import torch

from actloop.rollout.ray_engine import shard_bounds

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'actloop[ray]')")

FP32_TOL = 1e-3  # as tests/rollout/test_engine.py: fp32 engine vs fp32 trainer


def test_shard_bounds_contiguous_and_balanced():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError):
        shard_bounds(3, 0)


def test_a_call_killed_by_rays_memory_monitor_counts_as_a_dead_actor():
    from actloop.rollout.ray_engine import _actor_died

    assert _actor_died(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."))
    assert _actor_died(ray.exceptions.ActorDiedError()) and _actor_died(ray.exceptions.ActorUnavailableError("gone", None))
    assert not _actor_died(ray.exceptions.RayTaskError("load_weights", "Traceback ...", ValueError("bad shape")))
    assert not _actor_died(ValueError("bad shape"))


def _cfg(tmp, *extra):
    from actloop.config import load_config

    return load_config(None, ["train.threads=1", "ray.num_rollout_workers=1", "ray.cpus_per_worker=1",
                              "data.train_size=20", "data.eval_size=2", f"output_dir={tmp}", *extra])


@pytest.mark.slow
def test_ray_worker_logprobs_match_trainer_and_follow_sync(ray_session, fp32_model, tmp_path):
    from actloop.tasks.calculator import make_splits
    from actloop.rollout.engine import SamplingParams
    from actloop.rollout.ray_engine import RayEngine
    from actloop.train.numerics.logprobs import token_logprobs

    engine = RayEngine.from_config(_cfg(tmp_path, "train.precision=fp32"))
    try:
        assert ray.get(engine.workers[0].ready.remote())["threads"] == 1
        policy = copy.deepcopy(fp32_model)
        with torch.no_grad():  # weights the worker has never seen: only a sync can give them to it
            policy.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        engine.sync_weights(policy)
        _, held = make_splits(0, 4, seed=0)
        torch.manual_seed(0)
        trajs = engine.run_episodes(held, SamplingParams(max_new_tokens=16, temperature=1.0), max_turns=2)
        assert len(trajs) == 4 and all(t.error is None for t in trajs)
        assert sum(t.num_response_tokens for t in trajs) > 10

        def max_diff(model):
            out = token_logprobs(model, [t.input_ids for t in trajs], [t.loss_mask for t in trajs], temperature=1.0,
                                 precision="fp32")
            diffs = []
            for i, t in enumerate(trajs):
                eng = torch.tensor([lp for lp, m in zip(t.logprobs[1:], t.loss_mask[1:]) if m])
                diffs.append((eng - out.logp[i][out.mask[i]]).abs())
            return float(torch.cat(diffs).max())

        with torch.no_grad():
            assert max_diff(policy) < FP32_TOL  # on-policy: the synced worker samples what the trainer scores
            assert max_diff(fp32_model) > 10 * FP32_TOL  # and not from its stale initial weights

        # generate() shards prompts across workers and keeps their order
        comps = engine.generate([t.prompt_ids for t in trajs[:3]], SamplingParams(max_new_tokens=4, greedy=True))
        assert len(comps) == 3 and all(1 <= len(c.token_ids) <= 4 for c in comps)
    finally:
        engine.close()


@pytest.mark.slow
def test_train_through_ray_same_loop(ray_session, tmp_path, monkeypatch):
    from actloop.train.trainer import train

    import actloop.rewards.code as code
    from actloop.rollout.ray_engine import RayEngine
    from actloop.sandbox.ray_pool import RaySandbox

    graders, original = [], RayEngine.run_episodes

    def run_episodes(self, *a, **k):  # what the code graders run on, at each step
        sandbox = code.default_sandbox()
        graders.append(sandbox.run("print(1 + 1)").stdout if isinstance(sandbox, RaySandbox) else type(sandbox).__name__)
        return original(self, *a, **k)

    monkeypatch.setattr(RayEngine, "run_episodes", run_episodes)

    # 40 new tokens: the embedded model can finish a calculator tool call on the workers (12 never did)
    cfg = _cfg(tmp_path, "rollout.engine=ray", "train.steps=2", "train.prompts_per_step=2", "train.group_size=4",
               "rollout.max_new_tokens=40", "rollout.max_turns=2", "train.eval_before=false", "train.eval_after=false",
               "train.save_final=false", "checkpoint.at_end=false", "run_name=ray", "ray.num_sandbox_workers=1",
               "train.entropy_coef=0.01")  # every trajectory trains, even when all of a group's rewards are equal
    try:
        res = train(cfg, progress=False, print_fn=lambda *a: None)
        assert graders == ["2\n", "2\n"]  # during the run the code graders' sandbox was the actors' ...
        assert not isinstance(code._DEFAULT_SANDBOX, RaySandbox)  # ... and the closed run handed it back
    finally:
        code._DEFAULT_SANDBOX = None
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["response_tokens"] > 0 and r["gen_tokens_per_s"] > 0
        assert r["failed_rollouts"] == 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    assert sum(r["tool_calls_per_episode"] for r in lines) > 0  # the workers' episodes made tool calls
    assert sum(r["trained_trajectories"] for r in lines) > 0  # and the driver trained on them
    assert res.summary["generated_tokens_per_s"] > 0


@pytest.mark.slow
def test_ray_sandbox_matches_local_shape_and_limits(ray_session):
    from actloop.sandbox import Limits, get_sandbox
    from actloop.sandbox.base import ExecResult
    from actloop.sandbox.ray_pool import RaySandbox

    sb = RaySandbox(1, cpus_per_worker=0)
    try:
        local = get_sandbox()
        r, lr = sb.run("print(6 * 7)"), local.run("print(6 * 7)")
        assert isinstance(r, ExecResult) and r.stdout == lr.stdout == "42\n" and r.exit_code == 0 and r.ok
        assert r.tier == lr.tier == sb.tier and sb.isolated == local.isolated
        assert [f.name for f in dataclasses.fields(r)] == [f.name for f in dataclasses.fields(lr)]
        from actloop.sandbox import clock

        before = clock.totals()
        slow = sb.run("while True: pass", limits=Limits(timeout_s=1.0))
        assert slow.timed_out and not slow.ok
        after = clock.totals()  # the driver counts the actor's run in the step's sandbox_s
        assert after["runs"] - before["runs"] == 1 and after["timeouts"] - before["timeouts"] == 1
        assert after["seconds"] - before["seconds"] >= 0.9
        big = sb.run("x = bytearray(400 * 1024 * 1024)", limits=Limits(memory_mb=128))
        assert big.oom and big.exit_code != 0
        echo = sb.run(argv=["python", "main2.py"], files={"main2.py": "import sys; print(sys.stdin.read()[::-1])"},
                      stdin="abc")
        assert echo.stdout == "cba\n"
        with pytest.raises(ValueError):
            sb.run()  # neither code nor argv: refused on the driver, as locally
    finally:
        sb.close()
