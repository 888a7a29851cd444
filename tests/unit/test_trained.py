"""stages/trained.py: where a run's reward model comes from, for audit and compare."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages.trained import load_scorer


def test_no_reward_stage_means_no_scores_but_a_damaged_one_is_an_error(make_recipe):
    recipe = load_recipe(make_recipe())
    run = RunDir.for_recipe(recipe)
    assert load_scorer(recipe, run, torch.device("cpu")) is None  # nothing to score with
    run.stage_dir("rm").mkdir(parents=True)
    run.manifest_path("rm").write_text('{"stage": "rm", "status": "compl')  # cut short
    with pytest.raises(StageError, match=r"rm/manifest.json is unreadable.*rlhf train-rm"):
        load_scorer(recipe, run, torch.device("cpu"))
    run.manifest_path("rm").write_text('{"stage": "rm", "status": "failed", "outputs": {}}')
    with pytest.raises(StageError, match="status is 'failed'"):
        load_scorer(recipe, run, torch.device("cpu"))
