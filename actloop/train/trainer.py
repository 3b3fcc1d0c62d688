"""`train(cfg)`: the one entry point of every trainer. It runs `cfg.algo`: the online RL loop
(`actloop.train.rl.loop`: GRPO, RLOO, PPO, ..., online DPO) or the trainer its row of
`actloop.algos.ALGORITHMS` names (offline DPO, SFT: `actloop.train.offline`)."""

from __future__ import annotations

import importlib

import torch

from actloop.algos import ALGORITHMS
from actloop.algos.algorithms import online_algorithms
from actloop.config import Config, ConfigError
from actloop.train.rl.loop import train_online
from actloop.train.runtime import rundir
from actloop.train.runtime.distributed import launched_by_torchrun
from actloop.train.runtime.run import RunResult, close_runs


def train(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """Run `cfg.algo`: the online RL loop (actloop.train.rl.loop), or the trainer its row of ALGORITHMS names."""
    threads = torch.get_num_threads()
    try:
        alg = ALGORITHMS[cfg.algo]
        if alg.in_loop(cfg):  # grpo, rloo, ..., and online DPO: the rollout loop
            return train_online(cfg, progress=progress, print_fn=print_fn)
        if launched_by_torchrun():  # each rank would run its own copy into the same run directory
            raise ConfigError(f"algo={cfg.algo} runs in one process; launch it without torchrun")

        if cfg.resume:
            raise ConfigError(f"resume is for the algorithms of the rollout loop ({', '.join(online_algorithms())}, "
                              f"dpo with dpo.online=true), not {cfg.algo} here")

        module, name = alg.trainer.split(":")
        return getattr(importlib.import_module(module), name)(cfg, progress=progress, print_fn=print_fn)
    finally:
        close_runs()  # the run's engine (threads, vLLM, Ray actors) and the model copy it holds
        rundir.release()  # the run directory's lock (the kernel drops it anyway when the process ends)
        torch.set_num_threads(cfg.train.threads or threads)  # the loop kept one for itself (train_online)
