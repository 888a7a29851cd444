"""Launching `rlhf ppo` on two gloo processes as users launch it, and comparing its numbers with
a one-process run: what the sharded-engine tests and the vLLM tests share (see
test_sharded_ppo.py for the tolerance); and `rlhf serve` as users start it (the vLLM server
tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.testing import assert_close

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
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
# three iterations, a checkpoint after each: the third is dropped to resume from the second
SHARDED = {**SAMPLED, "iterations": 3}
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
READY_S = 300  # `rlhf serve`'s longest start (~25 s on 2 cores: imports)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def rlhf_serve(
    recipe_file: Path, port: int, *extra: str, ready: str = "rlhf ppo --set"
) -> Iterator[str]:
    """`rlhf serve` for the recipe (and `extra` options, e.g. `--model JUDGE`), in this
    interpreter's environment; yields its URL once it prints the line that starts with
    `ready`; SIGTERM stops it as Ctrl-C does (SIGINT is ignored in a background job, as this
    suite may be in CI)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rlhf_cli.cli", "serve", "--recipe", str(recipe_file),
         "--port", str(port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_S
        for line in process.stdout:  # type: ignore[union-attr]
            if line.startswith(ready):
                break
            assert time.monotonic() < deadline, "rlhf serve did not answer"
        else:
            raise AssertionError(f"rlhf serve exited: {process.stderr.read()}")  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        assert url in line
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 130  # as Ctrl-C: the server stopped, then the exit code


def launch(engine: str, folder: Path, *extra: str, module: str = "rlhf_cli.cli") -> RunDir:
    """`accelerate launch` of `rlhf ppo` on two CPU processes in `folder`; the run it wrote."""
    run = RunDir.for_recipe(load_recipe(folder / "recipe.yaml"))
    for _attempt in range(2):  # torchrun rarely reports a failure after both ranks finished
        out = launched(engine, folder, *extra, module=module)
        manifest = run.read_manifest("ppo")
        if manifest and manifest["status"] == "completed":
            return run
    raise AssertionError(out.stdout[-3000:] + out.stderr[-3000:])


def launched(
    engine: str, folder: Path, *extra: str, module: str = "rlhf_cli.cli", timeout: float = 300
) -> subprocess.CompletedProcess:
    """One `accelerate launch` of `python -m <module> ppo` (the CLI, or a test's wrapper of it
    in this folder) on two CPU processes in `folder`, however it ends; a hang past `timeout`
    seconds fails the test."""
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "recipes" / "accelerate" / CONFIGS[engine]),
           "--main_process_port", str(free_port()),
           "-m", module, "ppo", "--recipe", str(folder / "recipe.yaml"), "--quiet",
           *extra]  # fmt: skip
    path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]  # for a test's wrapper
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    # its own process group: a hang is killed with every process the launcher started
    proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{engine} hung for {timeout:g} s: {err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
