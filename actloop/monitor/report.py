"""`actloop report RUN_DIR`: PNG plots of a run (RUN_DIR/report/*.png) and one self-contained
HTML page (RUN_DIR/report/index.html: PNGs inlined as data URIs, inline CSS, no script, no
network) with the summary, the plots, the alarms, sample trajectories and the config.

Works on any run directory: a plot whose keys the run never recorded is listed as missing, a
run with one step plots points, a run without samples or alarms says so.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from actloop.monitor.alarms import drop_idle_updates, series
from actloop.monitor.costs import TIME_PARTS


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    alarms: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a crash: skip and count it
            bad += 1
            continue
        if isinstance(v, dict):
            rows.append(v)
        else:
            bad += 1
    return rows, bad


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory")
    data = RunData(run_dir)
    data.metrics, bad_m = _read_jsonl(run_dir / "metrics.jsonl")
    data.alarms, bad_a = _read_jsonl(run_dir / "alarms.jsonl")
    data.samples, bad_s = _read_jsonl(run_dir / "samples.jsonl")
    data.skipped_lines = bad_m + bad_a + bad_s
    if (run_dir / "summary.json").exists():
        try:
            data.summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            data.summary = {}
    if (run_dir / "config.yaml").exists():
        data.config_text = (run_dir / "config.yaml").read_text(errors="replace")
    return data


# --- plots ------------------------------------------------------------------------------------


def _keys(metrics: Sequence[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in metrics for k in r if k.startswith(prefix)})


def _line(ax, metrics, key: str, label: str | None = None, **kw) -> bool:
    pts = series(metrics, key)
    if not pts:
        return False
    xs, ys = zip(*pts)
    ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=label or key, **kw)
    return True


def _alarm_lines(ax, alarms: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    for a in alarms:
        if a.get("name") in names and isinstance(a.get("step"), (int, float)):
            ax.axvline(a["step"], color="red", linestyle=":", linewidth=1)


def _plot_reward(ax, d: RunData) -> bool:
    pts, sd = series(d.metrics, "reward_mean"), dict(series(d.metrics, "reward_std"))
    drawn = False
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=4, color="black", linewidth=2.2,
                zorder=4, label="reward (mean)")
        if sd:
            lo = [y - sd.get(x, 0.0) for x, y in pts]
            hi = [y + sd.get(x, 0.0) for x, y in pts]
            ax.fill_between(xs, lo, hi, color="gray", alpha=0.2, label="± std")
        drawn = True
    for k in _keys(d.metrics, "reward/"):
        drawn |= _line(ax, d.metrics, k, k.split("/", 1)[1], linewidth=1, linestyle="--")
    _alarm_lines(ax, d.alarms, ("reward_hacking",))
    ax.set_ylabel("reward")
    return drawn


def _plot_success(ax, d: RunData) -> bool:
    drawn = _line(ax, d.metrics, "success", "train success (sampled)")
    for k in ("eval_success", "eval/success", "judge_agreement"):
        drawn |= _line(ax, d.metrics, k, f"held-out: {k}", linestyle="--")
    # a data.mix: each source's training success (thin) and held-out success (dashed), one colour each
    sources = sorted({k.split("/")[1] for k in _keys(d.metrics, "source/") if k.endswith("/success")})
    steps = [s for s, _ in series(d.metrics, "success")] or [0]
    for i, src in enumerate(sources):
        color = f"C{(i + 3) % 10}"
        drawn |= _line(ax, d.metrics, f"source/{src}/success", f"train: {src}", linewidth=0.8, color=color)
        drawn |= _line(ax, d.metrics, f"eval/{src}/success", f"held-out: {src}", linestyle="--", color=color)
        for label, x in (("eval_before", 0), ("eval_after", max(steps))):  # the source's greedy before/after
            v = (d.summary.get(label) or {}).get("per_source", {}).get(src, {}).get("success")
            if isinstance(v, (int, float)):
                ax.scatter([x], [v], marker="*", s=70, color=color, zorder=5)
    for label, x in (("eval_before", 0), ("eval_after", max(steps))):
        v = d.summary.get(label, {}).get("success") if isinstance(d.summary.get(label), dict) else None
        if isinstance(v, (int, float)):
            ax.scatter([x], [v], marker="*", s=120, zorder=5, label=f"{label} (greedy) {v:.0%}")
            drawn = True
    _alarm_lines(ax, d.alarms, ("reward_hacking",))
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.05, 1.05)
    return drawn


def _single(key: str, label: str, alarm: str, ylabel: str, zero_is_missing: bool = False
            ) -> Callable[[Any, RunData], bool]:
    """A plot of one metric, with the steps where `alarm` fired marked. `zero_is_missing`: a
    metric that is 0 at every step was not measured (KL without a reference model)."""

    def plot(ax, d: RunData) -> bool:
        if zero_is_missing and not any(v for _, v in series(d.metrics, key)):
            return False
        drawn = _line(ax, d.metrics, key, label)
        _alarm_lines(ax, d.alarms, (alarm,))
        ax.set_ylabel(ylabel)
        return drawn

    return plot


def _plot_length(ax, d: RunData) -> bool:
    key = "response_tokens_per_episode" if series(d.metrics, "response_tokens_per_episode") else "response_tokens"
    drawn = _line(ax, d.metrics, key, key.replace("_", " "), color="tab:blue")
    ax.set_ylabel("tokens")
    if series(d.metrics, "truncated_rate"):
        ax2 = ax.twinx()
        _line(ax2, d.metrics, "truncated_rate", "truncated rate", color="tab:orange", linestyle="--")
        ax2.set_ylabel("truncated rate")
        ax2.set_ylim(-0.05, 1.05)
        ax2.legend(loc="upper right", fontsize=8)
        drawn = True
    _alarm_lines(ax, d.alarms, ("length_blowup",))
    return drawn


def _plot_flags(ax, d: RunData) -> bool:
    drawn = False
    for k, label in (("hack_flag_rate", "hack-flag rate"), ("flag_rate", "any flag"),
                     ("malformed_call_rate", "malformed tool calls"),
                     ("failures/any", "trajectories with a recorded failure (any kind)"),
                     ("failures/rate", "failure rate (failures.count kinds)"),
                     ("zero_variance_groups", "zero-variance groups")):
        drawn |= _line(ax, d.metrics, k, label)
    _alarm_lines(ax, d.alarms, ("hack_flag_rise", "zero_variance_groups"))
    ax.set_ylabel("fraction of episodes / groups")
    ax.set_ylim(-0.05, 1.05)
    return drawn


def _plot_time(ax, d: RunData) -> bool:
    """Stacked seconds per step: rollout, scoring, update and the rest; sandbox time (spent inside
    rollout and scoring, possibly in parallel) as a line over the bars."""
    steps = [s for s, _ in series(d.metrics, "step_s")]
    if not steps:
        return False
    by = {p: dict(series(d.metrics, f"{p}_s")) for p in ("rollout", "scoring", "update")}
    total = dict(series(d.metrics, "step_s"))
    bottom = [0.0] * len(steps)
    for p, color in (("rollout", "tab:blue"), ("scoring", "tab:green"), ("update", "tab:red")):
        ys = [by[p].get(s, 0.0) for s in steps]
        if any(ys):
            ax.bar(steps, ys, bottom=bottom, color=color, label=p, width=0.8)
            bottom = [b + y for b, y in zip(bottom, ys)]
    other = [max(0.0, total[s] - b) for s, b in zip(steps, bottom)]
    if any(o > 0.01 for o in other):
        ax.bar(steps, other, bottom=bottom, color="lightgray", label="other", width=0.8)
    if any(v > 0 for _, v in series(d.metrics, "sandbox_s")):
        _line(ax, d.metrics, "sandbox_s", "sandbox (within the above)", color="black", linestyle="--")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(0, 1.5 * max(max(total.values()), max(bottom), 1e-3))  # headroom for the legend
    return True


PLOTS: dict[str, tuple[str, Callable[[Any, RunData], bool]]] = {
    "reward": ("Reward and its components", _plot_reward),
    "success": ("Success: training samples and held-out", _plot_success),
    "kl": ("KL to the reference", _single("kl", "KL to reference (per token)", "kl_blowup", "KL",
                                                 zero_is_missing=True)),
    "entropy": ("Entropy", _single("entropy", "policy entropy (nats/token)", "entropy_collapse", "entropy")),
    "length": ("Response length", _plot_length),
    "flags": ("Flags, malformed calls, zero-variance groups", _plot_flags),
    "grad_norm": ("Gradient norm", _single("grad_norm", "grad norm (before clipping)", "grad_norm_spike", "grad norm")),
    "time": ("Time split per step", _plot_time),
}


def make_plots(d: RunData, out_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """-> ({name: png path}, names with no data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    d = RunData(**{**d.__dict__, "metrics": [drop_idle_updates(r) for r in d.metrics]})
    made, missing = {}, []
    for name, (title, fn) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        try:
            drawn = fn(ax, d)
            if not drawn:
                missing.append(name)
                continue
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no 1.2, 1.4 ticks
            ax.grid(alpha=0.3)
            handles, _ = ax.get_legend_handles_labels()
            if handles:
                ax.legend(loc="upper left", fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path)
            made[name] = path
        finally:
            plt.close(fig)
    return made, missing


# --- HTML -------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;
vertical-align:top}
.plots{display:flex;flex-wrap:wrap;gap:.8em}.plots figure{margin:0}.plots img{max-width:100%;width:520px;
border:1px solid #eee}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:.82em;white-space:pre-wrap}
.msg{margin:.3em 0;padding:.3em .6em;border-left:4px solid #ccc;white-space:pre-wrap;font-family:monospace;
font-size:.85em}
.system,.prompt{border-color:#bbb;color:#666}.user{border-color:#4a90d9}.assistant{border-color:#2e9d5b}
.tool{border-color:#d98c1f}.alarm{color:#b00020}.muted{color:#777}
details{margin:.6em 0;border:1px solid #e3e3e3;padding:.4em .7em;border-radius:4px}summary{cursor:pointer}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def flag_totals(metrics: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Each `flags/<name>` metric summed over the steps (episodes that carried the flag), most first."""
    out: dict[str, int] = {}
    for rec in metrics:
        for k, v in rec.items():
            if k.startswith("flags/") and isinstance(v, (int, float)):
                out[k[len("flags/"):]] = out.get(k[len("flags/"):], 0) + int(v)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _summary_rows(d: RunData) -> list[tuple[str, str]]:
    s, last = d.summary, (d.metrics[-1] if d.metrics else {})
    rows: list[tuple[str, str]] = [("run directory", str(d.run_dir))]
    for k in ("algo", "task", "model"):
        if k in s:
            rows.append((k, _fmt(s[k])))
    rows.append(("steps logged", str(len(d.metrics))))
    stopped = s.get("stopped")
    if isinstance(stopped, dict):  # a run stopped before train.steps: where, and why
        rows.append(("stopped", f"after step {stopped.get('step', '?')} of {s.get('steps_planned', '?')}: "
                                f"{stopped.get('reason', '?')}"))
    elif not s:
        rows.append(("stopped", "no summary.json: the run is still going, or was killed"))
    b = s.get("eval_before", {}).get("success") if isinstance(s.get("eval_before"), dict) else None
    a = s.get("eval_after", {}).get("success") if isinstance(s.get("eval_after"), dict) else None
    if b is not None:
        rows.append(("held-out success before", f"{b:.1%} (n={s['eval_before'].get('n', '?')})"))
    if a is not None:
        rows.append(("held-out success after", f"{a:.1%} (n={s['eval_after'].get('n', '?')})"))
    if a is not None and b is not None:
        rows.append(("change", f"{(a - b) * 100:+.1f} points"))
    if "seconds_per_step" in s:
        rows.append(("seconds per step", _fmt(s["seconds_per_step"])))
    elif series(d.metrics, "step_s"):
        v = [x for _, x in series(d.metrics, "step_s")]
        rows.append(("seconds per step", f"{sum(v) / len(v):.2f}"))
    if "generated_tokens_per_s" in s:
        rows.append(("generated tokens/s", _fmt(s["generated_tokens_per_s"])))
    for k, label in (("total/tokens", "tokens (prompt + response + tool)"), ("total/prompt_tokens", "prompt tokens"),
                     ("total/response_tokens", "response tokens"), ("total/tool_tokens", "tool-output tokens"),
                     ("total/tokens_per_s", "tokens/s (whole run)"),
                     ("total/judge/requests", "judge requests"), ("total/judge/failed", "judge requests failed"),
                     ("total/judge/prompt_tokens", "judge prompt tokens"),
                     ("total/judge/completion_tokens", "judge completion tokens"),
                     ("total/judge/cost_usd", "judge cost (USD)"), ("total/sandbox_runs", "sandbox runs"),
                     ("total/sandbox_timeouts", "sandbox timeouts")):
        if k in last and (last[k] or not k.startswith(("total/judge", "total/sandbox"))):  # no judge: no rows
            rows.append((label, _fmt(last[k])))
    fr = {p: last.get(f"total/{p}_s") for p in TIME_PARTS}
    if last.get("total/step_s"):
        parts = ", ".join(f"{p} {v / last['total/step_s']:.0%}" for p, v in fr.items() if isinstance(v, (int, float)))
        rows.append(("time split (whole run)", parts))
    raised = flag_totals(d.metrics)
    if raised:  # episodes carrying each flag, summed over the logged steps (hack flags and failures alike)
        rows.append(("flags raised (episodes)", ", ".join(f"{k} {v}" for k, v in raised.items())))
    if s.get("failures"):  # every recorded kind, masked or trained on (failures.jsonl has each one)
        rows.append(("recorded failures", ", ".join(f"{v} {k}" for k, v in sorted(s["failures"].items()))))
    rows.append(("alarms", str(len(d.alarms))))
    if d.skipped_lines:
        rows.append(("unreadable JSONL lines skipped", str(d.skipped_lines)))
    return rows


def _sample_html(s: dict[str, Any]) -> str:
    flags = s.get("flags") or []
    flag_txt = ", ".join(f.get("name", "?") if isinstance(f, dict) else str(f) for f in flags) or "none"
    head = (f"step {_e(s.get('step'))} · group {_e(s.get('group'))} · {_e(s.get('pick'))} · reward "
            f"{_e(_fmt(s.get('reward')))} · success {_e(s.get('success'))} · flags {_e(flag_txt)}"
            + (" · <b>masked</b>" if s.get("masked") else ""))
    parts = [f"<details class='sample'><summary>{head}</summary>"]
    comps = s.get("components") or {}
    if comps:
        parts.append("<p>components: " + ", ".join(f"{_e(k)}={_e(_fmt(v))}" for k, v in comps.items()) + "</p>")
    for f in flags:
        if isinstance(f, dict) and f.get("evidence"):
            parts.append(f"<p>flag <b>{_e(f.get('name'))}</b> ({_e(f.get('action', ''))}): {_e(f['evidence'])}</p>")
    if s.get("error"):
        parts.append(f"<p class='alarm'>error: {_e(s['error'])}</p>")
    msgs = s.get("messages") or []
    prompt = [m for m in msgs if m.get("prompt")]
    if prompt:
        parts.append(f"<details><summary class='muted'>prompt ({len(prompt)} messages)</summary>")
        parts += [f"<div class='msg prompt'><b>{_e(m.get('role'))}</b>: {_e(m.get('content', ''))}</div>"
                  for m in prompt]
        parts.append("</details>")
    for m in msgs:
        if m.get("prompt"):
            continue
        role = str(m.get("role", ""))
        css = role if role in ("system", "user", "assistant", "tool") else ""
        calls = "".join(f"<div class='call'>&rarr; <code>{_e(c.get('name'))}"
                        f"({_e(json.dumps(c.get('arguments'), ensure_ascii=False))})</code></div>"
                        for c in m.get("tool_calls") or [] if isinstance(c, dict))  # a call-only turn is not empty
        reasoning = f"<div class='muted'>{_e(m['reasoning'])}</div>" if m.get("reasoning") else ""
        parts.append(f"<div class='msg {css}'><b>{_e(role)}</b>: {reasoning}{_e(m.get('content', ''))}{calls}</div>")
    parts.append("</details>")
    return "\n".join(parts)


def render_html(d: RunData, plots: dict[str, Path], missing: Sequence[str], max_samples: int = 60) -> str:
    title = f"actloop report: {d.run_dir.name}"
    out = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>", f"<title>{_e(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    out.append("<section id='summary'><h2>Summary</h2><table>")
    out += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in _summary_rows(d)]
    out.append("</table></section>")

    out.append("<section id='plots'><h2>Plots</h2><div class='plots'>")
    for name, path in plots.items():
        b64 = base64.b64encode(path.read_bytes()).decode("ascii")
        out.append(f"<figure><img class='plot' id='plot-{_e(name)}' alt='{_e(PLOTS[name][0])}' "
                   f"src='data:image/png;base64,{b64}'></figure>")
    out.append("</div>")
    if missing:
        out.append(f"<p class='muted'>not recorded in this run: {_e(', '.join(missing))}</p>")
    if not d.metrics:
        out.append("<p class='muted'>metrics.jsonl is empty or missing: no steps were logged.</p>")
    out.append("</section>")

    out.append(f"<section id='alarms'><h2>Alarms ({len(d.alarms)})</h2>")
    if d.alarms:
        out.append("<table><tr><th>step</th><th>alarm</th><th>what</th></tr>")
        out += [f"<tr class='alarm'><td>{_e(a.get('step'))}</td><td>{_e(a.get('name'))}</td>"
                f"<td>{_e(a.get('message'))}</td></tr>" for a in d.alarms]
        out.append("</table>")
    else:
        out.append("<p class='muted'>no alarm fired.</p>")
    out.append("</section>")

    shown = d.samples[-max_samples:]
    out.append(f"<section id='samples'><h2>Sample trajectories ({len(d.samples)})</h2>")
    if len(shown) < len(d.samples):
        out.append(f"<p class='muted'>the last {len(shown)} of {len(d.samples)}; all are in samples.jsonl.</p>")
    out += [_sample_html(s) for s in shown] or ["<p class='muted'>no samples (monitor.sample_every = 0?).</p>"]
    out.append("</section>")

    out.append("<section id='config'><h2>Config</h2>")
    out.append(f"<pre>{_e(d.config_text)}</pre>" if d.config_text else "<p class='muted'>no config.yaml</p>")
    out.append("</section></body></html>")
    return "\n".join(out)


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and index.html into `out_dir` (default RUN_DIR/report); -> index.html."""
    d = load_run(run_dir)
    out = Path(out_dir) if out_dir else d.run_dir / "report"
    plots, missing = make_plots(d, out)
    page = out / "index.html"
    page.write_text(render_html(d, plots, missing), encoding="utf-8")
    return page
