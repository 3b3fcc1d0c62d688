"""Prompts for training: shuffled passes over the training rows, deterministic under the seed,
resumable (`state_dict`)."""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Shuffled passes over the training rows, deterministic under the seed."""

    def __init__(self, rows: list[dict[str, Any]], seed: int):
        self.rows, self.rng, self.order, self.pos = rows, random.Random(seed), [], 0

    def next(self, n: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < n:
            if self.pos >= len(self.order):
                self.order, self.pos = list(range(len(self.rows))), 0
                self.rng.shuffle(self.order)
            out.append(self.rows[self.order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rng.setstate(d["rng"])
        self.order, self.pos = list(d["order"]), int(d["pos"])
