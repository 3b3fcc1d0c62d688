"""Optional metric sinks (TensorBoard, Weights & Biases) and the guard that keeps any sink from
blocking or crashing the training loop: a sink that raises is disabled with one warning."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (booleans as 0/1); strings and lists are left out."""
    out = {}
    for k, v in record.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


class TensorBoardSink:
    """Scalars to RUN_DIR/tensorboard via torch.utils.tensorboard (or tensorboardX). The writer
    starts at the first logged step with `purge_step` there: a resumed run hides what the killed
    run logged after its checkpoint, so each step shows once."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from tensorboardX import SummaryWriter  # raises ImportError when neither is installed
        self._writer_cls, self.log_dir, self.writer = SummaryWriter, str(log_dir), None

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if self.writer is None:
            self.writer = self._writer_cls(self.log_dir, purge_step=step)
        for k, v in numeric(record).items():
            self.writer.add_scalar(k, v, step)
        for k in record:
            if k.startswith("alarm/"):
                self.writer.add_text("alarms", k.split("/", 1)[1], step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbSink:
    """A Weights & Biases run, started at the first logged step (so a resumed run can hand over
    its run id first). WANDB_MODE=offline is honoured by wandb itself."""

    def __init__(self, project: str, run_dir: str | Path, config: Mapping[str, Any] | None = None,
                 run_id: str | None = None):
        import wandb  # raises ImportError when not installed

        self.wandb, self.project, self.run_dir = wandb, project, Path(run_dir)
        self.config, self.run_id, self.run = dict(config or {}), run_id, None

    def _start(self) -> None:
        kw: dict[str, Any] = {"project": self.project, "dir": str(self.run_dir), "name": self.run_dir.name,
                              "config": self.config}
        if self.run_id:
            kw.update(id=self.run_id, resume="allow")
        self.run = self.wandb.init(**kw)
        self.run_id = self.run.id

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if self.run is None:
            self._start()
        self.run.log(numeric(record), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class Guarded:
    """Calls into a sink; the first exception disables it and prints one warning."""

    def __init__(self, name: str, sink: Any, warn: Callable[[str], None]):
        self.name, self.sink, self.warn, self.enabled = name, sink, warn, True

    def call(self, method: str, *args: Any) -> None:
        if not self.enabled:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as e:  # noqa: BLE001 — a sink must never stop the run
            self.enabled = False
            self.warn(f"warning: metric sink {self.name} failed ({type(e).__name__}: {e}); disabled for this run")


def optional_sinks(cfg, run_dir: Path, config_dict: Mapping[str, Any], warn: Callable[[str], None]) -> dict[str, Any]:
    """TensorBoard and W&B sinks as configured; one that cannot start is skipped with a warning."""
    out: dict[str, Any] = {}
    if cfg.tensorboard:
        try:
            out["tensorboard"] = TensorBoardSink(run_dir / "tensorboard")
        except Exception as e:  # noqa: BLE001
            warn(f"warning: monitor.tensorboard=true but TensorBoard is unavailable ({e}); "
                 "`pip install tensorboard` to enable it")
    if cfg.wandb_project:
        try:
            out["wandb"] = WandbSink(cfg.wandb_project, run_dir, config_dict)
        except Exception as e:  # noqa: BLE001
            warn(f"warning: monitor.wandb_project is set but wandb is unavailable ({e}); `pip install wandb` "
                 f"to enable it (WANDB_MODE={os.environ.get('WANDB_MODE', 'online')})")
    return out
