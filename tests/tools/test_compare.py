"""`actloop compare`: rows from run directories, mean ± std over seeds, failed runs as rows, the
pairwise tests, --seeds and --parallel on fake child commands, the plot, and a real
2-algorithm x 1-step comparison in child processes (slow)."""

import importlib.util
import json
import math
import sys
import textwrap

import pytest

from actloop.tools.compare import (AlgoResult, MeanStd, _split_overrides, aggregate, markdown_table, peak_memory,
                                   pairwise_tests, plot, run_child, run_compare, success_before, summarize_run)


def fake_run(tmp_path, name, rewards, kls, grad_norms, before=0.25, after=0.5, sps=3.0, problems=None):
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "reward_mean": r, "kl": k, "grad_norm": g}) + "\n"
        for i, (r, k, g) in enumerate(zip(rewards, kls, grad_norms))))
    summary = {"eval_after": {"success": after}, "seconds_per_step": sps}
    if before is not None:
        summary["eval_before"] = {"success": before}
    (d / "summary.json").write_text(json.dumps(summary))
    if problems is not None:
        (d / "eval_after.jsonl").write_text("".join(
            json.dumps({"id": i, "source": "calculator", "correct": int(c), "samples": 1}) + "\n"
            for i, c in enumerate(problems)))
    return d


def test_summarize_run_hand_computed(tmp_path):
    d = fake_run(tmp_path, "grpo", rewards=[0.0, 0.5, 1.0, 1.0], kls=[0.0, 0.1, 0.2, 0.3], grad_norms=[1, 3, 1, 3],
                 problems=[1, 0, 1])
    r = summarize_run("grpo", d, window=2, seed=4)
    assert r.ok and r.seed == 4 and r.steps == 4 and r.seconds_per_step == 3.0
    assert r.reward_first == pytest.approx(0.25) and r.reward_last == pytest.approx(1.0)
    assert r.reward_gain == pytest.approx(0.75)
    assert r.kl_std == pytest.approx(math.sqrt(((0.15 ** 2) * 2 + (0.05 ** 2) * 2) / 3))  # sample std
    assert r.grad_norm_std == pytest.approx(math.sqrt(4 / 3)) and r.grad_norm_mean == 2.0
    assert (r.success_before, r.success_after) == (0.25, 0.5)
    assert r.problems_after == {"calculator/0": True, "calculator/1": False, "calculator/2": True}
    # GRPO with beta = 0 logs kl = 0 everywhere: not measured, shown as a dash; no eval_before
    r0 = summarize_run("g0", fake_run(tmp_path, "g0", [0, 1], [0, 0], [1, 1], before=None), window=1)
    assert r0.kl_std is None and r0.reward_gain == 1.0 and r0.success_before is None and r0.problems_after == {}


def three_seeds(tmp_path):
    """grpo: 3 seeds; rloo: seed 1 failed; ppo: every seed failed."""
    rows = []
    for seed, (rewards, after, sps, mem) in enumerate([([0, 1], 0.5, 2.0, 1000.0), ([0, 0.5], 0.6, 3.0, 1100.0),
                                                        ([0.5, 0.5], 0.7, 7.0, 1200.0)]):
        r = summarize_run("grpo", fake_run(tmp_path, f"grpo-s{seed}", rewards, [0, 0], [1, 1], before=0.2 + seed / 10,
                                           after=after, sps=sps), window=1, seed=seed)
        r.peak_mem_mib = mem
        rows.append(r)
    for seed in (0, 2):
        r = summarize_run("rloo", fake_run(tmp_path, f"rloo-s{seed}", [0, 0.25], [0, 0], [2, 4], before=None,
                                           after=0.4), window=1, seed=seed)
        r.peak_mem_mib = 900.0
        rows.append(r)
    rows.insert(4, AlgoResult("rloo", ok=False, seed=1, error="exit code 1; last output: KeyError: 'a|b'"))
    rows += [AlgoResult("ppo", ok=False, seed=s, error="killed by signal SIGKILL") for s in range(3)]
    return rows


