"""Stopping on a signal. Any command: SIGTERM stops it as Ctrl-C does (`sigterm_as_ctrl_c`). A
training loop, cleanly: the first Ctrl-C / SIGTERM asks it to finish its step or iteration and
write a checkpoint (`StopRequest`); a second stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # a stage stops as on Ctrl-C: its manifest, lock and LATEST kept true


def sigterm_as_ctrl_c() -> None:
    """From here SIGTERM raises KeyboardInterrupt, as Ctrl-C does (in the main thread: only it
    can set a handler); `graceful_stop` replaces it while a training loop runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)


REPEAT_S = 2.0  # a second signal sooner than this after the first is the same Ctrl-C


@dataclass
class StopRequest:
    """A Ctrl-C / SIGTERM seen by `graceful_stop`, and the newest checkpoint since."""

    requested: bool = False
    saved: str | None = None  # "checkpoint-4 (step 4)", for the last message
    at: float = 0.0  # time.monotonic() of the signal


@contextlib.contextmanager
def graceful_stop(console: Any, unit: str) -> Iterator[StopRequest]:
    """The first SIGINT / SIGTERM asks the training loop to stop after this `unit` (iteration,
    step) and its checkpoint; a second stops at once. A signal within `REPEAT_S` seconds of the
    first counts as the same one: a launcher (torchrun, `accelerate launch`) forwards the
    terminal's Ctrl-C to workers that got it already. The loop sets `saved` to the newest
    checkpoint it wrote, so the KeyboardInterrupt can say what was saved."""
    flag = StopRequest()

    def handler(signum: int, frame: Any) -> None:
        if flag.requested and time.monotonic() - flag.at < REPEAT_S:
            return
        if flag.requested:
            newest = flag.saved or "none from this session"
            raise KeyboardInterrupt(f"stopped at once; the newest checkpoint is {newest}")
        flag.requested, flag.at = True, time.monotonic()
        console.print(
            f"\n[yellow]stopping[/]: finishing this {unit} and writing a checkpoint "
            "(press Ctrl-C again to stop at once)"
        )

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)
