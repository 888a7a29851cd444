"""Fixtures of the PPO stage tests: one SFT + reward-model run for the session, and recipes
that run PPO on a copy of it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from launching import SHARDED, recipe_in
from rich.console import Console
from tracker_stores import TRACKER_PROJECT

from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir


@pytest.fixture(scope="session")
def sft_folder(
    small_recipe: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, dict[str, Any]], Path]:
    """`sft_folder(name, updates)`: a tiny SFT run with the recipe `updates` in a new folder,
    what a module's fixture trains once and each of its tests copies."""
    from rlhf_cli.stages.sft import run_sft

    def train(name: str, updates: dict[str, Any]) -> Path:
        folder = tmp_path_factory.mktemp(name)
        run_sft(load_recipe(small_recipe(folder, updates)), Console(stderr=True, quiet=True))
        return folder

    return train


@pytest.fixture(scope="session")
def pipeline(small_recipe: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sft + train-rm once for the session, reporting to TensorBoard and trackio (checked in
    test_trackers); tests copy the folder and run PPO on their copy."""
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    folder = tmp_path_factory.mktemp("ppo_pipeline")
    trackers = {"trackers": ["tensorboard", "trackio"], "project": TRACKER_PROJECT}
    recipe = load_recipe(small_recipe(folder, {"sft": {"epochs": 6}, "run": trackers}))
    quiet = Console(stderr=True, quiet=True)
    run_sft(recipe, quiet)
    run_train_rm(recipe, quiet)
    return folder


def _ppo_recipe(
    pipeline: Path,
    tmp_path: Path,
    small_recipe: Callable[..., Path],
    ppo: dict[str, Any],
    **sections: dict[str, Any],
) -> Recipe:
    shutil.copytree(pipeline / "runs", tmp_path / "runs")
    return load_recipe(small_recipe(tmp_path, {"sft": {"epochs": 6}, "ppo": ppo, **sections}))


@pytest.fixture(scope="session")
def ppo_recipe() -> Callable[..., Recipe]:
    """`ppo_recipe(pipeline, folder, small_recipe, {ppo section}, **other sections)`: the
    pipeline's runs copied into `folder` and a recipe whose sections are updated."""
    return _ppo_recipe


@pytest.fixture(scope="session")
def one_process_run(
    ppo_recipe: Callable[..., Recipe],
    pipeline: Path,
    small_recipe: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> RunDir:
    """`launching.SHARDED` on one process: the numbers every multi-process layout (several
    processes, several machines) must reproduce."""
    from rlhf_cli.stages.ppo import run_ppo

    path = recipe_in(tmp_path_factory.mktemp("one"), ppo_recipe, pipeline, small_recipe, SHARDED)
    recipe = load_recipe(path)
    run_ppo(recipe, Console(stderr=True, quiet=True))
    return RunDir.for_recipe(recipe)
