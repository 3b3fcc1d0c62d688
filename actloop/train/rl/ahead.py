"""Rollouts that run ahead of training (`rollout.max_staleness = K > 0`): asynchronous RL.

A producer thread starts groups (one prompt, G episodes) whenever the staleness bound allows,
each on a thread of its own, so that while the trainer updates, the engine keeps sampling and the
environments keep stepping; the trainer takes the oldest finished groups, waiting only for a running group at its last chance
(K updates old: a newer group that finished first must not push it past the bound). The bound is AReaL's
(`max_head_offpolicyness`, Fu et al. 2025, sec. 5.1): with P prompts a step and v the policy
version now in the engine (weight syncs so far), a new group may start only while

    groups admitted (trained, finished or running) < (v + K + 1) * P

so a group started under version v is meant for a step that trains version <= v + K. When the
trainer takes a group its staleness (proximal version - oldest version of its tokens) is checked
again, and a group over K (possible when dynamic sampling or a resume reorders the groups) is
dropped and counted (`stale_dropped_groups`), never trained. K = 0
never comes here: the trainer's synchronous `rollout_groups` runs instead, exactly as before.

Episodes span versions: the trainer's update and weight sync run between two decode steps
(`Engine.run_in_flight`: vLLM keeps its running requests; the HF engine finishes their turn
first), so an episode's later turns, or the later tokens of a turn, come from newer weights;
each token carries its version (`Turn.versions`). Dynamic sampling drops all-equal groups as they
finish (they free their place in the bound); after `max_refill_rounds` x P drops within one step
the filter lets the next groups through, as the synchronous loop ends a step with what it has.

Every group has an id (`gid`, draw order over the run) and every group event goes to
RUN_DIR/groups.jsonl (trained at step s with its staleness, dropped as stale or as all-equal).
The checkpoint holds the sampler as the producer left it, the finished groups not yet trained (as
they are) and the rows of the groups still running (sampled again after a resume, under the same
id): a resumed run trains every group exactly once (docs/async.md says why it is not
bit-identical to an uninterrupted one).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from actloop.algos.batching import dynamic_sampling_filter
from actloop.types import Scored


@dataclass
class AheadGroup:
    gid: int  # draw order over the run: the group's id in groups.jsonl
    row: dict[str, Any]
    scored: list[Scored] = field(default_factory=list)
    first_version: int = 0  # oldest policy version of its tokens (the version it started under if none)
    last_version: int = 0
    scoring_s: float = 0.0
    done_at: float = 0.0


@dataclass
class AheadBatch:
    """What one step takes: `scored` (P groups, oldest first) and the step's bookkeeping."""

    scored: list[Scored]
    seen: list[Scored]  # every trajectory scored for this step, dropped groups included (failure counts)
    dropped: int  # groups dynamic sampling dropped
    scoring_s: float
    metrics: dict[str, Any]


class _Gate:
    """The engine as the producer's episodes see it: refuses new requests once the producer is
    closed, so that its running episodes end (as failed, discarded) instead of outliving the run."""

    def __init__(self, engine: Any):
        self.engine, self.closed = engine, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit(self, prompt: list[int], params: Any):
        if self.closed:
            raise RuntimeError("the producer was closed")
        return self.engine.submit(prompt, params)

    def generate(self, prompts: list[list[int]], params: Any):
        if self.closed:
            raise RuntimeError("the producer was closed")
        return self.engine.generate(prompts, params)


