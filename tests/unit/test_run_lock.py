"""The run lock: a live holder is named and nothing is written; a stale lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())


def _recipe(tmp_path: Path) -> Recipe:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


def test_a_live_lock_holder_is_named(tmp_path):
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run.path.mkdir(parents=True)
        (run.path / ".lock").write_text(f'{{"pid": {holder.pid}, "command": "rlhf ppo"}}')
        with pytest.raises(StageError, match=f"busy: pid {holder.pid} \\(rlhf ppo"):
            with StageRecord(run, "sft", recipe, inputs={}):
                pass
        assert run.read_manifest("sft") is None  # nothing written by the refused command
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_and_released(tmp_path):
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.path.mkdir(parents=True)
    (run.path / ".lock").write_text(f'{{"pid": {dead.pid}, "command": "rlhf sft"}}')
    with StageRecord(run, "sft", recipe, inputs={}):
        assert f'"pid": {os.getpid()}' in (run.path / ".lock").read_text()
    assert not (run.path / ".lock").exists()
    assert run.read_manifest("sft")["status"] == "completed"


def test_a_lock_whose_pid_now_belongs_to_another_program_is_stale(tmp_path):
    """The lock records when its process started: a live process under the same pid that
    started at another time is not the holder (pid reuse), so the run is not busy forever."""
    from rlhf_cli.record import _process_start

    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = _process_start(other.pid)
        if started is None:
            pytest.skip("no /proc here: the pid check is all there is")
        run.path.mkdir(parents=True)
        lock = {"pid": other.pid, "started": str(int(started) - 1), "command": "rlhf ppo"}
        (run.path / ".lock").write_text(json.dumps(lock))
        with StageRecord(run, "sft", recipe, inputs={}):
            pass
        assert run.read_manifest("sft")["status"] == "completed"
        # the same pid with its true start time holds the run
        (run.path / ".lock").write_text(json.dumps({**lock, "started": started}))
        with pytest.raises(StageError, match=f"busy: pid {other.pid}"):
            with StageRecord(run, "sft", recipe, inputs={}):
                pass
    finally:
        other.kill()
        other.wait()


def test_a_lock_taken_on_another_host_holds_the_run(tmp_path):
    """On a shared filesystem the lock's pid means nothing on another machine: the run is
    busy, and the line names the host and what to do if that machine is gone."""
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone here
    run.path.mkdir(parents=True)
    lock = run.path / ".lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": "node-b", "command": "rlhf ppo"}))
    refused = f"pid {dead.pid} on node-b .*\\(if node-b is gone, delete"
    with pytest.raises(StageError, match=refused):
        with StageRecord(run, "sft", recipe, inputs={}):
            pass
    assert run.read_manifest("sft") is None
    lock.unlink()  # what the line says to do
    with StageRecord(run, "sft", recipe, inputs={}):  # a lock taken here records this host
        assert json.loads(lock.read_text())["host"] == socket.gethostname()
