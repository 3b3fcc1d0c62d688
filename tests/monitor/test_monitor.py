"""The Monitor facade: what it adds to a record, the files it writes, sinks that fail, resume."""

from __future__ import annotations

import json
import os

import pytest

from actloop.monitor.monitor import Monitor, flag_metrics
from actloop.rewards.flags import Flag

from .conftest import make_batch, make_scored, record


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def batch(step: int):
    hack = (Flag("early_exit", "line 2: sys.exit(0)", action="zero"),)
    infra = (Flag("sandbox_error", "could not start", action="mask"),)
    return make_batch([0.0, 1.0, 0.2, 0.2], [(), hack if step > 2 else (), infra, ()])


def test_flag_metrics_separate_hacks_from_infrastructure():
    m = flag_metrics(batch(3), non_hack=["sandbox_error"])
    assert m == {"flag_rate": 0.5, "hack_flag_rate": 0.25, "flags/early_exit": 1, "flags/sandbox_error": 1}
    # a flag whose policy masked the episode is not a hack even when not listed
    assert flag_metrics([make_scored(0.0, (Flag("judge_error", action="mask"),))], [])["hack_flag_rate"] == 0.0
    assert flag_metrics([], []) == {}


def test_log_step_writes_metrics_samples_and_alarms(cfg, tmp_path):
    printed = []
    mon = Monitor(cfg, tmp_path, print_fn=printed.append)
    for step in range(1, 5):
        rec = record(step, kl=2.0 if step == 3 else 0.01)
        alarms = mon.log_step(rec, batch(step))
        assert rec["response_tokens_per_episode"] == 10.0 and rec["total/step_s"] == 4.0 * step
        assert [a.name for a in alarms] == (["kl_blowup"] if step == 3 else [])
    mon.close()
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[2]["alarm/kl_blowup"] == 1 and not any(k.startswith("alarm/") for k in metrics[3])
    assert metrics[3]["hack_flag_rate"] == 0.25 and metrics[0]["hack_flag_rate"] == 0.0
    assert metrics[3]["total/tokens"] == 4 * 52 and metrics[3]["time/update_frac"] == 0.375
    assert [a["name"] for a in lines(tmp_path / "alarms.jsonl")] == ["kl_blowup"]
    assert printed == ["ALARM step 3 kl_blowup: KL 2 > 0.5"]
    samples = lines(tmp_path / "samples.jsonl")
    # steps 1, 2, 4 (sample_every=2, plus step 1); 3 per step: group 0 best+worst, group 1 best
    assert [(s["step"], s["group"], s["pick"]) for s in samples] == [
        (st, g, p) for st in (1, 2, 4) for g, p in ((0, "best"), (0, "worst"), (1, "best"))]
    best = samples[-3]
    assert best["reward"] == 1.0 and best["flags"][0]["name"] == "early_exit"
    assert best["flags"][0]["evidence"] == "line 2: sys.exit(0)"
    roles = [m["role"] for m in best["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert best["messages"][0]["prompt"] and "prompt" not in best["messages"][2]
    assert best["messages"][2]["tool_calls"] == [{"name": "calculator", "arguments": {"expr": "2+2"}}]
    assert best["row"] == {"answer": 4} and best["components"] == {"correct": 1.0}


def test_no_alarms_file_without_alarms_and_sampling_off(cfg, tmp_path):
    cfg.monitor.sample_every = 0
    mon = Monitor(cfg, tmp_path)
    mon.log_step(record(1), batch(1))
    mon.close()
    assert not (tmp_path / "alarms.jsonl").exists() and not (tmp_path / "samples.jsonl").exists()


class Boom:
    def __init__(self):
        self.calls = 0

    def log(self, record, step):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        raise OSError("still full")


def test_a_failing_sink_is_disabled_with_one_warning(cfg, tmp_path):
    from actloop.monitor.sinks import Guarded

    printed = []
    mon = Monitor(cfg, tmp_path, print_fn=printed.append)
    boom = Boom()
    mon.extra["boom"] = Guarded("boom", boom, printed.append)
    for step in (1, 2, 3):
        mon.log_step(record(step), batch(step))
    mon.close()
    assert boom.calls == 1
    assert len(printed) == 1 and "boom failed (OSError: disk full)" in printed[0]
    assert len(lines(tmp_path / "metrics.jsonl")) == 3  # the JSONL sink went on


def test_a_failing_part_never_stops_the_step(cfg, tmp_path):
    printed = []
    mon = Monitor(cfg, tmp_path, print_fn=printed.append)
    mon.costs.update = lambda r: 1 / 0
    for step in (1, 2):
        mon.log_step(record(step), batch(step))
    assert len(printed) == 1 and "cost monitor failed (ZeroDivisionError" in printed[0]
    assert len(lines(tmp_path / "metrics.jsonl")) == 2


def test_resume_from_state_dict_continues_identically(cfg, tmp_path):
    def recs():
        return [record(s, entropy=1.0 if s < 8 else 0.05, kl=3.0 if s in (4, 5) else 0.01) for s in range(1, 11)]

    one = Monitor(cfg, tmp_path / "one", print_fn=lambda _: None)
    full = [(r, [a.name for a in one.log_step(r, batch(r["step"]))]) for r in recs()]
    a = Monitor(cfg, tmp_path / "two", print_fn=lambda _: None)
    first = [(r, [x.name for x in a.log_step(r, batch(r["step"]))]) for r in recs()[:4]]
    state = json.loads(json.dumps(a.state_dict()))  # a checkpoint holds JSON
    a.close()
    b = Monitor(cfg, tmp_path / "two", print_fn=lambda _: None)
    b.load_state_dict(state)
    rest = [(r, [x.name for x in b.log_step(r, batch(r["step"]))]) for r in recs()[4:]]
    assert first + rest == full
    assert [x.name for x in b.alarms] == [x.name for x in one.alarms] == ["kl_blowup", "entropy_collapse"]
    assert b.summary() == one.summary()


def test_tensorboard_sink_writes_scalars(cfg, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg.monitor.tensorboard = True
    mon = Monitor(cfg, tmp_path)
    for step in (1, 2):
        mon.log_step(record(step, reward_mean=0.25 * step), batch(step))
    mon.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert "total/tokens" in acc.Tags()["scalars"]


def test_tensorboard_after_a_resume_shows_each_step_once(cfg, tmp_path):
    # killed after logging steps 1-3, checkpointed at 2: the resumed run logs 3 and 4 again; the
    # killed run's step 3 must not stay next to the new one (a zig-zag in every plot)
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg.monitor.tensorboard = True
    killed = Monitor(cfg, tmp_path)
    for step in (1, 2, 3):
        killed.log_step(record(step, reward_mean=0.25 * step), batch(step))
    killed.close()
    resumed = Monitor(cfg, tmp_path)
    for step in (3, 4):
        resumed.log_step(record(step, reward_mean=1.0 + step), batch(step))
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 4.0), (4, 5.0)]


def test_wandb_sink_offline(cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg.monitor.wandb_project = "actloop-test"
    mon = Monitor(cfg, tmp_path)
    for step in (1, 2):
        mon.log_step(record(step), batch(step))
    run_id = mon.state_dict()["wandb_run_id"]
    mon.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert run_id and len(runs) == 1 and runs[0].name.endswith(run_id)
    assert any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_missing_optional_sinks_warn_and_continue(cfg, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_extras(name, *a, **kw):
        if name.split(".")[0] in ("wandb", "tensorboardX") or name == "torch.utils.tensorboard":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_extras)
    cfg.monitor.tensorboard, cfg.monitor.wandb_project = True, "p"
    printed = []
    mon = Monitor(cfg, tmp_path, print_fn=printed.append)
    mon.log_step(record(1), batch(1))
    mon.close()
    assert mon.extra == {} and len(printed) == 2
    assert "pip install tensorboard" in printed[0] and "pip install wandb" in printed[1]
    assert os.path.exists(tmp_path / "metrics.jsonl")
