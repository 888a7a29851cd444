"""PPO on two gloo processes under each engine, launched as users launch it (`accelerate launch
--config_file recipes/accelerate/<engine>_cpu_2proc.yaml -m rlhf_cli.cli ppo`): DDP, FSDP2 and
DeepSpeed ZeRO-2 / ZeRO-3 log the numbers of a one-process run of the same global batch and save
the same final adapter; a sharded run resumes to the numbers of an uninterrupted one.

The recipe samples (the tiny recipe's top-p 0.9), updates on two mini-batches per optimizer step
(accumulation) for two epochs. Tolerance: each rollout row samples from its own seed
(`generation.SeededGumbel`), so both layouts generate the same responses; the update splits the
same global mini-batches over the processes (`distributed.minibatch_rows`) and weights each
process's loss by its share of the tokens (`distributed.minibatch_shares`), so what remains is
float32 summation order (about 1e-7 relative per reduction). rtol 1e-4 / atol 1e-5 is the
tolerance the one-process resume test uses, and far below what a wrong reduction gives (a
per-process token mean moved grad_norm by 4% here).
"""

from __future__ import annotations

import json
import shutil

import pytest
from launching import (
    CONFIGS,
    ENGINE_NAME,
    SHARDED,
    assert_same_numbers,
    launch,
    recipe_in,
    rows,
)
from safetensors.torch import load_file
from torch.testing import assert_close

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", list(CONFIGS))
def test_two_processes_match_one_process_and_resume_to_it(
    engine, one_process_run, ppo_recipe, pipeline, small_recipe, tmp_path
):
    """The run matches one process (numbers and final adapter); then, stopped after its second
    iteration, it resumes to the same numbers: each process restores its own RNG state and the
    engine's sharded optimizer state."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    recipe_in(whole, ppo_recipe, pipeline, small_recipe, SHARDED)
    run = launch(engine, whole)
    checkpoints = run.stage_dir("ppo") / "checkpoints"
    state = json.loads((checkpoints / "iter_00002" / "state.json").read_text())
    assert (state["engine"], state["processes"]) == (ENGINE_NAME[engine], 2)
    uninterrupted = rows(run)  # one row per iteration, from the main process alone
    assert [r["iteration"] for r in uninterrupted] == [1, 2, 3]
    assert run.read_manifest("ppo")["metrics"]["iterations"] == 3
    assert [r["ppo/optimizer_steps"] for r in uninterrupted] == [2.0, 2.0, 2.0]  # 2 x 8 / (4 x 2)
    assert_same_numbers(uninterrupted, rows(one_process_run))
    # the final adapter, saved once from the gathered weights, is the one-process adapter
    mine = load_file(run.stage_dir("ppo") / "adapter" / "adapter_model.safetensors")
    theirs = load_file(one_process_run.stage_dir("ppo") / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and len(mine) > 0
    for name in mine:
        assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6)
    assert any(t.abs().max() > 1e-4 for t in mine.values())  # trained: the test can tell

    shutil.copytree(whole, resumed)
    recipe = (resumed / "recipe.yaml").read_text().replace(str(whole), str(resumed))
    (resumed / "recipe.yaml").write_text(recipe)
    again = RunDir.for_recipe(load_recipe(resumed / "recipe.yaml"))
    shutil.rmtree(again.stage_dir("ppo") / "checkpoints" / "iter_00003")  # stopped after 2
    sharded_state = "optimizer.pt" if engine == "ddp" else "engine"  # DeepSpeed's, or DCP's
    assert (again.stage_dir("ppo") / "checkpoints" / "iter_00002" / sharded_state).exists()
    launch(engine, resumed, "--resume")
    assert_same_numbers(rows(again), uninterrupted)
