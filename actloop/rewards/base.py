"""Reward functions with TRL's signature, loaded by name and called safely.

    def my_reward(prompts, completions, **columns) -> list[float | None]

- `prompts`: each row's chat prompt, a list of {"role", "content"} dicts (TRL's conversational form);
- `completions`: plain strings — the final assistant message's answer (its reasoning left out:
  Qwen3 `<think>`, Harmony `analysis`), or the whole transcript after the prompt when
  `reward.completion=transcript`;
- every other column of the dataset row arrives as a keyword argument holding one value per
  completion (e.g. `answer_keys`); a function that names a `transcripts` parameter also gets every
  message after the prompt as one string per completion; one that names `trajectories` gets the
  full `Trajectory` objects (turns, tool calls, token counts); one that names `reasoning` gets every
  assistant turn's reasoning as one string per completion ('' for a model that does not reason).
- `None` means "not applicable" and is left out of the weighted total.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable

from actloop.types import Trajectory

RewardFunc = Callable[..., list[float | None]]


class RewardError(RuntimeError):
    """A reward function that cannot be loaded, or returned something unusable."""


def load_object(spec: str, what: str = "object", noun: str = "NAME") -> Any:
    """`package.module:NAME` (installed, or a module in the current directory) or
    `path/to/file.py:NAME` -> that module's attribute `NAME`.

    A file is imported once per path and registered in `sys.modules` (dataclasses and pickling
    need their module there); RewardError says what went wrong."""
    if ":" not in spec:
        raise RewardError(f"{what} `{spec}` must be written as module:{noun} or file.py:{noun}")
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.exists():
                raise RewardError(f"{what} file {target} does not exist")
            mod_name = f"actloop_user_{path.stem}_{abs(hash(str(path))):x}"
            module = sys.modules.get(mod_name)
            if module is None:
                mod_spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(mod_spec)
                sys.modules[mod_name] = module
                try:
                    mod_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
        else:
            module = _import_from_cwd_too(target)
    except RewardError:
        raise
    except ModuleNotFoundError as e:
        # the module itself was not found (not a module it imports)
        if not target.endswith(".py") and e.name and target.startswith(e.name):
            raise RewardError(f"cannot import `{target}` for {what} `{spec}`: {e} (looked in the installed "
                              f"packages and in the current directory {Path.cwd()}; a file elsewhere is written "
                              f"`path/to/{target.replace('.', '/')}.py:{name}`)") from e
        raise RewardError(f"cannot import `{target}` for {what} `{spec}`: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise RewardError(f"cannot import `{target}` for {what} `{spec}`: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1, cutoff=0.5) or \
            [n for n in public if n.lower() == name.lower()]
        hint = f"; did you mean `{target}:{close[0]}`?" if close else ""
        raise RewardError(f"`{target}` has no {noun.lower()} `{name}`{hint}")
    return getattr(module, name)


def _import_from_cwd_too(target: str):
    """`importlib.import_module`, with the current directory searched last: `my_rewards:f` finds
    ./my_rewards.py under the `actloop` script as it does under `python -m actloop`, and never
    shadows an installed package of the same name."""
    cwd = str(Path.cwd())
    if cwd in sys.path or "" in sys.path:
        return importlib.import_module(target)
    sys.path.append(cwd)
    try:
        return importlib.import_module(target)
    finally:
        sys.path.remove(cwd)


def load_reward_func(spec: str) -> RewardFunc:
    """`package.module:function` or `path/to/file.py:function` -> the function."""
    fn = load_object(spec, "reward function", "function")
    if not callable(fn):
        raise RewardError(f"`{spec}` is not a function")
    return fn


# what call_reward_func passes besides the row's columns
SUPPLIED = ("prompts", "completions", "trajectories", "reasoning", "transcripts")


def required_columns(fn: Callable) -> list[str]:
    """The row columns `fn` cannot do without: its parameters without a default, other than
    those `call_reward_func` always supplies (a column missing from a row would arrive as None)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty
            and p.name not in SUPPLIED]


def wants(fn: Callable, param: str) -> bool:
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def completion_text(traj: Trajectory, mode: str) -> str:
    return traj.transcript if mode == "transcript" else traj.final_text


def call_reward_func(fn: RewardFunc, trajectories: list[Trajectory], mode: str = "final") -> list[float | None]:
    """Call `fn` TRL-style on a batch of trajectories and check what it returns."""
    prompts = [[m.to_dict() for m in t.prompt_messages] for t in trajectories]
    completions = [completion_text(t, mode) for t in trajectories]
    columns: dict[str, list[Any]] = {}
    keys = {k for t in trajectories for k in t.row if k != "prompt"}
    for k in sorted(keys):
        columns[k] = [t.row.get(k) for t in trajectories]
    if wants(fn, "trajectories"):
        columns["trajectories"] = trajectories
    if wants(fn, "reasoning"):  # the chain of thought, only for functions that ask for it
        columns["reasoning"] = [t.reasoning for t in trajectories]
    if wants(fn, "transcripts"):  # the whole multi-turn transcript, for functions that ask for it
        columns["transcripts"] = [t.transcript for t in trajectories]
    out = fn(prompts=prompts, completions=completions, **columns)
    name = getattr(fn, "__name__", repr(fn))
    if inspect.isawaitable(out):
        import asyncio

        out = asyncio.run(out)  # type: ignore[arg-type]
    if not isinstance(out, (list, tuple)) or len(out) != len(trajectories):
        raise RewardError(f"reward function `{name}` must return a list of {len(trajectories)} floats, got {out!r:.200}")
    result: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            result.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward function `{name}` returned {v!r} at index {i}; expected a number or None") from None
        if not math.isfinite(f):
            raise RewardError(f"reward function `{name}` returned {f} at index {i}")
        result.append(f)
    return result
