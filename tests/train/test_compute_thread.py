"""One thread computes (HFEngine.run): in a real run the update executes on the engine's decode
thread with the run's torch threads, the loop's own thread holds one, and the run trains. When
train() returns, or raises, that thread and the model copies are gone."""

import gc
import json
import threading

import pytest
import torch

from actloop.config import load_config
from actloop.train import trainer
from actloop.train.rl import loop


def _run(tmp_path, monkeypatch, model_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}]}) + "\n" for i in range(8)))
    # random rewards: every group has an advantage to train on, whatever the random model writes
    (tmp_path / "rew.py").write_text("import random\n\ndef varied(prompts, completions, **kw):\n"
                                     "    return [random.random() for _ in completions]\n")
    cfg = load_config(None, [f"model={model_dir}", f"data.path={rows}", f"reward.funcs=[{tmp_path}/rew.py:varied]",
                             "train.steps=2", "train.prompts_per_step=1", "train.group_size=4",
                             "rollout.max_new_tokens=4", "rollout.max_turns=1", "train.eval_before=false",
                             "train.eval_after=false", "train.save_final=false", "checkpoint.every=0",
                             "train.threads=2", "train.beta=0", f"output_dir={tmp_path}", "run_name=r",
                             "monitor.sample_every=0", "train.precision=fp32"])
    seen, real = [], loop.rl_update

    def recording(*a, **k):
        seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(loop, "rl_update", recording)
    main_threads = []
    real_rollout = loop.rollout_groups
    monkeypatch.setattr(loop, "rollout_groups",
                        lambda *a, **k: main_threads.append(torch.get_num_threads()) or real_rollout(*a, **k))
    res = trainer.train(cfg, progress=False, print_fn=lambda *_: None)
    assert torch.get_num_threads() == 2  # train() hands the caller its threads back
    recs = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["trained_trajectories"] for r in recs) > 0
    return seen, main_threads


def test_the_update_runs_on_the_engine_thread(tmp_path, monkeypatch, tiny_qwen3_dir):
    seen, main_threads = _run(tmp_path, monkeypatch, tiny_qwen3_dir)
    assert seen == [("hf-engine-decode", 2, True)] * 2
    assert main_threads == [1, 1]  # the loop's thread never starts an OpenMP pool of its own


def test_a_lock_step_engine_keeps_the_update_and_the_threads_here(tmp_path, monkeypatch, tiny_gpt_oss_dir):
    """GPT-OSS's sliding-window layers decode in lock-step on the caller's thread: that thread keeps
    the run's torch threads and runs the update itself."""
    seen, main_threads = _run(tmp_path, monkeypatch, tiny_gpt_oss_dir)
    assert seen == [("MainThread", 2, True)] * 2
    assert main_threads == [2, 2]


def _decode_threads() -> set[threading.Thread]:
    """HF decode threads alive now (other tests' engines in this worker may own some)."""
    return {t for t in threading.enumerate() if t.name == "hf-engine-decode"}


def _causal_lms() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM"))


def test_a_finished_run_leaves_no_engine_thread_and_no_model_behind(tmp_path, monkeypatch, tiny_qwen3_dir):
    """A process that trains again (a notebook, a sweep) kept every run's engine, its decode thread
    and its model copies: the test suite's workers grew to 12 GB."""
    threads_before, models_before = _decode_threads(), _causal_lms()
    seen, _ = _run(tmp_path, monkeypatch, tiny_qwen3_dir)
    assert seen  # the run used the decode thread ...
    assert _decode_threads() == threads_before and _causal_lms() == models_before  # ... and nothing of it is left


def test_a_run_that_fails_closes_its_engine_too(tmp_path, monkeypatch, tiny_qwen3_dir):
    real_step = loop.rl_step
    threads_before, models_before = _decode_threads(), _causal_lms()

    def broken_step(*a, **k):
        real_step(*a, **k)
        assert len(_decode_threads() - threads_before) == 1  # the run's engine had started its thread
        raise RuntimeError("a bug in step 1")

    monkeypatch.setattr(loop, "rl_step", broken_step)
    with pytest.raises(RuntimeError, match="a bug in step 1"):
        _run(tmp_path, monkeypatch, tiny_qwen3_dir)
    assert _decode_threads() == threads_before and _causal_lms() == models_before
