"""The run directory contract: manifests, LATEST, `require`, atomic writes, StageRecord status."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from rlhf_cli import rundir
from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.record import StageRecord, require
from rlhf_cli.rundir import RunDir, atomic_write_json, file_sha256

MANIFEST_KEYS = {
    "stage",
    "status",
    "run",
    "started_at",
    "finished_at",
    "recipe_sha256",
    "inputs",
    "outputs",
    "metrics",
    "warnings",
    "versions",
}


@pytest.fixture
def recipe(tmp_path: Path) -> Recipe:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one two three four five six"}\n')
    text = f"""\
run: {{name: demo, output_dir: {tmp_path / "runs"}}}
model: {{name_or_path: builtin:tiny-lm}}
sft: {{enabled: false}}
reward: {{pretrained: builtin:minilm}}
data: {{prompts: {{path: {prompts}}}}}
"""
    return parse_recipe(text, base_dir=tmp_path)


@pytest.fixture
def run(recipe: Recipe) -> RunDir:
    return RunDir.for_recipe(recipe)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_paths_follow_the_layout(run: RunDir, tmp_path: Path) -> None:
    assert run.path == tmp_path / "runs" / "demo"
    assert run.manifest_path("sft") == tmp_path / "runs" / "demo" / "sft" / "manifest.json"
    assert run.recipe_path() == tmp_path / "runs" / "demo" / "recipe.yaml"


def test_prepare_snapshots_recipe_and_points_latest(
    run: RunDir, recipe: Recipe, tmp_path: Path
) -> None:
    assert RunDir.latest(tmp_path / "runs") is None
    run.prepare(recipe)
    assert (tmp_path / "runs" / "LATEST").read_text() == "demo\n"
    snapshot = parse_recipe(run.recipe_path().read_text(), base_dir=tmp_path)
    assert snapshot.sha256() == recipe.sha256()
    latest = RunDir.latest(tmp_path / "runs")
    assert latest is not None and latest.name == "demo" and latest.path == run.path


def test_latest_follows_the_last_prepared_run(recipe: Recipe, tmp_path: Path) -> None:
    RunDir(tmp_path / "runs", "first").prepare(recipe)
    RunDir(tmp_path / "runs", "second").prepare(recipe)
    assert RunDir.latest(tmp_path / "runs").name == "second"


def test_a_damaged_latest_pointer_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "LATEST").write_bytes(b"\x00\xff")
    with pytest.raises(StageError, match=r"LATEST is damaged .*--recipe"):
        RunDir.latest(tmp_path)


@pytest.mark.parametrize(
    ("stage", "hint"),
    [("ppo", "run `rlhf ppo` again"), ("ckpt", "move it aside or write it again")],
)
def test_a_damaged_manifest_says_how_to_recover_for_a_stage_and_for_another_folder(
    tmp_path: Path, stage: str, hint: str
) -> None:
    """A stage's folder names its command; a folder of another name (a checkpoint given to
    `rlhf audit`) has none to name."""
    run = RunDir(tmp_path / "runs", "r")
    run.manifest_path(stage).parent.mkdir(parents=True)
    run.manifest_path(stage).write_text("{garbage")
    with pytest.raises(
        StageError, match=rf"manifest.json is unreadable \(JSONDecodeError\): {hint}$"
    ):
        run.read_manifest(stage)


def test_the_manifest_type_declares_every_key_a_stage_record_writes(
    run: RunDir, recipe: Recipe
) -> None:
    """`Manifest` is what readers are typed against: a key StageRecord writes (on success,
    failure, or a failed re-run's `last_attempt` note) that it does not declare is a drift."""
    from rlhf_cli.rundir import Manifest

    declared = set(Manifest.__annotations__)
    with StageRecord(run, "sft", recipe, inputs={}):
        pass
    with pytest.raises(ValueError), StageRecord(run, "sft", recipe, inputs={}):
        raise ValueError("boom")
    with pytest.raises(ValueError), StageRecord(run, "rm", recipe, inputs={}) as record:
        record.replacing()
        raise ValueError("boom")
    sft, rm = run.read_manifest("sft"), run.read_manifest("rm")
    assert MANIFEST_KEYS <= declared
    assert set(sft) | set(rm) <= declared and {"last_attempt", "error"} <= set(sft) | set(rm)


def test_latest_ignores_a_pointer_to_a_missing_run(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "LATEST").write_text("gone\n")
    assert RunDir.latest(tmp_path / "runs") is None


def test_completed_manifest_has_every_field(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}) as record:
        on_disk = run.read_manifest("sft")
        assert on_disk["status"] == "running" and on_disk["finished_at"] is None
        record.manifest["outputs"] = {"adapter": "adapter"}
        record.manifest["metrics"] = {"eval_loss": 1.5}
        record.warn("w")
        record.warn("w")  # recorded once
    manifest = json.loads(run.manifest_path("sft").read_text())
    assert MANIFEST_KEYS <= set(manifest)
    assert manifest["stage"] == "sft" and manifest["status"] == "completed"
    assert manifest["recipe_sha256"] == recipe.sha256()
    assert manifest["outputs"] == {"adapter": "adapter"}
    memory = {
        "peak_memory_bytes",
        "peak_memory_kind",
        "peak_memory_rss_bytes",
        "planned_peak_bytes",
    }
    assert (
        manifest["metrics"]["eval_loss"] == 1.5
        and set(manifest["metrics"]) == {"eval_loss"} | memory
    )
    assert manifest["warnings"] == ["w"]
    assert {"python", "torch", "transformers", "trl", "peft", "accelerate", "rlhf-cli"} <= set(
        manifest["versions"]
    )
    started = dt.datetime.fromisoformat(manifest["started_at"])
    finished = dt.datetime.fromisoformat(manifest["finished_at"])
    assert started.tzinfo is not None and started <= finished
    assert leftovers(run.stage_dir("sft")) == []