def test_aggregate_over_seeds_hand_computed(tmp_path):
    g, r, p = aggregate(three_seeds(tmp_path))
    assert (g.algo, g.seeds, g.ok_seeds, g.failed, g.steps) == ("grpo", [0, 1, 2], [0, 1, 2], [], 2)
    assert g.success_after == MeanStd(pytest.approx(0.6), pytest.approx(0.1), 3)  # 0.5, 0.6, 0.7
    assert g.reward_gain == MeanStd(0.5, 0.5, 3)  # gains 1, 0.5, 0
    assert g.seconds_per_step == MeanStd(4.0, pytest.approx(math.sqrt((4 + 1 + 9) / 2)), 3)  # 2, 3, 7
    assert g.peak_mem_mib == MeanStd(1100.0, 100.0, 3) and g.kl_std is None
    assert g.grad_norm_std == MeanStd(0.0, 0.0, 3) and g.grad_norm_mean == MeanStd(1.0, 0.0, 3)
    # a failed seed is counted and named; the two that finished still aggregate
    assert r.seeds == [0, 1, 2] and r.ok_seeds == [0, 2] and r.failed == ["seed 1: exit code 1; last output: KeyError: 'a|b'"]
    assert r.success_after == MeanStd(pytest.approx(0.4), 0.0, 2) and r.grad_norm_std.mean == pytest.approx(math.sqrt(2))
    assert p.ok_seeds == [] and len(p.failed) == 3 and p.success_after is None
    # before: the run of each seed that measured it (here grpo), 0.2 / 0.3 / 0.4
    assert success_before(three_seeds(tmp_path / "again")) == \
        {0: pytest.approx(0.2), 1: pytest.approx(0.3), 2: pytest.approx(0.4)}


def test_table_with_failed_seeds(tmp_path):
    table = markdown_table(three_seeds(tmp_path))
    lines = table.splitlines()
    assert len(lines) == 5 and all(line.count(" | ") == 8 for line in lines if not line.startswith("|-"))
    assert ("| grpo | 3/3 | 60.0% ± 10.0 | +0.500 ± 0.500 | 4.0 ± 2.6 | 1100 ± 100 | — | 0.000 ± 0.000 (1.00) "
            "| ok, 2 steps |") in table
    assert ("| rloo | 2/3 | 40.0% ± 0.0 | +0.250 ± 0.000 | 3.0 ± 0.0 | 900 ± 0 | — | 1.414 ± 0.000 (3.00) "
            "| ok, 2 steps; FAILED seed 1: exit code 1; last output: KeyError: 'a\\|b' |") in table
    assert "| ppo | 0/3 | — | — | — | — | — | — | FAILED: seed 0: killed by signal SIGKILL; seed 1:" in table
    # one seed: the value alone, no ± 0
    one = markdown_table([r for r in three_seeds(tmp_path / "one") if r.seed == 0 and r.algo == "grpo"])
    assert "| grpo | 1/1 | 50.0% | +1.000 | 2.0 | 1000 | — | 0.000 (1.00) | ok, 2 steps |" in one


