"""Fault injection on checkpoints and run directories: a full disk, a kill at every point of a
checkpoint's install, two runs into one directory. Each test states what was lost (nothing) and
what was reported."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from actloop.config import ConfigError, load_config
from actloop.train.runtime import checkpoint, rundir

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int = 0, n: int = 200) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(n, n)  # 40k parameters: a checkpoint of about 0.5 MB with AdamW state


def _state(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()
    return {"optimizer": opt.state_dict()}


_REAL_SAVE = torch.save


def _to_dev_full(obj, path):
    """torch.save's bytes written to /dev/full instead of `path`: a real ENOSPC from the kernel."""
    import io

    buf = io.BytesIO()
    _REAL_SAVE(obj, buf)
    with open("/dev/full", "wb") as f:
        f.write(buf.getvalue())


def _same_weights(ckpt: checkpoint.Checkpoint, model: torch.nn.Module) -> bool:
    fresh = _model(seed=99, n=model.in_features)
    ckpt.load_policy(fresh)
    return all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


# --- ENOSPC -------------------------------------------------------------------------------------

ENOSPC_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from actloop.train.runtime import checkpoint
    run = sys.argv[1]
    torch.manual_seed(0)
    m = torch.nn.Linear(200, 200)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(1, 200)).sum().backward(); opt.step()
    checkpoint.save(run, 1, m, {"optimizer": opt.state_dict()}, keep=1)
    w1 = m.weight.detach().clone()
    m(torch.ones(1, 200)).sum().backward(); opt.step()
    try:
        checkpoint.save(run, 2, m, {"optimizer": opt.state_dict()}, keep=1)
        err = None
    except checkpoint.CheckpointError as e:
        err = str(e)
    import os
    latest = checkpoint.load_latest(run)
    fresh = torch.nn.Linear(200, 200)
    latest.load_policy(fresh)
    print(json.dumps({"error": err, "latest": latest.step, "state_step": latest.load_state()["step"],
                      "intact": bool(torch.equal(fresh.weight, w1)),
                      "left": sorted(os.listdir(run + "/checkpoints"))}))