def test_failed_stage_records_the_error(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}):
        pass  # the run has something completed
    with pytest.raises(ValueError), StageRecord(run, "rm", recipe, inputs={}) as record:
        record.replacing()
        raise ValueError("bad thing\nsecond line")
    manifest = run.read_manifest("rm")
    assert manifest["status"] == "failed"
    assert manifest["error"] == "ValueError: bad thing"
    assert manifest["finished_at"] is not None


def test_keyboard_interrupt_marks_interrupted(run: RunDir, recipe: Recipe) -> None:
    with pytest.raises(KeyboardInterrupt), StageRecord(run, "ppo", recipe, inputs={}) as record:
        record.replacing()
        raise KeyboardInterrupt
    manifest = run.read_manifest("ppo")
    assert manifest["status"] == "interrupted"
    assert "error" not in manifest


def test_a_failed_rerun_keeps_the_completed_result_the_snapshot_and_latest(
    run: RunDir, recipe: Recipe, tmp_path: Path
) -> None:
    with StageRecord(run, "sft", recipe, inputs={}) as record:
        record.manifest["outputs"] = {"model": "model"}
    snapshot = run.recipe_path().read_bytes()
    other = RunDir(run.output_dir, "other")
    with StageRecord(other, "sft", recipe, inputs={}):
        pass
    assert (run.output_dir / "LATEST").read_text().strip() == "other"
    changed = recipe.model_copy(update={"sft": recipe.sft.model_copy(update={"epochs": 99})})
    with pytest.raises(ValueError), StageRecord(run, "sft", changed, inputs={}):
        raise ValueError("a bad value found at start-up")
    manifest = run.read_manifest("sft")
    assert manifest["status"] == "completed" and manifest["outputs"] == {"model": "model"}
    assert manifest["last_attempt"]["status"] == "failed"
    assert manifest["last_attempt"]["error"] == "ValueError: a bad value found at start-up"
    assert run.recipe_path().read_bytes() == snapshot  # the next stage reads the good recipe
    assert (run.output_dir / "LATEST").read_text().strip() == "other"
    assert not (run.path / ".lock").exists()


def test_a_failed_first_stage_of_a_new_run_leaves_no_folder_and_latest_alone(
    run: RunDir, recipe: Recipe
) -> None:
    with StageRecord(run, "sft", recipe, inputs={}):
        pass
    fresh = RunDir(run.output_dir, "fresh")
    with pytest.raises(KeyboardInterrupt), StageRecord(fresh, "sft", recipe, inputs={}):
        raise KeyboardInterrupt
    assert not fresh.path.exists()
    assert (run.output_dir / "LATEST").read_text().strip() == run.name
    # once it has replaced something, a failure is the stage's result; LATEST still names a
    # run that completed something
    with pytest.raises(ValueError), StageRecord(fresh, "sft", recipe, inputs={}) as record:
        record.replacing()
        raise ValueError("mid-training")
    assert fresh.read_manifest("sft")["status"] == "failed"
    assert (run.output_dir / "LATEST").read_text().strip() == run.name


def test_write_false_leaves_no_manifest(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}, write=False):
        pass
    assert run.read_manifest("sft") is None


# ── require ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("stage", "command"), [("sft", "rlhf sft"), ("rm", "rlhf train-rm")])
def test_require_missing_stage_names_the_command(run: RunDir, stage: str, command: str) -> None:
    with pytest.raises(StageError) as info:
        require(run, stage, needed_by="rlhf ppo")
    message = str(info.value)
    assert f"run `{command}` first" in message
    assert "missing" in message and "'demo'" in message


