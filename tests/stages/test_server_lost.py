"""PPO against a rollout server that hangs or cuts its answers mid-run (tests/fake_vllm.py): the
run ends within seconds of the failure, with a checkpoint of the last whole iteration and one
line naming the server (exit 2). On f41b8ed a cut answer (`IncompleteRead`) ended the run with
an internal error (exit 70) and no checkpoint, and a hung server kept the run for every queued
row's every try, each `timeout_s` long."""

from __future__ import annotations

import time

import pytest
from fake_vllm import CUT, HANG
from rich.console import Console
from test_server_ppo import _ppo, _served, _with_url

from rlhf_cli.errors import GenerationServerLost
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders
from rlhf_cli.rundir import RunDir

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)


@pytest.mark.parametrize("how", [HANG, CUT], ids=["hangs", "cuts"])
def test_a_server_that_hangs_or_cuts_its_answers_ends_the_run_in_a_checkpoint_and_one_line(
    how, ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    from rlhf_cli.stages.ppo import run_ppo

    # one row in flight at a time: f41b8ed asked the eight rows of a batch one after another,
    # each tried twice for timeout_s; one deadline for the batch ends it at 2 x 1 s + the pause
    monkeypatch.setattr("rlhf_cli.generation.server.MAX_IN_FLIGHT", 1)
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, _ppo(4, "http://127.0.0.1:1"))
    fake = _served(recipe)
    fake.die_after, fake.die_how = 8 * 2 + 1, how  # the probe, two whole rollouts, then this
    server = recipe.ppo.generation.server.model_copy(update={"timeout_s": 1.0})
    recipe = _with_url(recipe, fake.url)
    gen = recipe.ppo.generation.model_copy(
        update={"server": server.model_copy(update={"urls": [fake.url]})}
    )
    recipe = recipe.model_copy(update={"ppo": recipe.ppo.model_copy(update={"generation": gen})})
    try:
        with pytest.raises(GenerationServerLost) as lost:
            run_ppo(recipe, QUIET)
        ended = time.monotonic()
    finally:
        fake.stop()
    message = str(lost.value)
    assert lost.value.exit_code == 2 and "\n" not in message
    assert message.startswith(f"the rollout server at {fake.url} ")
    assert "checkpoint iter_00002 (iteration 2) holds the run" in message
    stage = RunDir.for_recipe(recipe).stage_dir("ppo")
    folders = checkpoint_folders(stage / "checkpoints", PPO_CHECKPOINT)
    assert folders[-1].name == "iter_00002"
    if how == HANG:
        assert ended - fake.hung_at < 8.0  # f41b8ed: 8 rows x (2 x 1 s + 1 s) = 24 s
