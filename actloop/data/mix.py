"""Weighted mixtures of tasks, and metrics per source.

    data.mix=[gsm8k:0.7,mbpp:0.3]          # or, in YAML:  mix: ["gsm8k:0.7", "mbpp:0.3"]

Every row carries a `source` column (the task's name, or a custom file's stem). A mixture's
training rows hold each source in proportion to its weight (largest remainder, so the counts
are exact), each source's rows drawn without replacement in a seeded order (cycled when a
source has fewer rows than its share), then shuffled together under the seed: the trainer's
uniform sampler then draws sources with the mixture's weights, deterministically under the
seed. `MixedEnv` and `MixedRubric` send each row to its own source's environment and rubric.

`per_source_metrics(scored)` gives reward, success and tool use per source for the step logs.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from actloop.config import ConfigError
from actloop.rewards.rubric import Rubric
from actloop.types import Scored, Trajectory

Row = dict[str, Any]
SOURCE = "source"


def parse_mix(value: Any) -> dict[str, float]:
    """`data.mix` -> {source: weight}. Accepts a mapping, a list of `name:weight` strings, or one
    string `a:1,b:2`. Weights must be finite and > 0; they need not sum to 1."""
    if not value:
        return {}
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    items: list[tuple[str, Any]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for entry in value:
            if isinstance(entry, Mapping):
                items += list(entry.items())
                continue
            name, sep, w = str(entry).strip().rpartition(":")
            if not sep or not name:
                raise ConfigError(f"data.mix entry `{entry}` must be written as name:weight, e.g. gsm8k:0.7")
            items.append((name.strip(), w))
    else:
        raise ConfigError(f"data.mix must be a list of name:weight entries, got {value!r}")
    out: dict[str, float] = {}
    for name, w in items:
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise ConfigError(f"data.mix: weight of `{name}` must be a number, got {w!r}") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.mix: weight of `{name}` must be > 0, got {w!r}")
        if name in out:
            raise ConfigError(f"data.mix names `{name}` twice")
        out[name] = weight
    return out


def allocate(total: int, weights: Mapping[str, float], min_each: int = 0) -> dict[str, int]:
    """Split `total` into integer counts proportional to `weights` (largest remainder; ties by
    order), each at least `min_each`."""
    s = sum(weights.values())
    exact = {k: total * w / s for k, w in weights.items()}
    counts = {k: int(math.floor(v)) for k, v in exact.items()}
    left = total - sum(counts.values())
    for k in sorted(exact, key=lambda k: -(exact[k] - counts[k]))[:left]:
        counts[k] += 1
    return {k: max(c, min_each) for k, c in counts.items()}


def mix_rows(pools: Mapping[str, Sequence[Row]], weights: Mapping[str, float], total: int, seed: int) -> list[Row]:
    """`total` rows, each source's share by weight, shuffled together; deterministic under `seed`."""
    counts = allocate(total, weights)
    out: list[Row] = []
    for name in weights:
        pool = list(pools[name])
        if counts[name] and not pool:
            raise ConfigError(f"data.mix: source `{name}` has no rows")
        rng = random.Random(f"mix-{seed}-{name}")
        order: list[int] = []
        while len(order) < counts[name]:  # passes without replacement, cycled when short
            p = list(range(len(pool)))
            rng.shuffle(p)
            order += p
        out += [pool[i] for i in order[: counts[name]]]
    random.Random(f"mix-{seed}").shuffle(out)
    return out


def tag(rows: Sequence[Row], source: str) -> list[Row]:
    """Copies of `rows` with the `source` column set."""
    return [{**r, SOURCE: source} for r in rows]


class MixedEnv:
    """One environment per episode, chosen by the row's `source` column."""

    def __init__(self, factories: Mapping[str, Callable[[], Any]]):
        self.factories, self.env = factories, None

    def reset(self, row: Row):
        src = row.get(SOURCE)
        if src not in self.factories:
            raise KeyError(f"row source {src!r} is not in the mixture ({', '.join(self.factories)})")
        self.close()
        self.env = self.factories[src]()
        return self.env.reset(row)

    @property
    def tool_prompt(self) -> str:
        """The current source's tool-prompt wording (read after `reset`)."""
        return getattr(self.env, "tool_prompt", "") or ""

    def step(self, message):
        return self.env.step(message)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


@dataclass
class MixedRubric(Rubric):
    """Scores each trajectory with its source's rubric (keeping the batch order); errors and flag
    counts of the parts are gathered here too."""

    parts: dict[str, Rubric] = field(default_factory=dict)

    def score(self, trajectories: list[Trajectory], details: list[dict[str, Any]] | None = None) -> list[Scored]:
        by_source: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(trajectories):
            src = t.row.get(SOURCE)
            if src not in self.parts:
                raise KeyError(f"trajectory source {src!r} is not in the mixture ({', '.join(self.parts)})")
            by_source[src].append(i)
        out: list[Scored | None] = [None] * len(trajectories)
        infos: list[dict[str, Any]] = [{} for _ in trajectories]
        for src, idx in by_source.items():
            part = self.parts[src]
            n_err, before = len(part.errors), part.flag_counts.copy()
            sub_details: list[dict[str, Any]] = []
            for i, s in zip(idx, part.score([trajectories[i] for i in idx], details=sub_details)):
                out[i] = s
            for i, d in zip(idx, sub_details):
                infos[i] = d
            self.errors += [f"[{src}] {e}" for e in part.errors[n_err:]]
            self.flag_counts.update(part.flag_counts - before)
        if details is not None:
            details[:] = infos
        return out  # type: ignore[return-value]


def per_source_metrics(scored: Sequence[Scored], prefix: str = "source") -> dict[str, float]:
    """`{prefix}/{source}/{metric}` for each source in the batch: n, reward_mean, reward_std,
    success, tool_calls_per_episode, truncated_rate, masked. Rows without a `source` count as
    `default`. Call it on a step's scored trajectories and merge it into the step record."""
    groups: dict[str, list[Scored]] = defaultdict(list)
    for s in scored:
        groups[str(s.trajectory.row.get(SOURCE, "default"))].append(s)
    out: dict[str, float] = {}
    for src in sorted(groups):
        g = groups[src]
        r = [s.reward for s in g]
        m = sum(r) / len(r)
        key = f"{prefix}/{src}/"
        out[key + "n"] = len(g)
        out[key + "reward_mean"] = m
        out[key + "reward_std"] = (sum((x - m) ** 2 for x in r) / (len(r) - 1)) ** 0.5 if len(r) > 1 else 0.0
        out[key + "success"] = sum(s.success for s in g) / len(g)
        out[key + "tool_calls_per_episode"] = sum(s.trajectory.num_tool_calls for s in g) / len(g)
        out[key + "truncated_rate"] = sum(s.trajectory.truncated for s in g) / len(g)
        out[key + "masked"] = sum(s.masked for s in g)
    return out
