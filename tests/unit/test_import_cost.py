"""Start-up cost, guarded: the commands that only read a recipe or a run directory start in a
fraction of a second because they import no torch (torch alone is over a second here; the
training stack behind it, several). Each check runs in a fresh interpreter, since this test
process has long imported torch itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir, atomic_write_json

# torch and the libraries that load it at import
TORCH_STACK = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate")

# `rlhf ARGS` through Typer's CliRunner, then every module the process holds
PROBE = """
import json, sys
from typer.testing import CliRunner
from rlhf_cli.cli import app
result = CliRunner().invoke(app, sys.argv[1:]) if len(sys.argv) > 1 else None
print(json.dumps({
    "exit_code": None if result is None else result.exit_code,
    "output": "" if result is None else result.output,
    "modules": sorted(sys.modules),
}))
"""


def fresh_process(cwd: Path, *args: str) -> dict:
    """Import rlhf_cli.cli in a new interpreter (and run `rlhf ARGS` when given)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def assert_no_torch(seen: dict) -> None:
    heavy = [name for name in TORCH_STACK if name in seen["modules"]]
    # the rlhf_cli modules loaded say where to look when one slips in
    ours = [name for name in seen["modules"] if name.startswith("rlhf_cli")]
    assert not heavy, f"imported {heavy}; rlhf_cli modules loaded: {ours}"


def test_importing_the_cli_imports_no_torch(tmp_path):
    assert_no_torch(fresh_process(tmp_path))


@pytest.mark.parametrize("args", [["--help"], ["ppo", "--help"]], ids=" ".join)
def test_help_imports_no_torch(tmp_path, args):
    seen = fresh_process(tmp_path, *args)
    assert seen["exit_code"] == 0, seen["output"]
    assert "Usage" in seen["output"]
    assert_no_torch(seen)


@pytest.mark.parametrize("as_json", [False, True], ids=["yaml", "json"])
def test_validate_without_data_imports_no_torch(make_recipe, tmp_path, as_json):
    args = ["validate", "--recipe", str(make_recipe())] + (["--json"] if as_json else [])
    seen = fresh_process(tmp_path, *args)
    assert seen["exit_code"] == 0, seen["output"]
    assert "ppo" in seen["output"]
    assert_no_torch(seen)


@pytest.fixture
def run_with_stages(make_recipe) -> RunDir:
    """A run whose sft and rm completed (sft with its measured peak) and whose ppo failed: the
    rows `rlhf status` reads, written as manifests alone."""
    recipe = load_recipe(make_recipe())
    run = RunDir.for_recipe(recipe)
    run.prepare(recipe)
    manifests = {
        "sft": {
            "status": "completed",
            "finished_at": "2025-01-01T00:00:00+00:00",
            "outputs": {"adapter": "adapter"},
            "metrics": {
                "eval_loss": 1.5,
                "peak_memory_bytes": 2**28,
                "peak_memory_kind": "rss",
                "planned_peak_bytes": 2**27,
            },
        },
        "rm": {"status": "completed", "outputs": {"model": "model"}, "metrics": {}},
        "ppo": {"status": "failed", "error": "ValueError: boom", "outputs": {}, "metrics": {}},
    }
    for stage, manifest in manifests.items():
        run.stage_dir(stage).mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.manifest_path(stage), {"stage": stage, **manifest})
        for folder in manifest["outputs"].values():
            (run.stage_dir(stage) / folder).mkdir()
    return run


@pytest.mark.parametrize("extra", [[], ["--json"], ["--all"]], ids=["table", "json", "all"])
def test_status_imports_no_torch(run_with_stages, tmp_path, extra):
    runs_dir = str(run_with_stages.path.parent)
    seen = fresh_process(tmp_path, "status", "--runs-dir", runs_dir, *extra)
    assert seen["exit_code"] == 0, seen["output"]
    assert run_with_stages.path.name in seen["output"]
    assert_no_torch(seen)


@pytest.mark.parametrize("stage", ["ppo", "audit", "compare", "merge"])
def test_a_stage_without_a_trainer_imports_no_peft_or_bitsandbytes(tmp_path, stage):
    """transformers' Trainer loads peft, which loads bitsandbytes (and with it torch.compile's
    stack, about 2 s and 200 MB here): only sft and train-rm, which use a Trainer, pay that at
    import; the others load peft when a model needs it."""
    code = f"import sys, rlhf_cli.stages.{stage}; print(sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1].replace("'", '"')))
    assert not {"peft", "bitsandbytes"} & loaded
