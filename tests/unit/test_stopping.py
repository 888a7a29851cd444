"""The Ctrl-C / SIGTERM stop (`stopping.py`): one signal asks the loop to finish and
checkpoint; a second stops at once."""

from __future__ import annotations

import pytest


def test_a_repeat_signal_from_a_launcher_is_the_same_ctrl_c(monkeypatch) -> None:
    """torchrun forwards the terminal's Ctrl-C to workers that got it already: a second
    signal within REPEAT_S is the same one; a later one stops at once, saying what was saved."""
    import os
    import signal

    from rich.console import Console

    from rlhf_cli import stopping

    # Python's own handler before the stage, whatever an earlier test left installed
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        clock = [100.0]
        monkeypatch.setattr(stopping.time, "monotonic", lambda: clock[0])
        with stopping.graceful_stop(Console(quiet=True), "step") as flag:
            os.kill(os.getpid(), signal.SIGINT)
            assert flag.requested
            clock[0] += stopping.REPEAT_S / 2
            os.kill(os.getpid(), signal.SIGTERM)  # forwarded: ignored
            flag.saved = "checkpoint-4 (step 4)"
            clock[0] += stopping.REPEAT_S
            with pytest.raises(
                KeyboardInterrupt, match=r"newest checkpoint is checkpoint-4 \(step 4\)"
            ):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, outer)