@pytest.mark.parametrize("status", ["running", "failed", "interrupted"])
def test_require_not_completed_stage(run: RunDir, recipe: Recipe, status: str) -> None:
    with StageRecord(run, "rm", recipe, inputs={}) as record:
        pass
    record.manifest["status"] = status
    record.save()
    with pytest.raises(StageError) as info:
        require(run, "rm", needed_by="rlhf ppo")
    shown = "stopped (its process is gone)" if status == "running" else f"'{status}'"
    assert f"status is {shown}: run `rlhf train-rm` again first" in str(info.value)


@pytest.mark.parametrize("status", ["running", "interrupted"])
@pytest.mark.parametrize(
    "stage, command", [("sft", "rlhf sft"), ("rm", "rlhf train-rm"), ("ppo", "rlhf ppo")]
)
def test_a_stopped_stage_with_checkpoints_is_resumed_not_rerun(
    run: RunDir, recipe: Recipe, status: str, stage: str, command: str
) -> None:
    """A plain re-run discards the checkpoints: the hint names --resume while there are some."""
    with StageRecord(run, stage, recipe, inputs={}) as record:
        pass
    record.manifest["status"] = status
    record.save()
    with pytest.raises(StageError, match=f"run `{command}` again first"):
        require(run, stage, needed_by="rlhf merge")
    (record.dir / "checkpoints").mkdir()
    (record.dir / "checkpoints" / "README.md").write_text("TRL's model card, no checkpoint")
    (record.dir / "checkpoints" / ".iter_00002.tmp42").mkdir()  # a write cut short
    with pytest.raises(StageError, match=f"run `{command}` again first"):
        require(run, stage, needed_by="rlhf merge")
    (record.dir / "checkpoints" / "checkpoint-2").mkdir()
    with pytest.raises(StageError, match=f"resume it with `{command} --resume`"):
        require(run, stage, needed_by="rlhf merge")


def test_a_stage_still_running_says_so(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "ppo", recipe, inputs={}):  # this process holds the lock
        with pytest.raises(StageError, match=f"still running \\(pid {os.getpid()}"):
            require(run, "ppo", needed_by="rlhf audit")


def test_require_completed_returns_manifest_and_input_record(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}) as record:
        (record.dir / "adapter").mkdir()
        record.manifest["outputs"] = {"adapter": "adapter"}
    manifest = require(run, "sft", needed_by="rlhf ppo")
    assert manifest["status"] == "completed"
    assert run.resolve_output("sft", manifest, "adapter") == run.stage_dir("sft") / "adapter"
    with pytest.raises(StageError, match="lists no output 'model'.*rlhf sft"):
        run.resolve_output("sft", manifest, "model")
    record_in = run.input_record("sft")
    assert record_in["path"] == str(run.stage_dir("sft"))
    assert record_in["manifest_sha256"] == file_sha256(run.manifest_path("sft"))
    assert record_in["finished_at"] == manifest["finished_at"] is not None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("delete", "adapter is missing"),
        ("cut_header", "adapter_model.safetensors is damaged \\(.*header"),
        ("cut_data", "adapter_model.safetensors is damaged \\(.*not fully covered"),
    ],
)
def test_a_missing_or_cut_short_output_names_the_file_and_the_command(
    run: RunDir, recipe: Recipe, damage: str, problem: str
) -> None:
    import torch
    from safetensors.torch import save_file

    with StageRecord(run, "ppo", recipe, inputs={}) as record:
        (record.dir / "adapter").mkdir()
        save_file({"w": torch.ones(64)}, str(record.dir / "adapter" / "adapter_model.safetensors"))
        record.manifest["outputs"] = {"adapter": "adapter"}
    manifest = require(run, "ppo", needed_by="rlhf merge")
    weights = run.stage_dir("ppo") / "adapter" / "adapter_model.safetensors"
    assert run.resolve_output("ppo", manifest, "adapter") == weights.parent
    whole = weights.read_bytes()
    if damage == "delete":
        weights.unlink()
        weights.parent.rmdir()
    else:
        weights.write_bytes(whole[:4] if damage == "cut_header" else whole[:-8])
    with pytest.raises(StageError, match=f"{problem}.*run `rlhf ppo` again"):
        run.resolve_output("ppo", manifest, "adapter")


