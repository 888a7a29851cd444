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
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True),
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


def test_repeated_rollbacks_to_one_checkpoint_compound_the_correction(tmp_path, monkeypatch):
    """The checkpoint restores its own β and learning rate (as `load_checkpoint` does); each
    rollback's correction multiplies the values in force at its flag, so the second rollback to
    the same checkpoint trains with β × 4 and the learning rate × 0.25, not × 2 and × 0.5
    again."""
    run = _run(tmp_path, "best", {"iteration": 10, "checkpoint": "iter_00010"})

    def load(folder: Path, _engine: Any, _actor: Any, state: Any) -> dict[str, int]:
        state.kl_ctl.set_to(0.1)  # the checkpoint's state, as written at iteration 10
        state.scheduler.base_lrs = [1e-3]
        state.optimizer.param_groups[0]["lr"] = 8e-4  # its step of a decaying schedule
        return {"iteration": 10}

    monkeypatch.setattr(run_module, "load_checkpoint", load)
    run_module.roll_back(run, 15, "overoptimization")
    assert run.state.kl_ctl.value == pytest.approx(0.2)
    assert run.state.scheduler.base_lrs == [pytest.approx(5e-4)]
    assert run.state.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4)
    run_module.roll_back(run, 30, "overoptimization")
    assert run.state.kl_ctl.value == pytest.approx(0.4)
    assert run.state.scheduler.base_lrs == [pytest.approx(2.5e-4)]
    assert run.state.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert [r["kl_coef"] for r in run.rollbacks] == [pytest.approx(0.2), pytest.approx(0.4)]