def test_pairwise_tests_hand_computed(tmp_path):
    """grpo vs rloo: seed 0 problem 1 and seed 1 problem 1 solved by grpo only, nothing by rloo
    only -> McNemar b = 2, c = 0, p = 2 * 1/4 = 0.5; Welch on [0.5, 0.75] vs [0.25, 0.5]: t = sqrt 2,
    df = 2, p = 1 - sqrt2/2. ppo finished one seed: McNemar on it, no Welch."""
    outcomes = {("grpo", 0): [1, 1, 0, 0], ("grpo", 1): [1, 1, 1, 0], ("rloo", 0): [1, 0, 0, 0],
                ("rloo", 1): [1, 0, 1, 0], ("ppo", 0): [0, 0, 0, 0]}
    rows = [summarize_run(a, fake_run(tmp_path, f"{a}-s{s}", [0], [0], [1], after=sum(o) / 4, problems=o), 1, s)
            for (a, s), o in outcomes.items()] + [AlgoResult("ppo", ok=False, seed=1, error="boom")]
    gr, gp, rp = pairwise_tests(rows)
    assert (gr["a"], gr["b"], gr["seeds"], gr["pairs"], gr["a_only"], gr["b_only"]) == ("grpo", "rloo", [0, 1], 8, 2, 0)
    assert gr["diff"] == pytest.approx(0.25) and gr["mcnemar_p"] == pytest.approx(0.5)
    assert gr["welch_t"] == pytest.approx(math.sqrt(2)) and gr["welch_df"] == pytest.approx(2.0)
    assert gr["welch_p"] == pytest.approx(1 - math.sqrt(2) / 2)
    assert (gp["seeds"], gp["pairs"], gp["a_only"], gp["b_only"]) == ([0], 4, 2, 0) and gp["welch_p"] is None
    assert (rp["a_only"], rp["mcnemar_p"]) == (1, 1.0)
    # Holm over the 3 McNemar tests: 3 * 0.5, capped at 1; one Welch test: unadjusted
    assert [t["mcnemar_holm"] for t in (gr, gp, rp)] == [1.0, 1.0, 1.0]
    assert gr["welch_holm"] == pytest.approx(gr["welch_p"]) and gp["welch_holm"] is None


def test_table_and_plot_write_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    assert plot(three_seeds(tmp_path), png) and png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_split_overrides():
    common, per = _split_overrides(["train.beta=0.04", "dpo:dpo.beta=0.2", "x:y=1"], ["grpo", "dpo"])
    assert common == ["train.beta=0.04", "x:y=1"] and per == {"grpo": [], "dpo": ["dpo.beta=0.2"]}


