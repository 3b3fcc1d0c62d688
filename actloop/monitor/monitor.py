"""The one object the trainer talks to while a run is watched.

    monitor = Monitor(cfg, run_dir, print_fn=print)
    alarms = monitor.log_step(record, scored)   # every step
    monitor.state_dict() / load_state_dict(d)   # in checkpoints: a resumed run continues identically
    monitor.close()

`log_step` adds to the record (in place) the flag rates, the cost monitor's totals and time
split, and `alarm/<name>: 1` for each alarm that fires; then writes it to metrics.jsonl (always),
TensorBoard and W&B (when configured), samples.jsonl every `monitor.sample_every` steps, and
alarms.jsonl. Nothing in here may stop a run: a sink, the sampler or a detector that raises is
disabled with one printed warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from actloop.monitor.alarms import Alarm, drop_idle_updates, step_alarms
from actloop.monitor.costs import CostMonitor
from actloop.monitor.metrics import JsonlSink
from actloop.monitor.samples import pick, sample_record
from actloop.monitor.sinks import Guarded, optional_sinks
from actloop.types import Scored

# the keys the alarm detectors read; the history kept for them (and checkpointed) holds only these
ALARM_KEYS = ("step", "reward_mean", "entropy", "kl", "grad_norm", "truncated_rate", "response_tokens_per_episode",
              "zero_variance_groups", "hack_flag_rate")


def flag_metrics(scored: Sequence[Scored], non_hack: Sequence[str]) -> dict[str, Any]:
    """Per step: `flag_rate` (episodes with any flag), `hack_flag_rate` (episodes with a flag
    that is not infrastructure trouble: not in `non_hack`, and not one whose policy masked the
    episode), and `flags/<name>` (episodes carrying that flag)."""
    if not scored:
        return {}
    skip = set(non_hack)
    counts: dict[str, int] = {}
    any_flag = hack = 0
    for s in scored:
        names = {str(f) for f in s.flags}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        any_flag += bool(names)
        hack += any(str(f) not in skip and getattr(f, "action", "") != "mask" for f in s.flags)
    out: dict[str, Any] = {"flag_rate": any_flag / len(scored), "hack_flag_rate": hack / len(scored)}
    out.update({f"flags/{n}": c for n, c in sorted(counts.items())})
    return out


class _LazyJsonl:
    """A JSONL file created at its first line (so a run without alarms has no alarms.jsonl)."""

    def __init__(self, path: Path):
        self.path, self.sink = path, None

    def log(self, record: dict[str, Any]) -> None:
        if self.sink is None:
            self.sink = JsonlSink(self.path)
        self.sink.log(record)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


class Monitor:
    def __init__(self, cfg, run_dir: str | Path, print_fn: Callable[[str], None] = print):
        self.cfg, self.mcfg = cfg, cfg.monitor
        self.run_dir, self.print = Path(run_dir), print_fn
        self.group_size = cfg.train.group_size
        self.costs = CostMonitor()
        self.history: list[dict[str, float]] = []
        self.alarm_states: dict[str, dict[str, Any]] = {}
        self.alarms: list[Alarm] = []
        self._warned: set[str] = set()
        self.metrics = Guarded("metrics.jsonl", JsonlSink(self.run_dir / "metrics.jsonl"), print_fn)
        self.samples = Guarded("samples.jsonl", _LazyJsonl(self.run_dir / "samples.jsonl"), print_fn)
        self.alarm_log = Guarded("alarms.jsonl", _LazyJsonl(self.run_dir / "alarms.jsonl"), print_fn)
        self.extra = {name: Guarded(name, sink, print_fn)
                      for name, sink in optional_sinks(self.mcfg, self.run_dir, cfg.to_dict(), print_fn).items()}

    # --- per step -------------------------------------------------------------------------

    def log_step(self, record: dict[str, Any], scored: Sequence[Scored] = ()) -> list[Alarm]:
        """Enrich `record` in place, write it everywhere, and return the alarms that fired."""
        step = int(record.get("step", len(self.history) + 1))
        self._guard("cost monitor", lambda: record.update(self._derived(record, scored)))
        fired: list[Alarm] = []
        if self.mcfg.alarms:
            n_groups = -(-len(scored) // max(1, self.group_size))
            fired = self._guard("alarms", lambda: self._alarms(record, n_groups)) or []
        record.update({f"alarm/{a.name}": 1 for a in fired})  # numbers only, like every other key
        self.metrics.call("log", record)
        for sink in self.extra.values():
            sink.call("log", record, step)
        if self._sample_due(step) and scored:
            self._guard("samples", lambda: self._write_samples(step, scored))
        return fired

    def _derived(self, record: dict[str, Any], scored: Sequence[Scored]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if scored and "response_tokens" in record:
            out["response_tokens_per_episode"] = round(record["response_tokens"] / len(scored), 3)
        out.update(flag_metrics(scored, self.mcfg.non_hack_flags))
        out.update(self.costs.update(record))
        return out

    def _alarms(self, record: dict[str, Any], n_groups: int = 0) -> list[Alarm]:
        keep = set(ALARM_KEYS) | set(self.mcfg.heldout_keys)
        # numbers, inf and nan included (an overflowing update is what the KL and gradient alarms are for)
        entry = {k: float(v) for k, v in drop_idle_updates(record).items()
                 if k in keep and isinstance(v, (int, float)) and not isinstance(v, bool)}
        dropped = record.get("dropped_groups")
        if isinstance(dropped, (int, float)) and dropped > 0 and n_groups and "zero_variance_groups" in entry:
            # dynamic sampling kept the `n_groups` with signal: the dropped groups are the all-equal ones
            entry["zero_variance_groups"] = (entry["zero_variance_groups"] * n_groups + dropped) / (n_groups + dropped)
        self.history.append(entry)
        fired, self.alarm_states = step_alarms(self.history, self.mcfg, self.alarm_states)
        for a in fired:
            self.print(str(a))
            self.alarm_log.call("log", a.to_dict())
        self.alarms += fired
        return fired

    def _sample_due(self, step: int) -> bool:
        n = self.mcfg.sample_every
        return n > 0 and (step == 1 or step % n == 0)

    def _write_samples(self, step: int, scored: Sequence[Scored]) -> None:
        for group, tag, s in pick(scored, self.group_size, self.mcfg.samples_per_step):
            self.samples.call("log", sample_record(step, group, tag, s))

    def _guard(self, name: str, fn: Callable[[], Any]) -> Any:
        if name in self._warned:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 — monitoring must never stop the run
            self._warned.add(name)
            self.print(f"warning: monitor {name} failed ({type(e).__name__}: {e}); disabled for this run")
            return None

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue identically: cumulative counters, the
        alarm history and hysteresis states, the W&B run id. JSON-able."""
        wandb = self.extra.get("wandb")
        return {
            "costs": self.costs.state_dict(),
            "history": [dict(h) for h in self.history],
            "alarm_states": {k: dict(v) for k, v in self.alarm_states.items()},
            "alarms": [a.to_dict() for a in self.alarms],
            "wandb_run_id": getattr(wandb.sink, "run_id", None) if wandb else None,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.costs.load_state_dict(d.get("costs", {}))
        self.history = [dict(h) for h in d.get("history", [])]
        self.alarm_states = {k: dict(v) for k, v in d.get("alarm_states", {}).items()}
        self.alarms = [Alarm(**a) for a in d.get("alarms", [])]
        wandb = self.extra.get("wandb")
        if wandb and d.get("wandb_run_id") and getattr(wandb.sink, "run", None) is None:
            wandb.sink.run_id = d["wandb_run_id"]

    def close(self) -> None:
        for g in (self.metrics, self.samples, self.alarm_log, *self.extra.values()):
            g.call("close")

    def summary(self) -> dict[str, Any]:
        """Totals for summary.json: tokens, judge cost, alarms fired."""
        t = self.costs.totals
        out = {f"total_{k}": round(v, 6) for k, v in sorted(t.items())}
        out["alarms"] = len(self.alarms)
        return out

