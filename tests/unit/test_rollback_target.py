"""Which checkpoint a rollback restores (`audit.rollback_to`): the newest written before the
flag, or the best one before it (`checkpoints/best.json`), falling back to the newest when no
best is kept before the flag. The restore itself (exact state, correction) is
tests/stages/test_hacking_rollback.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import rlhf_cli.ppo.run as run_module
from rlhf_cli.ppo.core import AdaptiveKLController
from rlhf_cli.recipe import AuditSection


def _run(tmp_path: Path, rollback_to: str, best: dict[str, Any] | None) -> SimpleNamespace:
    root = tmp_path / "checkpoints"
    for iteration in (5, 10, 15, 20):
        (root / f"iter_{iteration:05d}").mkdir(parents=True)
    recipe = SimpleNamespace(audit=AuditSection(on_hacking="rollback", rollback_to=rollback_to))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    state = SimpleNamespace(
        kl_ctl=AdaptiveKLController(0.1, 6.0, 10000),
        optimizer=optimizer,
        scheduler=SimpleNamespace(base_lrs=[1e-3]),
    )
    return SimpleNamespace(
        recipe=recipe, state=state, stage_dir=tmp_path, best=best, rollbacks=[],
        drafts=SimpleNamespace(drop=lambda: None), logs=SimpleNamespace(warn=lambda _: None),
        models=SimpleNamespace(engine=None, actor=None),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rollback_to", "best", "restored"),
    [
        ("newest", {"iteration": 10, "checkpoint": "iter_00010"}, 20),
        ("best", {"iteration": 10, "checkpoint": "iter_00010"}, 10),
        ("best", None, 20),  # no best kept: the newest
        ("best", {"iteration": 25, "checkpoint": "iter_00025"}, 20),  # best after the flag
    ],
)
def test_the_checkpoint_a_flag_at_25_restores(tmp_path, monkeypatch, rollback_to, best, restored):
    loaded: list[str] = []

    def load(folder: Path, *_: Any) -> dict[str, int]:
        loaded.append(folder.name)
        return {"iteration": int(folder.name.removeprefix("iter_"))}

    monkeypatch.setattr(run_module, "load_checkpoint", load)
    run = _run(tmp_path, rollback_to, best)
    out = run_module.roll_back(run, 25, "overoptimization")
    assert loaded == [f"iter_{restored:05d}"]
    assert out == {"audit/rollback": 1.0, "audit/rolled_back_to": float(restored)}
    assert run.rollbacks[0]["restored"] == restored