def test_run_child_reports_the_childs_own_peak_memory(tmp_path):
    """This process holds torch (hundreds of MiB); a small child still reports its own few MiB."""
    code, wall, small = run_child([sys.executable, "-c", "pass"], tmp_path / "a.log")
    assert code == 0 and small < 60
    code, _, big = run_child([sys.executable, "-c", "b = b'1' * (200 << 20); import sys; sys.exit(3)"],
                             tmp_path / "b.log")
    assert code == 3 and 200 < big < 300
    code, wall, _ = run_child([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "c.log", timeout_s=0.5)
    assert code == -9 and wall < 10


FAKE_TRAIN = textwrap.dedent('''
    """A stand-in for `actloop train`: reads the overrides, holds some memory for a while, writes
    a run directory the way the trainer does (or fails for ppo seed 1)."""
    import json, sys, time
    from pathlib import Path
    kv = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    run = Path(kv["output_dir"]) / kv["run_name"]
    t0 = time.time()
    algo, seed = kv["algo"], int(kv["seed"])
    if algo == "ppo" and seed == 1:
        sys.exit("RuntimeError: out of patience")
    hold = b"1" * ((150 if algo == "grpo" else 5) << 20)  # grpo's peak is 150 MiB higher
    time.sleep(1.0)
    run.mkdir(parents=True)
    outcomes = [(i + seed + len(algo)) % 3 == 0 for i in range(6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": 0.1 * i + 0.01 * seed,
                                                             "grad_norm": 1.0}) + "\\n" for i in range(int(kv["train.steps"]))))
    summary = {"seconds_per_step": 1.0, "eval_after": {"success": sum(outcomes) / 6}, "argv": sys.argv[1:]}
    if kv["train.eval_before"] == "true":
        summary["eval_before"] = {"success": 0.1 * (seed + 1)}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "eval_after.jsonl").write_text("".join(json.dumps({"id": i, "source": "calculator", "correct": int(c)}) + "\\n"
                                                 for i, c in enumerate(outcomes)))
    (run / "times.json").write_text(json.dumps([t0, time.time()]))
''')


def test_seeds_and_parallel_with_a_fake_child(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    out = tmp_path / "cmp"
    res = run_compare(["grpo", "rloo", "ppo"], steps=3, eval_size=6, output_dir=out, seeds=[0, 1], parallel=2,
                      train_cmd=[sys.executable, str(script)], print_fn=lambda *_: None)
    assert [(r.algo, r.seed, r.ok) for r in res.rows] == [
        ("grpo", 0, True), ("rloo", 0, True), ("ppo", 0, True), ("grpo", 1, True), ("rloo", 1, True), ("ppo", 1, False)]
    assert "out of patience" in res.rows[-1].error and (out / "ppo-s1.log").exists()
    # before is measured once per seed, by the seed's first run; the others skip it
    argv = {(r.algo, r.seed): json.loads((out / f"{r.algo}-s{r.seed}" / "summary.json").read_text())["argv"]
            for r in res.rows if r.ok}
    assert [k for k, a in argv.items() if "train.eval_before=true" in a] == [("grpo", 0), ("grpo", 1)]
    assert all("train.eval_before=false" in a for k, a in argv.items() if k[0] != "grpo")
    assert all("train.steps=3" in a and "data.eval_size=6" in a and f"seed={k[1]}" in a for k, a in argv.items())
    assert success_before(res.rows) == {0: pytest.approx(0.1), 1: pytest.approx(0.2)}
    # two children at once: grpo-s0 and rloo-s0 started together and overlapped
    (s1, e1), (s2, e2) = (json.loads((out / n / "times.json").read_text()) for n in ("grpo-s0", "rloo-s0"))
    assert max(s1, s2) < min(e1, e2)
    # each its own peak memory, measured per pid
    for g, r in ((res.rows[0], res.rows[1]), (res.rows[3], res.rows[4])):
        assert g.peak_mem_mib - r.peak_mem_mib > 100 and r.peak_mem_mib < 80
    # the files: the aggregated table, the tests, every per-seed number
    md = (out / "compare.md").read_text()
    assert "seeds=0,1" in md and "Up to 2 runs at once" in md and "measured once per seed" in md and "seed 1: 20.0%" in md
    assert "| ppo | 1/2 |" in md and "Significant at p < 0.05 after Holm's correction over 3 pairs" in md
    saved = json.loads((out / "compare.json").read_text())
    assert len(saved["rows"]) == 6 and [a["algo"] for a in saved["aggregated"]] == ["grpo", "rloo", "ppo"]
    assert len(saved["tests"]) == 3 and saved["rows"][0]["problems_after"]["calculator/0"] in (True, False)
    assert saved["success_before"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.2)}

    # --reuse per (algo, seed): only the failed ppo-s1 runs again (and fails again); the table is the same
    res2 = run_compare(["grpo", "rloo", "ppo"], steps=3, eval_size=6, output_dir=out, seeds=[0, 1], reuse=True,
                       train_cmd=[sys.executable, str(script)], print_fn=lambda *_: None)
    assert [r.peak_mem_mib for r in res2.rows[:5]] == [r.peak_mem_mib for r in res.rows[:5]]
    assert json.loads((out / "grpo-s0" / "times.json").read_text()) == [s1, e1]  # not rerun
    assert res2.tests == res.tests


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


def test_reuse_keeps_finished_runs_and_reruns_failed_ones(tmp_path):
    fake_run(tmp_path, "grpo-s0", [0, 1], [0.1, 0.2], [1, 2])
    (tmp_path / "grpo-s0.result.json").write_text(json.dumps({"ok": True, "wall_s": 60.0, "peak_mem_mib": 1234.0}))
    (tmp_path / "dpo-s0.result.json").write_text(json.dumps({"ok": False, "wall_s": 5.0, "peak_mem_mib": 99.0}))
    res = run_compare(["grpo", "dpo"], steps=2, eval_size=2, output_dir=tmp_path, reuse=True,
                      overrides=["dpo:train.steps=-1"], print_fn=lambda *_: None)
    g, d = res.rows
    assert g.ok and g.peak_mem_mib == 1234.0 and g.wall_s == 60.0 and g.reward_gain == 1.0  # not rerun
    assert not d.ok and "train.steps must be >= 0" in d.error  # rerun (and failed again)
    assert json.loads((tmp_path / "dpo-s0.result.json").read_text())["ok"] is False


def test_compare_is_a_cli_command_and_dr_grpo_a_variant():
    from typer.testing import CliRunner

    from actloop.cli import app
    from actloop.tools.compare import ALGORITHMS

    out = CliRunner().invoke(app, ["compare", "--help"])
    assert out.exit_code == 0 and all(o in out.output for o in ("--algos", "--set", "--seeds", "--parallel"))
    assert ALGORITHMS["dr_grpo"] == ["algo=grpo", "train.adv_scale=none", "train.loss_agg=constant"]
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "dpo"} <= set(ALGORITHMS)


