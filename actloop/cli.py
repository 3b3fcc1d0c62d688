"""The `actloop` command. Wiring only: parse arguments, call the library, print results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from actloop.config import ConfigError, all_keys, load_config, type_name

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Agentic RL of open LLMs: think, act, feedback.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
app.add_typer(config_app, name="config")
console = Console()

try:  # the sandbox commands, when that package is present
    from actloop.sandbox.cli import app as sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="Run code in the sandbox; check which isolation tier works here.")
except ImportError:  # pragma: no cover
    pass

try:  # `actloop compare`, PPO vs DPO vs GRPO measured on one task
    from actloop.train.compare import compare as _compare

    app.command("compare")(_compare)
except ImportError:  # pragma: no cover
    pass

try:  # `actloop grade`, from the rewards package
    from actloop.rewards.cli import grade as _grade

    app.command("grade")(_grade)
except ImportError:  # pragma: no cover
    pass


def _user_errors() -> tuple[type[Exception], ...]:
    from actloop.data.jsonl import DataError
    from actloop.models import ModelError
    from actloop.rewards import RewardError

    return ConfigError, DataError, ModelError, RewardError


USER_ERRORS = _user_errors()


def _split_args(args: list[str]) -> tuple[Optional[str], list[str]]:
    """`[CONFIG.yaml] [key=value ...]` -> (config path or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(2)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...]; no arguments runs the demo."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide the progress bar."),
) -> None:
    """Train with GRPO. With no arguments: the calculator-tool demo on the embedded model."""
    from actloop.train.trainer import train as run_train

    path, overrides = _split_args(list(args or []))
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))
    try:
        result = run_train(cfg, progress=not no_progress, print_fn=console.print)
    except USER_ERRORS as e:
        _fail(str(e))
    s = result.summary
    if "eval_before" in s and "eval_after" in s:
        b, a = s["eval_before"]["success"], s["eval_after"]["success"]
        console.print(f"[bold]held-out greedy success: {b:.1%} -> {a:.1%} ({(a - b) * 100:+.1f} points)[/]")
    console.print(f"seconds per step: {s['seconds_per_step']}, generated tokens/s: {s['generated_tokens_per_s']}")
    console.print(f"run directory: {result.run_dir}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Option("smollm2-135m-instruct", "--model", help="Model name, directory, or a run directory."),
    task: str = typer.Option("calculator", "--task", help="Task to evaluate on."),
    n: int = typer.Option(100, "--n", help="Held-out problems."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    max_turns: int = typer.Option(3, "--max-turns"),
    seed: int = typer.Option(0, "--seed", help="Seed of the held-out split (same as training's `seed`)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
) -> None:
    """Greedy success of a model or checkpoint on a task's held-out split."""
    from actloop.data.tasks import build_task
    from actloop.models import load_models
    from actloop.rollout.engine import HFEngine
    from actloop.rollout.renderer import Renderer
    from actloop.train.evaluate import evaluate

    if (Path(model) / "final" / "config.json").exists():  # a run directory
        model = str(Path(model) / "final")
    try:
        cfg = load_config(None, [f"model={model}", f"data.task={task}", f"data.eval_size={n}", f"seed={seed}",
                                 "data.train_size=0"])
        t = build_task(cfg)
        models = load_models(cfg.model)
    except USER_ERRORS as e:
        _fail(str(e))
    renderer = Renderer(models.tokenizer)
    engine = HFEngine(models.policy, models.tokenizer, renderer.eos_token_ids, renderer.stop_strings)
    res = evaluate(engine, renderer, t, t.eval_rows, max_new_tokens, max_turns)
    if as_json:
        print(json.dumps({k: v for k, v in res.items() if k != "samples"} | {"model": model, "task": task}))
    else:
        console.print(f"{model} on {task}: greedy success {res['success']:.1%} over {res['n']} problems "
                      f"({res['tool_calls_per_episode']:.2f} tool calls per episode, {res['seconds']:.0f}s)")


@config_app.command("show")
def config_show(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...] to show resolved values."),
    as_yaml: bool = typer.Option(False, "--yaml", help="Print the resolved config as YAML."),
) -> None:
    """Every key with its type, value (default unless overridden) and one line of doc."""
    path, overrides = _split_args(list(args or []))
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))
    if as_yaml:
        print(cfg.to_yaml(), end="")
        return
    table = Table(show_lines=False)
    table.add_column("key", no_wrap=True)
    table.add_column("type", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("doc", overflow="fold", ratio=1)
    resolved = dict(_flat(cfg.to_dict()))
    for key, tp, _default, doc in all_keys():
        table.add_row(key, type_name(tp), repr(resolved[key]), doc)
    console.print(table)


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
