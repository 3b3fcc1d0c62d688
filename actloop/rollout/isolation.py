"""Engine failures isolated: a generation request that fails costs its own trajectories, not the run.

`IsolatedEngine` wraps any engine (`make_engine` returns one) and changes only what happens when
`generate` raises:

    HTTP 408/429/5xx, refused connection, timeout,      retried, the whole batch, with exponential
    a dead Ray actor (RayEngine replaced it already)    backoff (rollout.engine_retries, ..._backoff_s)
    out of memory (CUDA or CPU) on a batch              the batch split in halves, each tried again
    anything else (HTTP 400 for one prompt, a reply     the batch split in halves, so one bad prompt
    that cannot be parsed)                              fails alone

A prompt that still fails gets a `Completion` with `error` set and no tokens; the episode runner
ends that episode with the error, the trainer masks the trajectory and `failures.jsonl` records it
(kind `engine`). A step keeps going with the rest; the run stops only through the failure-rate
guard (`failures.max_rate`, `failures.max_bad_steps`). An error marked `fatal` (a vLLM server that
no longer holds the trainer's weights) is raised as it is: no retry mends it and no prompt caused it.
Everything else (`sync_weights`, `sleep`,
`generated_tokens`, `model`, ...) passes straight through to the wrapped engine.
"""

from __future__ import annotations

import socket
import time
import urllib.error
from typing import Any, Callable

from actloop.rollout.engine import Completion, SamplingParams

RETRY_STATUS = (408, 425, 429, 500, 502, 503, 504)


def kind_of(exc: BaseException) -> str:
    """`transient` (retry the same request), `oom` (split the batch) or `other` (split: it may be
    one prompt's fault)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return "transient" if status in RETRY_STATUS else "other"
    text = str(exc).lower()
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text:
        return "oom"
    if isinstance(exc, (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout)):
        return "transient"
    if type(exc).__module__.startswith("ray.") and ("Actor" in type(exc).__name__ or "Worker" in type(exc).__name__):
        return "transient"  # RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError
    return "other"


def describe(exc: BaseException) -> str:
    return f"engine: {type(exc).__name__}: {str(exc).strip()[:500]}"


class IsolatedEngine:
    """`engine` with failing requests retried, split and, at last, recorded per prompt."""

    def __init__(self, engine: Any, retries: int = 2, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.__dict__.update(inner=engine, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                             _sleep=sleep, failed_requests=0, retried_requests=0, failed_prompts=0)

    def __getattr__(self, name: str) -> Any:  # everything but generate belongs to the wrapped engine
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.inner, name, value)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        error: BaseException | None = None
        for attempt in range(self.retries + 1):
            try:
                return self.inner.generate(prompts, params)
            except Exception as e:  # noqa: BLE001 - every failure is isolated, none ends the run ...
                if getattr(e, "fatal", False):
                    raise  # ... but one that no retry can mend and no prompt caused (a stale vLLM server)
                error = e
                self.failed_requests += 1
                if kind_of(e) != "transient" or attempt == self.retries:
                    break
                self.retried_requests += 1
                self._sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        if len(prompts) > 1 and kind_of(error) != "transient":  # OOM or one bad prompt: halve the batch
            half = len(prompts) // 2
            return self.generate(prompts[:half], params) + self.generate(prompts[half:], params)
        self.failed_prompts += len(prompts)
        return [Completion((), (), "stop", error=describe(error)) for _ in prompts]

    def submit(self, prompt: list[int], params: SamplingParams) -> Any:
        """One request for the continuous schedule. An engine that answers each with a `generate` of
        its own (`submit_call`: the vLLM server) gets this class's retries and per-prompt failures;
        one with a decode batch of its own (HF, colocated vLLM) takes it as it is."""
        call = getattr(self.inner, "submit_call", None)
        if call is None:
            return self.inner.submit(prompt, params)
        return call(lambda: self.generate([prompt], params)[0])

    def stats(self) -> dict[str, int]:
        return {"failed_requests": self.failed_requests, "retried_requests": self.retried_requests,
                "failed_prompts": self.failed_prompts}