@pytest.mark.slow
def test_compare_grpo_and_dpo_one_step_each(tmp_path, tiny_qwen3_dir):
    # the tiny random Qwen3 (tests/fixtures/tiny_models.py): the child runs, rows and tables are the
    # point here, not what a step of the embedded model learns (100 s of `make test` on it)
    res = run_compare(["grpo", "dpo"], steps=1, eval_size=2, output_dir=tmp_path, prompts_per_step=2, group_size=2,
                      threads=1, overrides=[f"model={tiny_qwen3_dir}", "data.train_size=20", "rollout.max_turns=2"],
                      print_fn=lambda *_: None)
    assert [r.algo for r in res.rows] == ["grpo", "dpo"]
    for r in res.rows:
        assert r.ok, r.error
        assert r.steps == 1 and r.seconds_per_step > 0 and 100 < r.peak_mem_mib < 20000
        assert 0 <= r.success_after <= 1 and len(r.rewards) == 1 and len(r.problems_after) == 2
        assert (tmp_path / f"{r.algo}-s0" / "final" / "config.json").exists()
    # the same model and held-out set for both: before is measured once, by the first run
    assert 0 <= res.rows[0].success_before <= 1 and res.rows[1].success_before is None
    assert "| grpo | 1/1 |" in res.table and "| dpo | 1/1 |" in res.table
    if importlib.util.find_spec("matplotlib"):  # the plot needs matplotlib; the table does not
        assert res.png is not None and res.png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "compare.md").read_text().count("ok, 1 steps") == 4  # the aggregated and per-run tables


def test_peak_memory_is_the_runs_largest_phase_not_the_reset_high_water_mark(tmp_path):
    """The trainer resets the kernel's high-water mark at each phase, so the child's ru_maxrss is
    its last phase's peak; the row takes the run's own per-phase maximum when that is larger."""
    d = fake_run(tmp_path, "grpo", [0, 1], [0, 0], [1, 1])
    summary = json.loads((d / "summary.json").read_text())
    summary["peak_mem_mb"] = {"model_load": 1400.0, "eval": 2500.0, "rollout": 3100.0, "update": 6800.0}
    (d / "summary.json").write_text(json.dumps(summary))
    row = summarize_run("grpo", d, window=1)
    assert row.run_peak_mem_mib == 6800.0
    assert peak_memory(row, 2600.0) == 6800.0       # ru_maxrss read after the last reset: the eval's peak
    assert peak_memory(row, 7000.04) == 7000.0      # a larger ru_maxrss (no reset took effect) wins
    bare = summarize_run("g0", fake_run(tmp_path, "g0", [0, 1], [0, 0], [1, 1]), window=1)
    assert bare.run_peak_mem_mib is None and peak_memory(bare, 1234.56) == 1234.6
