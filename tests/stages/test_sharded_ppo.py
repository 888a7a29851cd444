"""PPO on two gloo processes under each engine, launched as users launch it (`accelerate launch
--config_file recipes/accelerate/<engine>_cpu_2proc.yaml -m rlhf_cli.cli ppo`): DDP, FSDP2 and
DeepSpeed ZeRO-2 / ZeRO-3 log the numbers of a one-process run of the same global batch and save
the same final adapter; a sharded run resumes to the numbers of an uninterrupted one.

The recipe samples (the tiny recipe's top-p 0.9), updates on two mini-batches per optimizer step
(accumulation) for two epochs. Tolerance: each rollout row samples from its own seed
(`generation.SeededGumbel`), so both layouts generate the same responses; the update splits the
same global mini-batches over the processes (`trainer.minibatch_rows`) and weights each
process's loss by its share of the tokens (`trainer.token_share`), so what remains is float32
summation order (about 1e-7 relative per reduction). rtol 1e-4 / atol 1e-5 is the tolerance the
one-process resume test uses, and far below what a wrong reduction gives (a per-process token
mean moved grad_norm by 4% here).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file
from torch.testing import assert_close

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CONFIGS = {
    "ddp": "ddp_cpu_2proc.yaml",
    "fsdp": "fsdp_cpu_2proc.yaml",
    "zero2": "deepspeed_zero2_cpu_2proc.yaml",
    "zero3": "deepspeed_zero3_cpu_2proc.yaml",
}
ENGINE_NAME = {"ddp": "ddp", "fsdp": "fsdp", "zero2": "deepspeed", "zero3": "deepspeed"}
SAMPLED = {
    "iterations": 2,
    "batch_size": 8,
    "mini_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "ppo_epochs": 2,
    "save_freq": 1,
    "log_every": 1,
    "generation": {"max_new_tokens": 16, "do_sample": True, "top_p": 0.9},
}
COMPARED = [
    "env/reward_mean",
    "env/reward_std",
    "objective/kl",
    "objective/entropy",
    "ppo/loss/policy",
    "ppo/loss/value",
    "ppo/loss/total",
    "ppo/policy/approxkl",
    "grad_norm",
    "ppo/val/explained_variance",
    "ppo/returns/mean",
    "response/length_mean",
    "ppo/optimizer_steps",
]
AUDITED = ["audit/verbosity_score", "audit/repetition_score", "audit/avg_response_len"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(engine: str, folder: Path, *extra: str) -> RunDir:
    """`accelerate launch` of `rlhf ppo` on two CPU processes in `folder`; the run it wrote."""
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "recipes" / "accelerate" / CONFIGS[engine]),
           "--main_process_port", str(_free_port()),
           "-m", "rlhf_cli.cli", "ppo", "--recipe", str(folder / "recipe.yaml"), "--quiet",
           *extra]  # fmt: skip
    run = RunDir.for_recipe(load_recipe(folder / "recipe.yaml"))
    for _attempt in range(2):  # torchrun rarely reports a failure after both ranks finished
        # its own process group: a hang is killed with every process the launcher started
        proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{engine} hung for 300 s: {err[-3000:]}") from None
        manifest = run.read_manifest("ppo")
        if manifest and manifest["status"] == "completed":
            return run
    raise AssertionError(out[-3000:] + err[-3000:])


def rows(run: RunDir) -> list[dict[str, Any]]:
    return read_metrics(run.stage_dir("ppo") / "metrics.jsonl")


def assert_same_numbers(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for mine, theirs in zip(got, want, strict=True):
        keys = COMPARED + (AUDITED if mine["iteration"] % 2 == 0 else [])
        for key in keys:
            assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-5, msg=f"{key} differs")


def recipe_in(folder: Path, ppo_recipe, pipeline, small_recipe, ppo: dict[str, Any]) -> Path:
    """The pipeline's runs copied into `folder` and a recipe with `ppo`, and the in-training
    audit at iteration 2 (it runs on the gathered weights, on the main process)."""
    ppo_recipe(pipeline, folder, small_recipe, ppo)
    data = yaml.safe_load((folder / "recipe.yaml").read_text())
    data["audit"]["every"] = 2
    (folder / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "recipe.yaml"


@pytest.fixture(scope="module")
def one_process(ppo_recipe, pipeline, small_recipe, tmp_path_factory) -> RunDir:
    """The same recipe on one process: the numbers every layout must reproduce."""
    from rlhf_cli.stages.ppo import run_ppo

    path = recipe_in(tmp_path_factory.mktemp("one"), ppo_recipe, pipeline, small_recipe, SAMPLED)
    recipe = load_recipe(path)
    run_ppo(recipe, Console(stderr=True, quiet=True))
    return RunDir.for_recipe(recipe)


@pytest.mark.parametrize("engine", list(CONFIGS))
def test_two_processes_match_one_process(
    engine, one_process, ppo_recipe, pipeline, small_recipe, tmp_path
):
    recipe_in(tmp_path, ppo_recipe, pipeline, small_recipe, SAMPLED)
    run = launch(engine, tmp_path)
    state = json.loads(
        (run.stage_dir("ppo") / "checkpoints" / "iter_00002" / "state.json").read_text()
    )
    assert (state["engine"], state["processes"]) == (ENGINE_NAME[engine], 2)
    assert_same_numbers(rows(run), rows(one_process))
    # the final adapter, saved once from the gathered weights, is the one-process adapter
    mine = load_file(run.stage_dir("ppo") / "adapter" / "adapter_model.safetensors")
    theirs = load_file(one_process.stage_dir("ppo") / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and len(mine) > 0
    for name in mine:
        assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6)
    assert any(t.abs().max() > 1e-4 for t in mine.values())  # trained: the test can tell


@pytest.mark.parametrize("engine", list(CONFIGS))
def test_sharded_resume_reproduces_the_uninterrupted_run(
    engine, ppo_recipe, pipeline, small_recipe, tmp_path
):
    """Each process restores its own RNG state and the engine's sharded optimizer state."""
    ppo = {**SAMPLED, "iterations": 3}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    recipe_in(whole, ppo_recipe, pipeline, small_recipe, ppo)
    uninterrupted = rows(launch(engine, whole))
    assert [r["ppo/optimizer_steps"] for r in uninterrupted] == [2.0, 2.0, 2.0]  # 2 x 8 / (4 x 2)

    shutil.copytree(whole, resumed)
    recipe = (resumed / "recipe.yaml").read_text().replace(str(whole), str(resumed))
    (resumed / "recipe.yaml").write_text(recipe)
    run = RunDir.for_recipe(load_recipe(resumed / "recipe.yaml"))
    shutil.rmtree(run.stage_dir("ppo") / "checkpoints" / "iter_00003")  # stopped after 2
    sharded_state = "optimizer.pt" if engine == "ddp" else "engine"  # DeepSpeed's, or DCP's
    assert (run.stage_dir("ppo") / "checkpoints" / "iter_00002" / sharded_state).exists()
    launch(engine, resumed, "--resume")
    assert_same_numbers(rows(run), uninterrupted)
    assert torch.isfinite(torch.tensor(rows(run)[-1]["env/reward_mean"]))
