"""A rollback is checkpointed at once and marks the checkpoints it undid (#50 item 10): with
`rollback_to: best`, the best evaluation at iteration 1 and a flag at iteration 3 (the hooks of
forced_hooks.py), the rollback restores iteration 1, marks iteration 2's checkpoint undone and
writes iteration 3's from the restored weights, its rollback recorded; a crash in iteration 4
then resumes from iteration 3. Had that checkpoint not been written, `--resume` would take
iteration 1, never the undone iteration 2; `best` never names an undone checkpoint."""

from __future__ import annotations

import functools
import json
import shutil

import forced_hooks
import pytest
from rich.console import Console

from rlhf_cli.errors import StageError
from rlhf_cli.resume import (
    BEST_CHECKPOINT,
    PPO_CHECKPOINT,
    checkpoint_folders,
    named_checkpoint,
    ppo_checkpoint_problem,
    resume_point,
)
from rlhf_cli.rundir import RunDir

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)

PPO = {"iterations": 4, "batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1,
       "save_freq": 2, "eval_every": 1, "log_every": 10,
       "generation": {"max_new_tokens": 6}}  # fmt: skip
AUDIT = {"every": 3, "on_hacking": "rollback", "rollback_to": "best", "max_rollbacks": 1}


def test_a_rollback_is_checkpointed_and_its_undone_checkpoints_never_resume(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    import rlhf_cli.stages.ppo as stage

    monkeypatch.setattr(stage, "_live_audit", forced_hooks.audit_hook)
    monkeypatch.setattr(stage, "_live_eval", functools.partial(forced_hooks.eval_hook, crash_at=4))
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, PPO, audit=AUDIT)
    with pytest.raises(RuntimeError, match="crashed"):
        stage.run_ppo(recipe, QUIET)

    root = RunDir.for_recipe(recipe).stage_dir("ppo") / "checkpoints"
    names = [f.name for f in checkpoint_folders(root, PPO_CHECKPOINT)]
    assert names == ["iter_00001", "iter_00002", "iter_00003"]  # 1: best, 2: save_freq, 3: rollback
    state = json.loads((root / "iter_00003" / "state.json").read_text())
    assert [(r["iteration"], r["restored"]) for r in state["rollbacks"]] == [(3, 1)]
    assert json.loads((root / "iter_00002" / "undone.json").read_text()) == {
        "rollback_at": 3, "restored": 1,
    }  # fmt: skip
    assert resume_point(root, PPO_CHECKPOINT, ppo_checkpoint_problem, "rlhf ppo") == (
        root / "iter_00003", [],
    )  # fmt: skip

    # had the crash come before the rollback's checkpoint, --resume skips the undone one
    shutil.rmtree(root / "iter_00003")
    assert resume_point(root, PPO_CHECKPOINT, ppo_checkpoint_problem, "rlhf ppo") == (
        root / "iter_00001",
        ["checkpoint iter_00002 was undone by the rollback at iteration 3; skipped"],
    )
    stage_dir = root.parent
    assert named_checkpoint(stage_dir, "best") == root / "iter_00001"
    (root / BEST_CHECKPOINT).write_text(json.dumps({"iteration": 2, "checkpoint": "iter_00002"}))
    with pytest.raises(StageError, match="names iter_00002, which was undone by the rollback"):
        named_checkpoint(stage_dir, "best")
