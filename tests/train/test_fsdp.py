"""Several processes (torchrun, gloo on CPU, FSDP2) train exactly like one process.

The two slow tests launch `python -m torch.distributed.run --standalone --nproc_per_node 2`
(a free port each time) with one thread per process, on the embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actloop.config import ConfigError, load_config
from actloop.train.runtime.distributed import Dist, ShardedSampler, check_supported, init_distributed, launched_by_torchrun
from actloop.data.sampler import PromptSampler

REPO = Path(__file__).resolve().parents[2]


def torchrun(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


# ---- one process: everything is a no-op -------------------------------------------------------


def test_one_process_is_a_no_op():
    cfg = load_config(None, [])
    d = init_distributed(cfg, env={})
    assert (d.rank, d.world, d.is_main, d.active, d.fsdp) == (0, 1, True, False, False)
    assert d.shard([1, 2, 3]) == [1, 2, 3] and d.sum_ints(3, 4.5) == (3, 4.5) and d.max_int(7) == 7
    assert d.gather_lists([1]) == [1] and d.first(None) is None and d.missing(3) == 0
    sampler = PromptSampler([{"i": i} for i in range(5)], 0)
    assert d.sampler(sampler) is sampler


def test_torchrun_detection_needs_all_three_variables_and_two_ranks():
    assert launched_by_torchrun({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert not launched_by_torchrun({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert not launched_by_torchrun({"WORLD_SIZE": "2"})


def test_ranks_get_contiguous_blocks_of_the_one_process_prompts():
    rows = [{"i": i} for i in range(50)]
    one = PromptSampler(rows, 3)
    ranks = [ShardedSampler(PromptSampler(rows, 3), Dist(rank=r, world=2)) for r in range(2)]
    for _ in range(30):  # several shuffled passes
        want = one.next(4)
        assert ranks[0].next(4) + ranks[1].next(4) == want
    with pytest.raises(ValueError, match="evenly"):
        Dist(rank=0, world=2).shard([1, 2, 3])


def test_unsupported_settings_are_refused_with_the_reason():
    check_supported(load_config(None, ["train.prompts_per_step=4"]), 2)  # the defaults run
    cases = {
        "train.prompts_per_step=3": "multiple of the world size",
        "algo=ppo": "only grpo and rloo",
        "train.adv_scale=batch": "whole batch",
        "train.minibatch_size=8": "minibatch_size must be 0",
        "lora.enabled=true": "lora",
    }
    for override, msg in cases.items():
        with pytest.raises(ConfigError, match=msg):
            check_supported(load_config(None, [override]), 2)


def test_offline_algorithms_refuse_torchrun(monkeypatch):
    from actloop.train.trainer import train

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="without torchrun"):
        train(load_config(None, ["algo=sft"]))


# ---- two processes on the embedded model ------------------------------------------------------


# The fixed batch of tests/fixtures/dist_check.py: 4 groups x 2 trajectories, the last with equal rewards.
# Two ranks hold two groups each: rank 1 has one micro-batch to train, rank 0 two, so rank 1 runs
# one zero-loss pass to match rank 0's collectives. SGD, so that the weight change is the
# (clipped) gradient itself; 2 steps.
CHECK = ["--prompts", "4", "--group-size", "2", "--flat", "3", "--optimizer", "sgd"]
CHECK_CFG = ["train.micro_batch_size=2", "train.lr=0.1"]


@pytest.fixture(scope="module")
def one_process():
    from fixtures.dist_check import run

    threads = torch.get_num_threads()
    try:
        return run(CHECK_CFG, steps=2, prompts=4, group_size=2, optimizer="sgd", flat=(3,))
    finally:
        torch.set_num_threads(threads)


def two_processes(tmp_path, *overrides):
    torchrun([str(REPO / "tests" / "fixtures" / "dist_check.py"), "--out", str(tmp_path / "two.pt"), *CHECK, "--", *CHECK_CFG,
              *overrides], cwd=tmp_path)
    return torch.load(tmp_path / "two.pt", weights_only=False)


def check_same_metrics(one, two, rel):
    assert one["world"] == 1 and two["world"] == 2
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m1["trained_trajectories"] == m2["trained_trajectories"] == 6
        assert m1["optimizer_steps"] == m2["optimizer_steps"] == 1
        # the global gradient norm: the summed gradient of the ranks is the one-process gradient
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=rel)
        assert m2["entropy"] == pytest.approx(m1["entropy"], rel=rel)
        assert abs(m2["pg_loss"] - m1["pg_loss"]) < 1e-6
    assert one["metrics"][0]["grad_norm"] > 1.0  # clipped: the clip used the global norm


@pytest.mark.slow
def test_two_process_fsdp_update_matches_one_process(one_process, tmp_path):
    from fixtures.dist_check import compare

    two = two_processes(tmp_path)
    check_same_metrics(one_process, two, rel=2e-4)  # measured: grad norm 2e-5, entropy 1.2e-6
    # measured here: max |diff| 8.5e-7 for a max change of 0.015 (5.8e-5 relative), worst tensor 2.3e-3
    # (1 ulp), mean |diff| 6e-11 -- float noise: FSDP's gathered weights live in other buffers (the
    # first forward already differs by 1e-6), while the same run replicated is bit-identical (below)
    d = compare(one_process, two)
    print("two-process FSDP vs one process:", d)
    assert d["max_weight_change"] > 1e-3, d  # the weights moved ...
    assert d["rel_weight_diff"] < 5e-4 and d["worst_tensor_rel_diff"] < 2e-2, d  # ... the same way
    assert d["mean_abs_weight_diff"] < 1e-6 * d["max_weight_change"], d


@pytest.mark.slow
def test_two_process_replicated_update_is_bit_identical(one_process, tmp_path):
    """distributed.fsdp=false: full weights on each rank, gradients all-reduced (summed) before the
    clip: the same floats as one process, to the last bit."""
    from fixtures.dist_check import compare

    two = two_processes(tmp_path, "distributed.fsdp=false")
    check_same_metrics(one_process, two, rel=0)
    d = compare(one_process, two)
    assert d["max_abs_weight_diff"] == 0.0 and d["max_weight_change"] > 1e-3, d


@pytest.mark.slow
def test_torchrun_train_writes_one_run_from_rank_0(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Name a colour ({i})."}]}) + "\n"
                            for i in range(8)))
    (tmp_path / "rew.py").write_text("def length(prompts, completions, **kw):\n"
                                     "    return [len(c) / 10 for c in completions]\n")
    out = tmp_path / "runs"
    torchrun(["-m", "actloop", "train", "--no-progress", f"data.path={rows}", f"reward.funcs=[{tmp_path}/rew.py:length]",
              "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "rollout.max_new_tokens=8",
              "rollout.max_turns=1", "train.eval_before=false", "train.eval_after=false", "train.threads=1",
              f"output_dir={out}", "run_name=r", "monitor.sample_every=0", "checkpoint.at_end=false"], cwd=tmp_path)
    assert [p.name for p in out.iterdir()] == ["r"]  # rank 1 wrote nothing here
    lines = [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(r["source/default/n"] == 4 for r in lines)  # both ranks' trajectories in rank 0's record
    assert sum(r["trained_trajectories"] for r in lines) > 0 and all(r["grad_norm"] >= 0 for r in lines)
    final = out / "r" / "final" / "model.safetensors"
    assert final.exists() and final.stat().st_size < 600e6  # one copy of the tied embeddings
    assert json.loads((out / "r" / "summary.json").read_text())["seconds_per_step"] > 0