class AheadRollouts:
    """The producer of `rollout.max_staleness = K > 0` (module docstring).

    run_group(engine, rows) -> trajectories: G episodes of one row (the task's episode runner);
    score(trajectories) -> scored, shaped. `version`: the policy version in the engine now."""

    def __init__(self, cfg: Any, engine: Any, sampler: Any, run_group: Callable, score: Callable, version: int,
                 run_dir: Path | None = None):
        self.K, self.P, self.G = cfg.rollout.max_staleness, cfg.train.prompts_per_step, cfg.train.group_size
        self.filter = cfg.train.dynamic_sampling
        self.max_filter_drops = cfg.train.max_refill_rounds * self.P
        self.engine, self.gate, self.sampler = engine, _Gate(engine), sampler
        self.run_group, self.score = run_group, score
        self.version = version
        self.cond = threading.Condition()
        self.next_gid = 0
        self.running: dict[int, AheadGroup] = {}
        self.group_threads: list[threading.Thread] = []  # the running groups' (joined by close)
        self.finished: list[AheadGroup] = []
        self.redo: list[AheadGroup] = []  # rows of groups running at the checkpoint: sampled first
        self.trained = version * self.P  # groups trained so far (P a step; a resume starts at its step)
        self.seen: list[Scored] = []  # scored since the last take, dropped groups included
        self.filter_drops = 0  # dynamic sampling drops since the last take
        self.gate_closed_s, self._gate_since = 0.0, None  # engine waiting for weights (bound reached)
        self.ledger = open(run_dir / "groups.jsonl", "a") if run_dir is not None else None
        self.events: list[dict[str, Any]] = []  # this step's group events, written with its metrics
        self.error: BaseException | None = None
        self.closing = False
        self.thread: threading.Thread | None = None

    # ---------------------------------------------------------------- producer side
    def start(self) -> None:
        self.thread = threading.Thread(target=self._produce, daemon=True, name="ahead-producer")
        self.thread.start()

    def _admitted(self) -> int:
        return self.trained + len(self.finished) + len(self.running)

    def _produce(self) -> None:
        while True:
            with self.cond:
                while not self.closing and self._admitted() >= (self.version + self.K + 1) * self.P:
                    if self._gate_since is None:
                        self._gate_since = time.time()
                    self.cond.wait()
                if self._gate_since is not None:
                    self.gate_closed_s += time.time() - self._gate_since
                    self._gate_since = None
                if self.closing:
                    return
                if self.redo:
                    g = self.redo.pop(0)
                else:
                    g = AheadGroup(self.next_gid, self.sampler.next(1)[0])
                    self.next_gid += 1
                g.first_version = g.last_version = self.version
                self.running[g.gid] = g
            t = threading.Thread(target=self._group, args=(g,), daemon=True, name=f"ahead-group-{g.gid}")
            self.group_threads = [x for x in self.group_threads if x.is_alive()] + [t]
            t.start()

    def _group(self, g: AheadGroup) -> None:
        try:
            trajs = self.run_group(self.gate, [g.row] * self.G)
            t0 = time.time()
            g.scored = self.score(trajs)
            g.scoring_s = time.time() - t0
        except BaseException as e:  # noqa: BLE001 - a closed producer's episodes fail; anything else stops the run
            with self.cond:
                self.running.pop(g.gid, None)
                if not self.closing and self.error is None:
                    self.error = e
                self.cond.notify_all()
            return
        spans = [s.trajectory.version_span for s in g.scored if s.trajectory.version_span is not None]
        if spans:
            g.first_version, g.last_version = min(a for a, _ in spans), max(b for _, b in spans)
        g.done_at = time.time()
        with self.cond:
            self.running.pop(g.gid, None)
            if self.closing:
                return
            if self.filter and self.filter_drops < self.max_filter_drops and not self._has_signal(g):
                self.filter_drops += 1  # frees its place: another group starts
                self.seen += g.scored
                self._event(g, "dropped_all_equal")
            else:
                self.finished.append(g)
            self.cond.notify_all()

    def _has_signal(self, g: AheadGroup) -> bool:
        rewards = torch.tensor([[s.reward for s in g.scored]])  # [1, G]
        valid = torch.tensor([[not s.masked for s in g.scored]])  # [1, G]
        keep, _ = dynamic_sampling_filter(rewards, valid)
        return bool(keep[0])

    # ---------------------------------------------------------------- trainer side
    def take(self, step: int) -> AheadBatch:
        """The P oldest finished groups within the bound for step `step` (proximal version step - 1),
        waiting for them; groups over the bound are dropped and counted."""
        version = step - 1
        t0 = time.time()
        out: list[AheadGroup] = []
        stale = 0
        with self.cond:
            while len(out) < self.P:
                if self.error is not None:
                    raise RuntimeError(f"a rollout group failed: {self.error!r}") from self.error
                for g in [g for g in self.finished if version - g.first_version > self.K]:  # too late: never trained
                    self.finished.remove(g)
                    stale += 1
                    self.seen += g.scored
                    self._event(g, "dropped_stale", staleness=version - g.first_version)
                # a running group at its last chance (K updates old now) keeps its place: a newer group that
                # finished first does not push it past the bound
                last_chance = sum(1 for g in self.running.values() if version - g.first_version == self.K)
                self.finished.sort(key=lambda g: (g.first_version, g.gid))  # oldest first
                while self.finished and len(out) < self.P - min(last_chance, self.P - len(out)):
                    out.append(self.finished.pop(0))
                    self.trained += 1  # still admitted while this take waits for the rest (the bound)
                if len(out) < self.P:
                    self.cond.notify_all()  # a stale drop freed places
                    self.cond.wait()
            wait_s = time.time() - t0
            gate_s = self.gate_closed_s + (time.time() - self._gate_since if self._gate_since else 0.0)
            self.gate_closed_s = 0.0
            if self._gate_since is not None:
                self._gate_since = time.time()
            seen, self.seen = self.seen, []
            dropped, self.filter_drops = self.filter_drops, 0
            lags = [version - g.first_version for g in out]
            for g, lag in zip(out, lags):
                self._event(g, "trained", staleness=lag)
                for s in g.scored:
                    s.trajectory.info["policy"] = {"group_id": g.gid, "first_version": g.first_version,
                                                   "last_version": g.last_version, "staleness": lag}
            self._flush(step)
            metrics = {"staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
                       "stale_dropped_groups": stale, "trainer_wait_s": round(wait_s, 3),
                       "engine_wait_s": round(gate_s, 3), "groups_running": len(self.running),
                       "groups_ready": len(self.finished)}
        scored = [s for g in out for s in g.scored]
        return AheadBatch(scored, seen + scored, dropped, sum(g.scoring_s for g in out), metrics)

    def synced(self, version: int) -> None:
        """The engine holds policy `version` now: the bound moves on by P groups."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def _event(self, g: AheadGroup, event: str, **more: Any) -> None:
        self.events.append({"group_id": g.gid, "event": event, "first_version": g.first_version,
                            "last_version": g.last_version, **more})

    def _flush(self, step: int) -> None:
        if self.ledger is not None:
            for e in self.events:
                self.ledger.write(json.dumps({"step": step, **e}) + "\n")
            self.ledger.flush()
        self.events = []

    def __enter__(self) -> "AheadRollouts":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- checkpoint and end
    def state_dict(self) -> dict[str, Any]:
        """The sampler as the producer left it, the finished groups as they are, the running ones'
        rows (sampled again after a resume, under their ids)."""
        with self.cond:
            return {"sampler": self.sampler.state_dict(), "next_gid": self.next_gid,
                    "finished": list(self.finished),
                    "redo": [AheadGroup(g.gid, g.row) for g in [*self.redo, *self.running.values()]]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.sampler.load_state_dict(d["sampler"])
        self.next_gid, self.finished = d["next_gid"], list(d["finished"])
        self.redo = sorted(d["redo"], key=lambda g: g.gid)

    def close(self) -> None:
        """Stop starting groups; running episodes' next engine requests are refused (they end)."""
        with self.cond:
            self.closing, self.gate.closed = True, True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=10)
        # the running groups end at their episodes' next engine request (refused now); the engine is still
        # open for the one in flight. Waited for, so that none is inside torch when the interpreter exits
        # (an abort: "terminate called without an active exception")
        deadline = time.time() + 60
        for t in list(self.group_threads):
            t.join(timeout=max(0.0, deadline - time.time()))
        if self.ledger is not None:
            self.ledger.close()
