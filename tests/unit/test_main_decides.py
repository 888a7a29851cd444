"""`main_decides`: the main process's decision reaches every process, and a decision that fails
on the main process still reaches the broadcast the others wait in, so they fail too instead of
waiting until the backend's timeout. The broadcast is faked as the two ends of one collective."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rlhf_cli.ppo import distributed
from rlhf_cli.ppo.distributed import main_decides


def _process(monkeypatch: pytest.MonkeyPatch, main: bool, sent: list[Any]) -> SimpleNamespace:
    """A process of two; the broadcast records what the main process sends and hands the
    others what it sent."""

    def broadcast(objects: list[Any]) -> list[Any]:
        if main:
            sent.append(list(objects))
            return objects
        return list(sent[-1])

    monkeypatch.setattr(distributed, "broadcast_object_list", broadcast)
    return SimpleNamespace(num_processes=2, is_main_process=main)


def test_the_main_process_decision_reaches_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    assert main_decides(_process(monkeypatch, True, sent), lambda: {"restore": 5}) == {"restore": 5}
    calls: list[str] = []
    other = _process(monkeypatch, False, sent)
    assert main_decides(other, lambda: calls.append("decided") or {"restore": 9}) == {"restore": 5}
    assert calls == []  # the others never decide


def test_a_failed_decision_is_broadcast_before_the_main_process_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[Any] = []

    def decide() -> None:
        raise ValueError("best.json unreadable")

    with pytest.raises(ValueError, match="best.json unreadable"):
        main_decides(_process(monkeypatch, True, sent), decide)
    assert sent == [[None, "ValueError: best.json unreadable"]]
    with pytest.raises(RuntimeError, match="main process failed .*ValueError: best.json"):
        main_decides(_process(monkeypatch, False, sent), decide)
