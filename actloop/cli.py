"""The `actloop` command. Wiring only: parse arguments, call the library, print results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from actloop.config import ConfigError, all_keys, load_config, type_name
from actloop.data.jsonl import DataError
from actloop.models import ModelError, load_models, load_tokenizer, resolve_model
from actloop.monitor.report import build_report, flag_totals, load_run
from actloop.rewards import RewardError
from actloop.rollout.factory import make_engine
from actloop.rollout.preview import preview_episode
from actloop.rollout.renderer import Renderer
from actloop.sandbox.cli import app as sandbox_app
from actloop.gateway.agent import build_run_task
from actloop.gateway.serve import build as build_server
from actloop.tasks.registry import BUILTIN, build_task, find_row, grade_one, grade_rows, resolve
from actloop.train.runtime.checkpoint import resume_config
from actloop.tools.compare import compare as _compare
from actloop.train.runtime.evaluate import evaluate, row_question
from actloop.train.runtime.failures import RunAborted
from actloop.train.trainer import train as run_train

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,  # help texts are plain: [key=value ...] stays
                  help="Agentic RL of open LLMs: think, act, feedback.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
app.add_typer(config_app, name="config")
app.add_typer(sandbox_app, name="sandbox", help="Run code in the sandbox; check which isolation tier works here.")
app.command("compare")(_compare)  # PPO vs DPO vs GRPO measured on one task
console = Console()

USER_ERRORS = (ConfigError, DataError, ModelError, RewardError)


def say(*objects) -> None:
    """Print library text as it is: messages quote paths, keys and values such as `[gsm8k:0.7]`
    that rich would otherwise read as markup and drop."""
    console.print(*objects, markup=False, highlight=False, soft_wrap=True)


def _split_args(args: list[str]) -> tuple[Optional[str], list[str]]:
    """`[CONFIG.yaml] [key=value ...]` -> (config path or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)  # one line, greppable
    raise typer.Exit(2)


