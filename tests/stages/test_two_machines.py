"""PPO on two machines, one process each, both on this host: `accelerate launch --config_file
recipes/accelerate/two_machines_cpu.yaml --machine_rank 0|1` (torchrun's static rendezvous on
127.0.0.1, gloo), the commands docs/pipeline.md ("Several machines") gives.

Machine 1 dies (launcher and worker killed) once the first checkpoint is written: machine 0
stops with one line, its manifest says `failed`, and `--resume` on both machines finishes the run
with the numbers of one process (the tolerance of test_sharded_ppo.py). The first launch gives
each machine its own copy of the SFT/RM inputs at the same relative path (no shared filesystem):
machine 1's copy must come out untouched, so the run directory is written by the global main
process alone (each machine has a local main process). The resume shares machine 0's folder, as
machines on a shared filesystem do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from launching import REPO, SAMPLED, assert_same_numbers, free_port, recipe_in, rows

from rlhf_cli.record import stage_state
from rlhf_cli.rundir import RunDir, file_sha256

pytestmark = pytest.mark.slow

CONFIG = REPO / "recipes" / "accelerate" / "two_machines_cpu.yaml"
TIMEOUT_S = 300


def start_machines(
    recipe: Path, folders: tuple[Path, Path], logs: Path, *extra: str
) -> list[subprocess.Popen]:
    """Machine rank r's launch, working in `folders[r]`, its output in `logs/machine<r>.log`."""
    port = str(free_port())
    procs = []
    for rank, folder in enumerate(folders):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", port,
               "-m", "rlhf_cli.cli", "ppo", "--recipe", str(recipe), "--quiet", *extra]  # fmt: skip
        with open(logs / f"machine{rank}.log", "w") as log:
            # its own session: a hang is killed with every process its launcher started
            procs.append(subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
    return procs


def kill_machine(proc: subprocess.Popen) -> None:
    """SIGKILL a machine's launcher and its workers (torchrun starts each in its own session)."""
    node = psutil.Process(proc.pid)
    for process in [node, *node.children(recursive=True)]:
        process.kill()


def finish(procs: list[subprocess.Popen], logs: Path) -> list[str]:
    """Wait for every machine; their outputs, by rank. A hang is killed and fails the test."""
    deadline = time.monotonic() + TIMEOUT_S
    outputs = [(logs / f"machine{rank}.log") for rank in range(len(procs))]
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
            tails = "\n".join(out.read_text()[-3000:] for out in outputs)
            raise AssertionError(f"hung for {TIMEOUT_S} s:\n{tails}") from None
    return [out.read_text() for out in outputs]


def files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def test_two_machines_match_one_process_and_a_lost_machine_resumes(
    one_process_run, ppo_recipe, pipeline, small_recipe, tmp_path
):
    main, other = tmp_path / "machine0", tmp_path / "machine1"
    recipe = recipe_in(main, ppo_recipe, pipeline, small_recipe, SAMPLED)
    data = yaml.safe_load(recipe.read_text())
    data["run"]["output_dir"] = "runs"  # under each machine's working folder
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    run = RunDir(main / "runs", data["run"]["name"])
    shutil.copytree(main / "runs", other / "runs")  # the same inputs at the same path
    untouched = files(other)

    # 1. Machine 1 dies once the first checkpoint is written.
    procs = start_machines(recipe, (main, other), tmp_path)
    first = run.stage_dir("ppo") / "checkpoints" / "iter_00001"
    deadline = time.monotonic() + TIMEOUT_S
    while not first.is_dir() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.1)
    assert first.is_dir(), finish(procs, tmp_path)[0][-3000:]
    kill_machine(procs[1])
    survivor = finish(procs, tmp_path)[0]
    errors = [line for line in survivor.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "[rank0]: Traceback" not in survivor, survivor[-3000:]
    assert "another process of this 2-process run is gone or unreachable" in errors[0]
    assert "newest checkpoint is iter_00001" in errors[0] and "rlhf ppo --resume" in errors[0]
    manifest = run.read_manifest("ppo")
    assert manifest["status"] == "failed" and manifest["error"].startswith("ProcessLostError")
    assert stage_state(run, "ppo", manifest).next == "rlhf ppo --resume"
    # the main process wrote every file, each process's RNG state too; machine 1 wrote nothing
    assert {p.name for p in first.glob("rng_*.pt")} == {"rng_0.pt", "rng_1.pt"}
    assert files(other) == untouched

    # 2. Both machines back, sharing machine 0's run directory: --resume finishes the run.
    for _attempt in range(2):  # torchrun rarely reports a failure after both ranks finished
        outputs = finish(start_machines(recipe, (main, main), tmp_path, "--resume"), tmp_path)
        if run.read_manifest("ppo")["status"] == "completed":
            break
    assert run.read_manifest("ppo")["status"] == "completed", outputs[0][-3000:]
    state = json.loads((run.stage_dir("ppo") / "checkpoints/iter_00002/state.json").read_text())
    assert (state["engine"], state["processes"]) == ("ddp", 2)
    assert_same_numbers(rows(run), rows(one_process_run)[:2])