def test_file_sha256_matches_known_digest(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert file_sha256(path) == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


# ── atomic writes ───────────────────────────────────────────────────────────────────────────


def test_atomic_write_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    atomic_write_json(path, {"v": 1})
    atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert leftovers(tmp_path) == []


def test_failed_rename_keeps_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    atomic_write_json(path, {"v": 1})

    def broken_replace(src: str, dst: str) -> None:
        assert Path(src).exists()  # the new content was written, to a temp file
        raise OSError("disk gone")

    monkeypatch.setattr(rundir.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_json(path, {"v": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_failed_write_midway_keeps_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    atomic_write_json(path, {"v": 1})

    def broken_fsync(fd: int) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(rundir.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        atomic_write_json(path, {"v": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_unserialisable_manifest_keeps_the_old_one(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}) as record:
        record.manifest["metrics"] = {"eval_loss": 1.0}
    before = run.manifest_path("sft").read_bytes()
    record.manifest["metrics"] = {"bad": object()}
    with pytest.raises(TypeError):
        record.save()
    assert run.manifest_path("sft").read_bytes() == before
    assert sorted(os.listdir(run.stage_dir("sft"))) == ["manifest.json"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_run_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    from rlhf_cli.rundir import atomic_write_json

    old = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "m.json", {"a": 1})
        assert os.umask(umask) == umask  # the write left the process umask alone
    finally:
        os.umask(old)
    assert (tmp_path / "m.json").stat().st_mode & 0o777 == mode
    assert os.listdir(tmp_path) == ["m.json"]


def test_a_run_takes_sft_and_rm_from_its_base_only_where_it_has_none(recipe: Recipe) -> None:
    base_run = RunDir(recipe.run.output_dir, "base")
    for stage in ("sft", "rm", "ppo"):
        with StageRecord(base_run, stage, recipe, inputs={}):
            pass
    variant = RunDir(recipe.run.output_dir, "variant", base="base")
    assert variant.owner("sft").name == "base" and variant.owner("rm").name == "base"
    assert variant.owner("ppo") is variant  # only sft and rm are taken
    assert require(variant.owner("sft"), "sft", "rlhf ppo")["status"] == "completed"
    with StageRecord(variant, "sft", recipe, inputs={}):
        pass
    assert variant.owner("sft") is variant  # its own, once it has one
    assert RunDir(recipe.run.output_dir, "plain").owner("sft").name == "plain"


def test_a_missing_sft_names_a_run_to_take_it_from(recipe: Recipe) -> None:
    alone = RunDir(recipe.run.output_dir, "first")
    with pytest.raises(StageError, match=r"run `rlhf sft` first$"):
        require(alone, "sft", "rlhf ppo")
    with StageRecord(alone, "sft", recipe, inputs={}):
        pass
    with pytest.raises(
        StageError,
        match=r"run `rlhf sft` first, or take it from run 'first': --set run.base=first$",
    ):
        require(RunDir(recipe.run.output_dir, "second"), "sft", "rlhf ppo")


def test_a_run_cannot_be_its_own_base() -> None:
    from rlhf_cli.recipe import RunSection

    with pytest.raises(ValueError, match=r"names this run itself \(x\): name another run"):
        RunSection(name="x", base="x")


def test_a_failed_stage_with_checkpoints_is_resumed_or_started_over(
    run: RunDir, recipe: Recipe
) -> None:
    with pytest.raises(RuntimeError), StageRecord(run, "sft", recipe, inputs={}) as record:
        record.replacing()
        (record.dir / "checkpoints" / "checkpoint-8").mkdir(parents=True)
        raise RuntimeError("out of memory")
    with pytest.raises(
        StageError, match=r"resume it with `rlhf sft --resume` \(or start over with `rlhf sft`\)"
    ):
        require(run, "sft", needed_by="rlhf ppo")
    assert (run.output_dir / "LATEST").read_text().strip() == "demo"  # resumable: kept


def test_a_process_that_does_not_write_never_touches_latest(run: RunDir, recipe: Recipe) -> None:
    with StageRecord(run, "sft", recipe, inputs={}):
        pass
    with pytest.raises(RuntimeError), StageRecord(run, "rm", recipe, {}, write=False) as record:
        record.replacing()
        raise RuntimeError("rank 1 failed")
    assert (run.output_dir / "LATEST").read_text().strip() == "demo"


def test_a_stopped_attempt_says_what_became_of_the_manifest(run: RunDir, recipe: Recipe) -> None:
    """The interrupted line's note follows what the exit did: a new run is removed, a stage
    with no earlier result keeps this attempt's, an earlier result stays, a replaced one says
    'interrupted'."""

    def stop(stage: str, replacing: bool = False) -> str:
        with pytest.raises(KeyboardInterrupt) as caught, StageRecord(run, stage, recipe, {}) as r:
            if replacing:
                r.replacing()
            raise KeyboardInterrupt
        return caught.value.manifest_note

    assert stop("sft") == "no run was changed" and not run.path.exists()
    with StageRecord(run, "sft", recipe, inputs={}):
        pass
    assert stop("rm") == "the manifest says 'interrupted'"
    assert run.read_manifest("rm")["status"] == "interrupted"
    assert stop("sft") == "the stage's earlier state is kept"
    assert run.read_manifest("sft")["status"] == "completed"
    assert stop("sft", replacing=True) == "the manifest says 'interrupted'"
