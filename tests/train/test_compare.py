"""`actloop compare`: rows from run directories, failed algorithms as rows, the table and plot,
and a real 2-algorithm x 1-step comparison in child processes."""

import importlib.util
import json
import math

import pytest

from actloop.train.compare import (AlgoResult, _split_overrides, markdown_table, plot, run_compare, summarize_run)


def fake_run(tmp_path, name, rewards, kls, grad_norms, before=0.25, after=0.5, sps=3.0):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "reward_mean": r, "kl": k, "grad_norm": g}) + "\n"
        for i, (r, k, g) in enumerate(zip(rewards, kls, grad_norms))))
    (d / "summary.json").write_text(json.dumps({"eval_before": {"success": before}, "eval_after": {"success": after},
                                                "seconds_per_step": sps}))
    return d


def test_summarize_run_hand_computed(tmp_path):
    d = fake_run(tmp_path, "grpo", rewards=[0.0, 0.5, 1.0, 1.0], kls=[0.0, 0.1, 0.2, 0.3], grad_norms=[1, 3, 1, 3])
    r = summarize_run("grpo", d, window=2)
    assert r.ok and r.steps == 4 and r.seconds_per_step == 3.0
    assert r.reward_first == pytest.approx(0.25) and r.reward_last == pytest.approx(1.0)
    assert r.reward_gain == pytest.approx(0.75)
    assert r.kl_std == pytest.approx(math.sqrt(((0.15 ** 2) * 2 + (0.05 ** 2) * 2) / 3))  # sample std
    assert r.grad_norm_std == pytest.approx(math.sqrt(4 / 3)) and r.grad_norm_mean == 2.0
    assert (r.success_before, r.success_after) == (0.25, 0.5)
    # GRPO with beta = 0 logs kl = 0 everywhere: not measured, shown as a dash
    r0 = summarize_run("g0", fake_run(tmp_path, "g0", [0, 1], [0, 0], [1, 1]), window=1)
    assert r0.kl_std is None and r0.reward_gain == 1.0


def test_table_shows_failures_as_rows_and_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    ok = summarize_run("grpo", fake_run(tmp_path, "grpo", [0, 1, 1], [0.01, 0.02, 0.03], [1, 2, 3]), window=1)
    ok.peak_mem_mib = 1500.0
    bad = AlgoResult("ppo", ok=False, error="exit code 1: KeyError: 'a|b'")
    table = markdown_table([ok, bad])
    lines = table.splitlines()
    assert len(lines) == 4 and all(line.count(" | ") == 7 for line in lines if not line.startswith("|-"))
    assert "| grpo | 1500 | 3.0 | 0.000 → 1.000 (+1.000) | 25.0% → 50.0% | 0.0100 | 1.000 (2.00) | ok, 3 steps |" in table
    assert "FAILED: exit code 1: KeyError: 'a\\|b'" in table
    png = tmp_path / "c.png"
    assert plot([ok, bad], png) and png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_split_overrides():
    common, per = _split_overrides(["train.beta=0.04", "dpo:dpo.beta=0.2", "x:y=1"], ["grpo", "dpo"])
    assert common == ["train.beta=0.04", "x:y=1"] and per == {"grpo": [], "dpo": ["dpo.beta=0.2"]}


def test_a_failing_or_unknown_algorithm_is_a_row_not_a_crash(tmp_path):
    """A run that exits with an error (here a config error, so no model is loaded) and an unknown
    name both become rows; the table and files are still written."""
    res = run_compare(["grpo", "nope"], steps=1, eval_size=2, output_dir=tmp_path, overrides=["grpo:train.steps=-1"],
                      print_fn=lambda *_: None)
    g, n = res.rows
    assert not g.ok and "train.steps must be >= 0" in g.error and g.peak_mem_mib > 0
    assert not n.ok and "unknown algorithm" in n.error
    assert (tmp_path / "compare.md").exists() and "FAILED" in (tmp_path / "compare.md").read_text()
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][0]["algo"] == "grpo"


def test_compare_is_a_cli_command():
    from typer.testing import CliRunner

    from actloop.cli import app

    out = CliRunner().invoke(app, ["compare", "--help"])
    assert out.exit_code == 0 and "--algos" in out.output and "--set" in out.output


@pytest.mark.slow
def test_compare_grpo_and_dpo_one_step_each(tmp_path):
    res = run_compare(["grpo", "dpo"], steps=1, eval_size=2, output_dir=tmp_path, prompts_per_step=2, group_size=2,
                      threads=1, overrides=["data.train_size=20", "rollout.max_turns=2"], print_fn=lambda *_: None)
    assert [r.algo for r in res.rows] == ["grpo", "dpo"]
    for r in res.rows:
        assert r.ok, r.error
        assert r.steps == 1 and r.seconds_per_step > 0 and 100 < r.peak_mem_mib < 20000
        assert 0 <= r.success_before <= 1 and 0 <= r.success_after <= 1 and len(r.rewards) == 1
        assert (tmp_path / r.algo / "final" / "config.json").exists()
    # same model, same held-out set, same engine: the same score before training
    assert res.rows[0].success_before == res.rows[1].success_before
    assert "| grpo |" in res.table and "| dpo |" in res.table
    if importlib.util.find_spec("matplotlib"):  # the plot needs matplotlib; the table does not
        assert res.png is not None and res.png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "compare.md").read_text().count("ok, 1 steps") == 2


def test_reuse_keeps_finished_runs_and_reruns_failed_ones(tmp_path):
    fake_run(tmp_path, "grpo", [0, 1], [0.1, 0.2], [1, 2])
    (tmp_path / "grpo.result.json").write_text(json.dumps({"ok": True, "wall_s": 60.0, "peak_mem_mib": 1234.0}))
    (tmp_path / "dpo.result.json").write_text(json.dumps({"ok": False, "wall_s": 5.0, "peak_mem_mib": 99.0}))
    res = run_compare(["grpo", "dpo"], steps=2, eval_size=2, output_dir=tmp_path, reuse=True,
                      overrides=["dpo:train.steps=-1"], print_fn=lambda *_: None)
    g, d = res.rows
    assert g.ok and g.peak_mem_mib == 1234.0 and g.wall_s == 60.0 and g.reward_gain == 1.0  # not rerun
    assert not d.ok and "train.steps must be >= 0" in d.error  # rerun (and failed again)
    assert json.loads((tmp_path / "dpo.result.json").read_text())["ok"] is False
