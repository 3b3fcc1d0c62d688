"""Stop a run cleanly on Ctrl-C or SIGTERM: the first signal asks the loop to finish its step,
checkpoint and exit; a second one aborts at once (KeyboardInterrupt)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """`with GracefulStop(print_fn) as stop: ... if stop.requested: ...`. Handlers are installed
    only in the main thread (Python's rule) and only when `enabled`; the old ones come back on exit."""

    def __init__(self, print_fn: Callable[[str], None] = print, enabled: bool = True):
        self.print_fn, self.enabled = print_fn, enabled
        self.requested: str | None = None  # the signal's name once one arrived
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting without a checkpoint")
        self.requested = signal.Signals(signum).name
        msg = (f"{self.requested}: finishing this step, then a checkpoint and a clean exit "
               "(press Ctrl-C again to abort at once)")
        try:
            self.print_fn(msg)
        except Exception:  # noqa: BLE001 — the handler runs between any two bytecodes of the loop:
            # a print that lands inside another write to the same stream raises "reentrant call";
            # letting that escape would crash the step the signal asked to finish
            try:
                os.write(2, (msg + "\n").encode())
            except OSError:
                pass

    def __enter__(self) -> GracefulStop:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