""")


def test_enospc_on_a_full_tmpfs_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk: a 700 KiB tmpfs (mounted in a user+mount namespace) holds one checkpoint
    of ~0.5 MB; writing the second runs out of space half-way."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "enospc.py"
    script.write_text(ENOSPC_SCRIPT)
    cmd = ["unshare", "-rm", "sh", "-c",
           f"mount -t tmpfs -o size=700k tmpfs {mnt} && exec {sys.executable} {script} {mnt}/run {ROOT}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode and "mount" in res.stderr and "Traceback" not in res.stderr:
        pytest.skip(f"cannot mount a tmpfs here (no unprivileged user namespaces?): {res.stderr.strip()[:200]}")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # reported: what failed, why, and which checkpoint is intact
    assert "step 2" in out["error"] and "no space left on device" in out["error"]
    assert "previous checkpoint (step 1" in out["error"] and "resume=" in out["error"]
    # lost: nothing; the half-written step 2 is gone, step 1 loads with its weights
    assert out["latest"] == 1 and out["state_step"] == 1 and out["intact"]
    assert out["left"] == ["step-000001"]


def test_enospc_from_dev_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The same on any machine without mounts: step 2's state.pt is written to /dev/full (the
    kernel answers ENOSPC)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    model = _model()
    checkpoint.save(tmp_path, 1, model, _state(model), keep=1)
    before = _model()
    before.load_state_dict(model.state_dict())
    monkeypatch.setattr(checkpoint.torch, "save", _to_dev_full)
    model.weight.data += 1
    with pytest.raises(checkpoint.CheckpointError, match=r"step 2 .*no space left.*previous checkpoint \(step 1"):
        checkpoint.save(tmp_path, 2, model, _state(model), keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000001"]
    assert _same_weights(checkpoint.load_latest(tmp_path), before)


@pytest.mark.slow
def test_trainer_stops_with_a_clear_message_when_the_disk_fills(tmp_path, monkeypatch, tiny_qwen3_dir):
    """In a real run (LoRA on the tiny random Qwen3: small checkpoints, quick steps), step 2's
    checkpoint hits ENOSPC: the run stops with RunAborted naming the intact step-1 checkpoint,
    summary.json says why, and it resumes."""
    from actloop.train import trainer
    from actloop.train.runtime.failures import RunAborted

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}]}) + "\n" for i in range(8)))
    (tmp_path / "rew.py").write_text("def varied(prompts, completions, **kw):\n"
                                     "    return [len(set(c)) / 10 for c in completions]\n")
    cfg = load_config(None, [f"model={tiny_qwen3_dir}", f"data.path={rows}", f"reward.funcs=[{tmp_path}/rew.py:varied]",
                             "train.steps=3",
                             "train.prompts_per_step=1", "train.group_size=2", "rollout.max_new_tokens=4",
                             "rollout.max_turns=1", "train.eval_before=false", "train.eval_after=false",
                             "train.save_final=false", "train.threads=1", "train.beta=0", "lora.enabled=true",
                             "checkpoint.every=1", f"output_dir={tmp_path}", "run_name=full", "monitor.sample_every=0"])
    real, calls = _REAL_SAVE, []

    def fill_on_second(obj, path):
        calls.append(path)
        return _to_dev_full(obj, path) if len(calls) == 2 else real(obj, path)

    monkeypatch.setattr(checkpoint.torch, "save", fill_on_second)
    with pytest.raises(RunAborted, match=r"step 2 .*no space left.*previous checkpoint \(step 1"):
        trainer.train(cfg, progress=False, print_fn=lambda *_: None)
    run = tmp_path / "full"
    assert [c.step for c in checkpoint.list_checkpoints(run)] == [1]
    assert json.loads((run / "summary.json").read_text())["stopped"]["step"] == 2
    monkeypatch.setattr(checkpoint.torch, "save", real)
    res = trainer.train(checkpoint.resume_config(run), progress=False, print_fn=lambda *_: None)
    assert [c.step for c in checkpoint.list_checkpoints(res.run_dir)] == [3]
    lines = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3]  # step 2 was logged before its checkpoint failed; the resume redoes it once


# --- a kill at each point of an install -----------------------------------------------------------

# `python save.py RUN STEP REPO [N]`: save checkpoint STEP, SIGKILLed right after the N-th rename of
# the install (the fault injected from outside: checkpoint.py has no test hook)
KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[3])
    from actloop.train.runtime import checkpoint
    if len(sys.argv) > 4:
        real, done = os.replace, []
        def replace(a, b):
            real(a, b)
            done.append(b)
            if len(done) == int(sys.argv[4]):
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.os.replace = replace
    torch.manual_seed(int(sys.argv[2]))
    m = torch.nn.Linear(200, 200)
    checkpoint.save(sys.argv[1], int(sys.argv[2]), m, {}, keep=1)
""")


def _save_in_subprocess(tmp_path: Path, run: Path, step: int, kill_after_renames: int = 0) -> int:
    script = tmp_path / "save.py"
    script.write_text(KILL_SCRIPT)
    kill = [str(kill_after_renames)] if kill_after_renames else []
    return subprocess.run([sys.executable, str(script), str(run), str(step), str(ROOT), *kill],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120).returncode


@pytest.mark.parametrize("crash", ["after_aside", "after_rename"])  # after the 1st / 2nd rename
def test_a_kill_while_replacing_a_checkpoint_never_leaves_none(tmp_path, crash):
    """keep=1, the same step written again (a resumed run that re-reaches it): the old copy is
    renamed aside, the new one renamed in, then the old deleted. SIGKILL between any two of
    those leaves a complete checkpoint that loads."""
    run = tmp_path / "run"
    assert _save_in_subprocess(tmp_path, run, 3) == 0
    assert _save_in_subprocess(tmp_path, run, 3, 1 if crash == "after_aside" else 2) == -9  # SIGKILLed mid-install
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    found = checkpoint.list_checkpoints(run)
    assert [c.step for c in found] == [3], names
    torch.manual_seed(3)
    assert _same_weights(found[0], torch.nn.Linear(200, 200))  # both copies hold step 3's weights
    if crash == "after_aside":  # only the old copy (aside) and the unfinished new one are on disk
        assert any(".old-" in n for n in names) and any(".tmp-" in n for n in names) and "step-000003" not in names
    # the next save clears what the dead writer left
    assert _save_in_subprocess(tmp_path, run, 4) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004"]


