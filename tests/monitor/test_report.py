"""`actloop report` on synthetic run directories: the PNGs, the self-contained page, escaping,
and runs with few steps, missing keys or nothing at all."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from actloop.cli import app
from actloop.monitor.monitor import Monitor
from actloop.monitor.report import PLOTS, build_report, load_run
from actloop.rewards.flags import Flag

from .conftest import make_batch, make_scored, record


def fake_run(cfg, run_dir, steps=6):
    """A run directory as the trainer leaves it: config, metrics via the Monitor, summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    mon = Monitor(cfg, run_dir, print_fn=lambda _: None)
    for s in range(1, steps + 1):
        rec = record(s, reward_mean=0.1 * s, prompt_tokens=1000,
                     **{"reward/format": 0.5, "sandbox_s": 0.3, "judge/cost_usd": 0.002, "judge/requests": 0})
        if s == 4:
            rec["kl"] = 5.0
        evil = make_scored(1.0, (Flag("stdout_spoof", "printed <b>All tests passed</b>", action="zero"),),
                           text="<script>alert('x')</script> & done")
        mon.log_step(rec, [evil] + make_batch([0.0, 0.5, 0.5]))
    mon.close()
    (run_dir / "summary.json").write_text(json.dumps({
        "task": "calculator", "model": "m", "eval_before": {"success": 0.4, "n": 10},
        "eval_after": {"success": 0.6, "n": 10}, "seconds_per_step": 4.0}))
    return run_dir


def test_full_report(cfg, tmp_path):
    run = fake_run(cfg, tmp_path / "run")
    page = build_report(run)
    assert page == run / "report" / "index.html"
    for name in PLOTS:
        png = run / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = page.read_text()
    for section in ("summary", "plots", "alarms", "samples", "config"):
        assert f"id='{section}'" in text
    imgs = re.findall(r"<img [^>]*src='([^']*)'", text)
    assert len(imgs) == len(PLOTS) and all(s.startswith("data:image/png;base64,") for s in imgs)
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", text)  # self-contained
    assert "<script" not in text.lower().replace("&lt;script", "")       # sample text is escaped
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; done" in text
    assert "printed &lt;b&gt;All tests passed&lt;/b&gt;" in text
    assert "40.0% (n=10)" in text and "+20.0 points" in text
    assert "<th>prompt tokens</th><td>6,000</td>" in text and "<th>judge cost (USD)</th><td>0.012</td>" in text
    assert "judge requests" not in text  # a total that stayed 0 gets no row
    assert "kl_blowup" in text and "KL 5 &gt; 0.5" in text
    assert "<th>flags raised (episodes)</th><td>stdout_spoof 6</td>" in text  # one flagged episode a step
    assert "monitor:" in text and "sample_every: 2" in text  # the config


def test_one_step_run_with_missing_keys_and_no_samples(cfg, tmp_path):
    run = tmp_path / "tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "loss": 0.1}) + "\n{cut off")
    page = build_report(run)
    text = page.read_text()
    assert (run / "report" / "reward.png").exists() and not (run / "report" / "kl.png").exists()
    assert "not recorded in this run: success, kl, entropy, length, flags, grad_norm, time" in text
    assert "no samples" in text and "no alarm fired" in text and "no config.yaml" in text
    assert "unreadable JSONL lines skipped" in text
    assert load_run(run).skipped_lines == 1


def test_empty_run_directory(tmp_path):
    text = build_report(tmp_path).read_text()
    assert "metrics.jsonl is empty or missing" in text and "<img" not in text


def test_cli_report(cfg, tmp_path):
    run = fake_run(cfg, tmp_path / "run", steps=2)
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "index.html").exists() and "index.html" in res.output
    assert "flags raised (episodes): stdout_spoof 2" in res.output
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a directory" in res.output


def test_a_short_run_has_whole_step_ticks_and_every_failure_kind_counted(cfg, tmp_path, monkeypatch):
    """A 2-step run drew ticks at 1.2, 1.4, ...; and "failed trajectories" read 0 while 6 parse
    failures were recorded (failures/rate counts only failures.count kinds)."""
    from matplotlib.figure import Figure

    run = fake_run(cfg, tmp_path / "run", steps=2)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "failures": {"parse": 6, "truncated": 2}}))
    ticks, real_savefig = {}, Figure.savefig

    def recording_savefig(fig, path, *a, **kw):
        fig.canvas.draw()
        lo, hi = fig.axes[0].get_xlim()
        ticks[str(path)] = [t for t in fig.axes[0].get_xticks() if lo <= t <= hi]
        return real_savefig(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    page = build_report(run).read_text()
    assert ticks and all(t == int(t) for ts in ticks.values() for t in ts), ticks
    assert "recorded failures" in page and "6 parse, 2 truncated" in page


def test_success_plot_draws_each_source_of_a_mix(tmp_path):
    """A data.mix run: training success per source and held-out success per source, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from actloop.monitor.report import RunData, _plot_success

    metrics = [{"step": s, "success": 0.5, "source/calculator/success": 0.4 + 0.1 * s,
                "source/instructions/success": 0.2, "source/calculator/reward_mean": 0.5,
                **({"eval_success": 0.5, "eval/calculator/success": 0.6, "eval/instructions/success": 0.3}
                   if s % 2 == 0 else {})} for s in range(1, 5)]
    summary = {label: {"success": 0.3, "per_source": {"calculator": {"success": 0.44}, "instructions": {"success": v}}}
               for label, v in (("eval_before", 0.16), ("eval_after", 0.48))}
    fig, ax = plt.subplots()
    try:
        assert _plot_success(ax, RunData(run_dir=tmp_path, metrics=metrics, summary=summary))
        labels = ax.get_legend_handles_labels()[1]
        stars = [tuple(c.get_offsets()[0]) for c in ax.collections]
    finally:
        plt.close(fig)
    assert {(0, 0.16), (4, 0.48), (0, 0.44), (4, 0.44), (0, 0.3), (4, 0.3)} == set(stars)  # per source and overall
    assert {"train: calculator", "train: instructions", "held-out: calculator", "held-out: instructions"} <= set(labels)
    assert "train: reward_mean" not in labels


def test_a_stopped_run_and_a_turn_that_only_calls_a_tool(tmp_path):
    from actloop.monitor.report import _sample_html

    run = tmp_path / "stopped"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 1, "steps_planned": 3, "failures": {"reward": 8},
                                                  "stopped": {"step": 1, "reason": "SIGINT"}}))
    text = build_report(run).read_text()
    assert "<th>stopped</th><td>after step 1 of 3: SIGINT</td>" in text
    assert "<th>recorded failures</th><td>8 reward</td>" in text
    html = _sample_html({"reward": 1.0, "messages": [
        {"role": "assistant", "content": "",
         "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+2"}}]},
        {"role": "tool", "content": "4"}]})
    assert "calculator({&quot;expression&quot;: &quot;2+2&quot;})" in html  # not an empty `assistant:`