@app.command()
def serve(
    model: str = typer.Argument(..., help="A model (name, directory, .gguf, Hub id) or a run directory (serves its final/)."),
    port: int = typer.Option(8000, "--port", help="TCP port on --host."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name clients use (default `policy`; the path works too)."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Default max_tokens when a request sets none."),
    precision: str = typer.Option("auto", "--precision", help="Engine weights: auto (bf16 where supported), bf16, fp32."),
    engine: str = typer.Option("auto", "--engine", help="Generation engine: auto (vLLM where installed, else hf), "
                               "vllm or hf (rollout.engine)."),
) -> None:
    """Serve a model behind the OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions,
    /v1/models): try a trained model with any client, or use it as an LLM judge."""
    try:
        gw = build_server(model, name=name, max_new_tokens=max_new_tokens, precision=precision, engine=engine)
    except USER_ERRORS as e:
        _fail(str(e))
    console.print(f"serving {', '.join(gw.model_names)} at http://{host}:{port}/v1 (Ctrl-C stops)")
    gw.serve_forever(port=port, host=host)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...]; no arguments runs the demo."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide the progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run directory of the same "
                                   "run_name (same as overwrite=true)."),
) -> None:
    """Train with GRPO. With no arguments: the calculator-tool demo on the embedded model.
    `resume=RUN_DIR [key=value ...]` continues a run from its newest checkpoint."""
    path, overrides = _split_args(list(args or []))
    if overwrite:
        overrides.append("overwrite=true")
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)
    try:
        cfg = resume_config(resume, overrides) if resume and path is None else load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))
    try:
        result = run_train(cfg, progress=not no_progress, print_fn=say)
    except USER_ERRORS as e:
        _fail(str(e))
    except RunAborted as e:
        console.print(f"[bold red]run stopped:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(3)
    s = result.summary
    if "eval_before" in s and "eval_after" in s:
        b, a = s["eval_before"]["success"], s["eval_after"]["success"]
        console.print(f"[bold]held-out greedy success: {b:.1%} -> {a:.1%} ({(a - b) * 100:+.1f} points)[/]")
    say(", ".join(f"{label}: {s[key]}" for key, label in RUN_FIGURES if key in s))  # what this algorithm measured
    say(f"run directory: {result.run_dir}")


# summary keys printed at the end of `actloop train`, where the run has them: online runs generate,
# offline trainers (dpo, sft) read their data and report what they trained on instead
RUN_FIGURES = (("steps", "steps"), ("seconds_per_step", "seconds per step"),
               ("generated_tokens_per_s", "generated tokens/s"), ("trained_tokens_per_s", "trained tokens/s"))


@app.command("eval")
def eval_cmd(
    model: str = typer.Option("smollm2-135m-instruct", "--model", help="Model name, directory, or a run directory."),
    task: str = typer.Option("calculator", "--task", help="A built-in task (`actloop tasks`), module:OBJECT or "
                             "file.py:OBJECT; or a mixture such as gsm8k:1,mbpp:1."),
    split: str = typer.Option("test", "--split", help="test, validation (mbpp, generated tasks) or train."),
    n: int = typer.Option(100, "--n", help="Problems (the first N of the split)."),
    samples: int = typer.Option(1, "--samples-per-problem", help="Samples per problem; >1 reports pass@k."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (needs 1 sample per problem)."),
    ks: Optional[str] = typer.Option(None, "--k", help="pass@k for these k, e.g. 1,5,10 (default 1 and the samples)."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    max_turns: int = typer.Option(3, "--max-turns"),
    seed: int = typer.Option(0, "--seed", help="Seed of generated splits (same as training's `seed`)."),
    workers: int = typer.Option(4, "--workers", help="Sandboxes grading code at once."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local dataset copies (default: "
                                           "$ACTLOOP_DATA_DIR, else ../shared/data); `hub` for the Hugging Face Hub."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results JSON (default: RUN_DIR/eval/<task>-<split>.json "
                                       "for a run directory, else runs/evals/<model>-<task>-<split>.json)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
    agent: Optional[str] = typer.Option(None, "--agent", help="Agent code (path/to/agent.py:run) to evaluate through "
                                        "the gateway on the --data rows, instead of --task (docs/agents.md)."),
    agent_data: Optional[str] = typer.Option(None, "--data", help="Rows (JSONL) handed to the --agent."),
    engine: str = typer.Option("auto", "--engine", help="Generation engine: auto (vLLM where installed, else hf), "
                               "vllm or hf (rollout.engine)."),
) -> None:
    """Accuracy (greedy) or pass@k of a model or checkpoint on a task's split: a table and a JSON file."""
    run_dir = None
    if (Path(model) / "final" / "config.json").exists():  # a run directory
        run_dir, model = Path(model), str(Path(model) / "final")
    if samples > 1 and temperature <= 0:
        _fail("--samples-per-problem > 1 needs --temperature > 0 (greedy samples are all the same)")
    try:
        k_list = [int(k) for k in ks.split(",")] if ks else None
    except ValueError:
        _fail(f"--k must be integers separated by commas, got {ks!r}")
    data_key = f"data.mix=[{task}]" if _is_mixture(task) else f"data.task={task}"
    if agent:
        if not agent_data:
            _fail("--agent needs --data: the rows to run it on")
        task, data_key = "agent", f"agent.entry={agent}"
    overrides = ([f"data.path={agent_data}", f"data.eval_path={agent_data}"] if agent else []) + [
                 f"model={model}", data_key, f"data.eval_size={n}", f"seed={seed}", "data.train_size=0",
                 f"data.split={split}", f"rollout.engine={engine}"] + ([f"data.dir={data_dir}"] if data_dir else [])
    try:
        cfg = load_config(None, overrides)
        t = build_run_task(cfg)
        if not t.eval_rows:
            _fail(f"{task} has no rows in split `{split}`")
        models = load_models(cfg.model)
    except USER_ERRORS as e:
        _fail(str(e))
    renderer = Renderer.from_config(models.tokenizer, cfg)
    try:
        gen = make_engine(cfg, models, renderer)
    except USER_ERRORS as e:
        _fail(str(e))
    del models.policy  # the engine samples from its own copy
    try:
        res = evaluate(gen, renderer, t, t.eval_rows, max_new_tokens, max_turns, samples_per_problem=samples,
                       temperature=temperature, ks=k_list, grade_workers=workers, keep_problems=True)
    except ValueError as e:
        _fail(str(e))
    res = {"model": model, "task": task, "split": split, "max_new_tokens": max_new_tokens, "max_turns": max_turns,
           "seed": seed, **res, "load": t.info.get("load", [])}
    if out is None:
        def slug(text: str) -> str:
            return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)

        name = f"{slug(task)}-{split}.json"
        out = run_dir / "eval" / name if run_dir else Path("runs") / "evals" / f"{slug(Path(model.rstrip('/')).name)}-{name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    if as_json:
        print(json.dumps({k: v for k, v in res.items() if k not in ("samples", "problems", "load")} | {"file": str(out)}))
        return
    console.print(_eval_table(res))
    say(f"results: {out}")


def _is_mixture(task: str) -> bool:
    """`gsm8k:1,mbpp:1` (weights after the colons), not `module:OBJECT` or `file.py:OBJECT`."""
    parts = [p.rpartition(":") for p in task.split(",")]
    try:
        return all(sep and float(w) >= 0 for _, sep, w in parts)
    except ValueError:
        return False


def _eval_table(res: dict) -> Table:
    title = f"{res['model']} on {res['task']} ({res['split']}, {res['n']} problems"
    title += f", {res['samples_per_problem']} samples each at T={res['temperature']:g})" if res["samples_per_problem"] > 1 \
        else ", greedy)"
    table = Table(title=escape(title))  # model paths and task names are text, not markup
    table.add_column("source")
    metric_names = ["success"] + [f"pass@{k}" for k in res.get("pass@k", {})]
    for m in metric_names + ["reward"]:
        table.add_column("accuracy" if m == "success" and res["samples_per_problem"] == 1 else m, justify="right")

    def row(name: str, d: dict) -> None:
        cells = [f"{d['success']:.1%}"] + [f"{v:.1%}" for v in d.get("pass@k", {}).values()] + [f"{d['reward']:.3f}"]
        table.add_row(escape(f"{name} (n={d['n']})"), *cells)

    for src, d in res.get("per_source", {}).items():
        row(src, d)
    row("all", res)
    table.caption = (f"{res['tool_calls_per_episode']:.2f} tool calls per episode, malformed {res['malformed_rate']:.1%}, "
                     f"truncated {res['truncated_rate']:.1%}, masked {res['masked']}, {res['seconds']:.0f}s "
                     f"(rollout {res['rollout_seconds']:.0f}s, grading {res['grading_seconds']:.0f}s)")
    if res["masked"]:
        table.caption += f"\nmasked (not graded), the first: {res.get('masked_reason') or '?'}"
    return table


@app.command("render")
def render_cmd(
    model: str = typer.Option("smollm2-135m-instruct", "--model", help="Model name or directory (its tokenizer is used)."),
    task: str = typer.Option("calculator", "--task", help="The task whose first training row is rendered."),
    reply: Optional[list[str]] = typer.Option(None, "--reply", help="A hypothetical assistant turn, in the format's "
                                              "own spelling; repeat for several turns."),
    chat_format: str = typer.Option("auto", "--chat-format", help="auto, hermes, qwen3 or harmony."),
    reasoning_effort: str = typer.Option("medium", "--reasoning-effort", help="harmony: low, medium or high."),
    seed: int = typer.Option(0, "--seed", help="Seed of generated splits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """How a task's episode looks to a model: the prompt (loss mask per span), the chat format, and
    for each --reply the parsed tool calls and the environment's answer."""
    overrides = [f"model={model}", f"data.task={task}", "data.train_size=1", "data.eval_size=1", f"seed={seed}",
                 f"rollout.chat_format={chat_format}", f"rollout.reasoning_effort={reasoning_effort}"]
    try:
        cfg = load_config(None, overrides)
        t = build_task(cfg)
        rows = t.train_rows or t.eval_rows
        if not rows:
            _fail(f"{task} has no rows to render")
        renderer = Renderer.from_config(load_tokenizer(resolve_model(cfg.model)), cfg)
        res = preview_episode(renderer, t.make_env(), rows[0], list(reply or []))
    except USER_ERRORS as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(res, default=str))
        return
    console.print(f"[bold]chat format:[/bold] {res['format']}   stop ids {res['stop_ids']}   "
                  f"stop strings {res['stop_strings']}   tools {res['tools']}")
    for span in res["spans"]:
        style = "green" if span["mask"] else "dim"
        console.rule(f"{span['kind']}: {span['tokens']} tokens, loss mask {span['mask']}", style=style)
        console.print(span["text"], style=style, markup=False, highlight=False)
    for i, r in enumerate(res["replies"], 1):
        console.rule(f"reply {i}")
        if r.get("skipped"):
            console.print(r["skipped"])
            continue
        calls = ", ".join(f"{c['name']}({json.dumps(c['arguments'])})" for c in r["tool_calls"]) or "none"
        console.print(f"tool calls: {calls}", markup=False, highlight=False)
        if r["reasoning"]:
            console.print(f"reasoning: {r['reasoning']}", markup=False, highlight=False)
        if r["parse_error"]:
            console.print(f"parse error: {r['parse_error']}", markup=False, highlight=False)
        console.print(f"environment: {r['env_reply'] or '(nothing)'}{'  [episode done]' if r['done'] else ''}",
                      markup=False, highlight=False)


@app.command("report")
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default RUN_DIR/report)."),
) -> None:
    """PNG plots of a run and one self-contained HTML page (summary, plots, alarms, samples, config)."""
    if not run_dir.is_dir():
        _fail(f"{run_dir} is not a directory")
    page = build_report(run_dir, out)
    raised = flag_totals(load_run(run_dir).metrics)
    if raised:
        say("flags raised (episodes): " + ", ".join(f"{k} {v}" for k, v in raised.items()))
    say(f"report: {page}")


@app.command("tasks")
def tasks_cmd() -> None:
    """The built-in tasks, one line each (any `module:OBJECT` or `file.py:OBJECT` Task works too)."""
    width = max(len(n) for n in BUILTIN)
    for name, t in BUILTIN.items():
        typer.echo(f"{name:<{width}}  {t.description}")


@app.command("grade")
def grade(
    task: str = typer.Option(..., "--task", help="A built-in task (`actloop tasks`), module:OBJECT or file.py:OBJECT."),
    id: int = typer.Option(..., "--id", help="MBPP task_id; HumanEval: N of HumanEval/N; otherwise the row's 0-based "
                           "index (generated tasks: the N-th held-out problem of seed 0)."),
    completion: Path = typer.Option(..., "--completion", help="File holding the model's answer."),
    data: Optional[Path] = typer.Option(None, "--data", help="JSONL rows (default: the task's dataset in "
                                        "$ACTLOOP_DATA_DIR, else ../shared/data; generated tasks: generated)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
) -> None:
    """Grade one completion against one task row with the task's rubric, exactly as training
    scores a final answer: reward, components, flags with evidence. Full reward is 1.0."""
    try:
        text = completion.read_text()
    except OSError as e:
        typer.echo(f"error: cannot read --completion {completion}: {e.strerror}", err=True)
        raise typer.Exit(2) from None
    try:
        t = resolve(task)
        row = find_row(t, id, grade_rows(t, data))
        record = {"task": t.name, "id": id, **grade_one(t, row, text)}
    except USER_ERRORS as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(record, ensure_ascii=False, default=str))
        return
    if record["masked"]:
        status = "masked (not graded)"
    else:
        counted = record["details_counted"]  # tests or constraints; else the one answer
        status = (f"reward {record['reward']:g}, " + (f"{record['passed']}/{record['total']} passed" if counted
                                                      else "correct" if record["success"] else "not correct"))
    typer.echo(f"{t.name} #{id}: {status}, components {record['components']}")
    typer.echo(f"  question: {_short(row_question(row))}")
    if t.gold is not None:
        try:
            typer.echo(f"  expected (the task's reference answer): {_short(t.gold(row))}")
        except Exception:  # a row the task's reference cannot answer: the grade above still stands
            pass
    for f in record["flags"]:
        typer.echo(f"  flag {f['name']} [{f.get('action', '')}]: {f.get('evidence', '')}")
    if record["errors"]:
        typer.echo("  errors (the reward functions'):\n" + "\n".join(record["errors"]))


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


@config_app.command("show")
def config_show(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...] to show resolved values."),
    as_yaml: bool = typer.Option(False, "--yaml", help="Print the resolved config as YAML, each key's doc as a "
                                 "comment (loadable as a config file)."),
    plain: bool = typer.Option(False, "--plain", help="One key per paragraph, no table (the default when the "
                               "output is not a terminal or is narrower than 120 columns)."),
) -> None:
    """Every key with its type, value (default unless overridden) and one line of doc."""
    path, overrides = _split_args(list(args or []))
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))
    if as_yaml:
        print(cfg.to_yaml_with_docs(), end="")
        return
    resolved = dict(_flat(cfg.to_dict()))
    rows = [(key, type_name(tp), repr(resolved[key]), doc) for key, tp, _default, doc in all_keys()]
    if plain or not console.is_terminal or console.width < 120:
        print(_plain_keys(rows, console.width if console.is_terminal else 100), end="")
        return
    table = Table(show_lines=False)
    table.add_column("key", no_wrap=True)
    table.add_column("type", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("doc", overflow="fold", ratio=1)
    for key, tp, value, doc in rows:  # docs hold brackets such as [gsm8k:0.7,mbpp:0.3]: never markup
        table.add_row(escape(key), escape(tp), escape(value), escape(doc))
    console.print(table)


def _plain_keys(rows: list[tuple[str, str, str, str]], width: int) -> str:
    """`key (type) = value` then the doc, indented and wrapped at `width`: readable piped or narrow."""
    import textwrap

    out = []
    for key, tp, value, doc in rows:
        out.append(f"{key} ({tp}) = {value}\n")
        out += [f"    {line}\n" for line in textwrap.wrap(doc, max(40, width - 4))]
    return "".join(out)


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