def test_a_kill_after_installing_a_new_step_keeps_both_until_pruned(tmp_path):
    run = tmp_path / "run"
    assert _save_in_subprocess(tmp_path, run, 1) == 0
    assert _save_in_subprocess(tmp_path, run, 2, 1) == -9  # the new one renamed in place, the old not yet pruned
    assert [c.step for c in checkpoint.list_checkpoints(run)] == [1, 2]
    assert checkpoint.load_latest(run).step == 2
    assert _save_in_subprocess(tmp_path, run, 3) == 0
    assert [c.step for c in checkpoint.list_checkpoints(run)] == [3]


def test_final_dir_is_replaced_only_once_the_new_one_is_complete(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_text("old")
    tmp = tmp_path / "final.tmp-1"
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    checkpoint.install(tmp, final)
    assert (final / "model.safetensors").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


# --- two runs into one directory ----------------------------------------------------------------

HOLD_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from actloop.train.runtime import rundir
    rundir.claim(sys.argv[1])
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_second_run_into_a_held_directory_fails_at_once_naming_the_holder(tmp_path):
    from actloop.train.runtime.run import make_run_dir, open_run

    script = tmp_path / "hold.py"
    script.write_text(HOLD_SCRIPT)
    run = tmp_path / "runs" / "shared"
    holder = subprocess.Popen([sys.executable, str(script), str(run), str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = load_config(None, [f"output_dir={tmp_path / 'runs'}", "run_name=shared"])
        with pytest.raises(rundir.RunDirInUse, match=rf"in use by another run: pid {holder.pid} on "):
            make_run_dir(cfg)
        with pytest.raises(rundir.RunDirInUse, match=rf"pid {holder.pid}"):  # --overwrite cannot take it either
            make_run_dir(load_config(None, [f"output_dir={tmp_path / 'runs'}", "run_name=shared", "overwrite=true"]))
        (run / "config.yaml").write_text(cfg.to_yaml())
        checkpoint.save(run, 1, torch.nn.Linear(2, 2), {}, keep=1)
        with pytest.raises(rundir.RunDirInUse, match=rf"pid {holder.pid}"):  # nor a resume
            open_run(checkpoint.resume_config(run), print_fn=lambda *_: None)
    finally:
        holder.kill()
        holder.wait()
    # lost: nothing; the holder's files are untouched, and once it is gone (SIGKILL: the kernel
    # dropped its lock) the directory can be resumed
    assert checkpoint.load_latest(run).step == 1
    run_dir, ckpt = open_run(checkpoint.resume_config(run), print_fn=lambda *_: None)
    assert ckpt.step == 1
    rundir.release()


def test_an_existing_run_name_is_refused_unless_overwrite(tmp_path):
    from actloop.train.runtime.run import make_run_dir

    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=r"])
    run = make_run_dir(cfg)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    rundir.release()
    with pytest.raises(ConfigError, match=r"already exists \(it holds config.yaml, metrics.jsonl\).*--overwrite"):
        make_run_dir(cfg)
    assert (run / "metrics.jsonl").exists()  # refused: nothing touched
    # a directory left holding only config.yaml (a run that failed at start) is refused too
    other = tmp_path / "half"
    other.mkdir()
    (other / "config.yaml").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        make_run_dir(load_config(None, [f"output_dir={tmp_path}", "run_name=half"]))
    again = make_run_dir(load_config(None, [f"output_dir={tmp_path}", "run_name=r", "overwrite=true"]))
    assert sorted(p.name for p in again.iterdir()) == [".lock", "config.yaml"]
    assert "overwrite: false" in (again / "config.yaml").read_text()  # a resume of it never overwrites
    rundir.release()


def test_cli_overwrite_flag(tmp_path):
    """`actloop train` into a used run_name: exit 2 with the message; the flag is accepted."""
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "actloop", "train", f"output_dir={tmp_path}", "run_name=r",
                          "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 2 and "already exists" in res.stdout + res.stderr, res.stdout[-2000:]
    assert "--overwrite" in (res.stdout + res.stderr)
