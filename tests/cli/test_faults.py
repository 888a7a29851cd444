"""Fault injection through the command line: results another command would overwrite, stages
that fail on a re-run, files the tool wrote itself found damaged, unreadable or non-UTF-8 inputs,
rows that cannot teach, and signals. Each case asserts the exit code, a one-line message that
names what is wrong, and that earlier results are intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_audit_push import assert_one_line_error as one_line_error
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.rundir import RunDir


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def completed(run: RunDir, stage: str, recipe, outputs: dict[str, str]) -> dict:
    """A completed stage as the run directory records it (its outputs empty folders)."""
    with StageRecord(run, stage, recipe, inputs={}) as record:
        declare(record, outputs)
    return run.read_manifest(stage)


def declare(record: StageRecord, outputs: dict[str, str]) -> None:
    """`outputs` in the stage's manifest, each folder (a name without a suffix) made empty."""
    for name in outputs.values():
        if not Path(name).suffix:
            (record.dir / name).mkdir(exist_ok=True)
    record.manifest["outputs"] = outputs


# ── results lost ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("stem", ["ppo", "manifest"])
def test_audit_of_a_file_never_replaces_a_policy_audit_or_the_manifest(
    make_recipe, chdir_tmp, stem
):
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    policy_audit = {"n_responses": 5, "hacking_detected": False}
    with StageRecord(run, "audit", recipe, inputs={}) as record:
        (record.dir / "ppo.json").write_text(json.dumps(policy_audit))
        record.manifest["outputs"] = {"ppo": "ppo.json"}
        record.manifest["reports"] = {"ppo": {"n_responses": 5}}
    rows = [{"prompt": "How are you?", "response": "Fine, thanks for asking."}]
    responses = chdir_tmp / f"{stem}.jsonl"
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = invoke("audit", "--responses", str(responses), "--recipe", str(path), "--json")
    assert result.exit_code == 0, result.output
    folder = run.stage_dir("audit")
    assert json.loads((folder / "ppo.json").read_text()) == policy_audit
    manifest = run.read_manifest("audit")
    assert manifest["stage"] == "audit" and manifest["status"] == "completed"
    assert manifest["outputs"] == {"ppo": "ppo.json", f"responses-{stem}": f"responses-{stem}.json"}
    assert manifest["reports"]["ppo"] == {"n_responses": 5}  # what push puts in the card


def test_a_failed_rerun_keeps_the_completed_stage_and_latest(make_recipe, chdir_tmp):
    good = load_recipe(make_recipe())
    run = RunDir.for_recipe(good)
    before = completed(run, "sft", good, {"model": "model"})
    other = load_recipe(make_recipe({"run": {"name": "other"}}, name="other.yaml"))
    completed(RunDir.for_recipe(other), "sft", other, {"model": "model"})
    bad_data = chdir_tmp / "bad.jsonl"
    bad_data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    bad = make_recipe({"data": {"sft": {"path": str(bad_data)}}}, name="bad.yaml")
    one_line_error(invoke("sft", "--recipe", str(bad)), "bad.jsonl:2: not valid JSON")
    manifest = run.read_manifest("sft")
    assert manifest["status"] == "completed" and manifest["outputs"] == before["outputs"]
    assert manifest["last_attempt"]["status"] == "failed"
    assert "bad.jsonl" not in run.recipe_path().read_text()  # the snapshot is the good recipe
    assert (run.output_dir / "LATEST").read_text().strip() == "other"


def test_a_failed_first_stage_of_a_new_run_leaves_nothing_behind(make_recipe, chdir_tmp):
    bad_data = chdir_tmp / "bad.jsonl"
    bad_data.write_bytes(b'{"prompt": "a", "response": "b"}\n\xff\xfe\n')
    bad = make_recipe({"data": {"sft": {"path": str(bad_data)}}})
    one_line_error(invoke("sft", "--recipe", str(bad)), "bad.jsonl:2: not UTF-8 text")
    run = RunDir.for_recipe(load_recipe(bad))
    assert not run.path.exists() and not (run.output_dir / "LATEST").exists()


@pytest.mark.parametrize(
    "stage, before, consumers",
    [("sft", [], ["ppo"]), ("rm", ["sft"], ["ppo"]), ("ppo", ["sft"], ["merge", "audit"])],
)
def test_hints_after_an_interrupted_stage_name_resume(
    make_recipe, chdir_tmp, stage, before, consumers
):
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    for done in before:
        completed(run, done, recipe, {"model": "model", "tokenizer": "tokenizer"})
    with pytest.raises(KeyboardInterrupt), StageRecord(run, stage, recipe, {}) as record:
        record.replacing()
        (record.dir / "checkpoints" / "checkpoint-1").mkdir(parents=True)  # a stop's checkpoint
        raise KeyboardInterrupt
    assert (run.output_dir / "LATEST").read_text().strip() == "tiny"  # resumable: kept
    command = {"sft": "rlhf sft", "rm": "rlhf train-rm", "ppo": "rlhf ppo"}[stage]
    for consumer in consumers:
        one_line_error(invoke(consumer, "--recipe", str(path)), f"`{command} --resume`")
    assert json.loads(invoke("status", "--json").stdout)["next"] == f"{command} --resume"


def _checkpoint_of(run: RunDir, inputs: dict) -> Path:
    """A whole (checksummed) PPO checkpoint whose state records `inputs`."""
    from rlhf_cli.rundir import atomic_write_json, file_sha256

    folder = run.stage_dir("ppo") / "checkpoints" / "iter_00001"
    atomic_write_json(folder / "state.json", {"iteration": 1, "inputs": inputs})
    digest = {"state.json": file_sha256(folder / "state.json")}
    atomic_write_json(folder / "checkpoint.json", {"iteration": 1, "sha256": digest})
    return folder


def test_a_policy_trained_on_a_replaced_sft_is_refused(make_recipe, chdir_tmp, monkeypatch):
    """A PPO adapter only fits the SFT model it was trained on: once `rlhf sft` has completed
    again, merge and audit refuse the final adapter and a checkpoint, audit refuses a merged
    model made from the old SFT (its KL reference), and `ppo --resume` refuses to continue on
    the new SFT. A failed re-run of sft keeps the old result (and its
    finish time): nothing is refused."""
    clock = iter(f"2026-12-03T10:{minute:02d}:00+00:00" for minute in range(60))
    monkeypatch.setattr("rlhf_cli.record.now_iso", lambda: next(clock))
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    outputs = {"adapter": "adapter", "tokenizer": "tokenizer"}
    completed(run, "sft", recipe, outputs)
    completed(run, "rm", recipe, {"model": "model", "tokenizer": "model"})
    inputs = {"sft": run.input_record("sft"), "rm": run.input_record("rm")}
    with StageRecord(run, "ppo", recipe, inputs=inputs) as record:
        declare(record, outputs)
    checkpoint = _checkpoint_of(run, inputs)
    merged = {"sft": inputs["sft"], "ppo": run.input_record("ppo")}
    with StageRecord(run, "merged", recipe, inputs=merged) as record:  # made before the re-run
        declare(record, {"model": "model", "tokenizer": "model"})
    with pytest.raises(ValueError), StageRecord(run, "sft", recipe, {}):
        raise ValueError("a bad value")  # fails before replacing anything
    assert "last_attempt" in run.read_manifest("sft")
    refused = "the adapter only fits the SFT model it was trained on; run `rlhf ppo` on this one"
    # the same SFT: the models load (and are missing here), no word of the SFT
    assert refused not in invoke("merge", "--recipe", str(path)).output

    merged_before = run.manifest_path("merged").read_bytes()  # the failure is a last_attempt
    trained_on = inputs["sft"]["finished_at"]
    new = completed(run, "sft", recipe, outputs)["finished_at"]  # `rlhf sft` again
    changed = (
        f"was made from the sft stage that finished at {trained_on} ",
        f"the one here now finished at {new} ({run.stage_dir('sft')})",
    )
    for args in (["merge"], ["audit"], ["audit", str(checkpoint)]):
        one_line_error(invoke(*args, "--recipe", str(path)), *changed, refused)
    one_line_error(  # whole weights: KL against another SFT would mean nothing
        invoke("audit", str(run.stage_dir("merged")), "--recipe", str(path)),
        "the merged model of run 'tiny' was made from the sft stage",
        *changed,
        "its KL would be measured against another reference; make one from this SFT",
    )
    one_line_error(
        invoke("push", "--dry-run", "--recipe", str(path)),
        "the merged model of run 'tiny' was made from the sft stage",
        *changed,
        "the model card would describe another SFT; run `rlhf ppo` on this one and `rlhf merge`",
    )
    one_line_error(
        invoke("ppo", "--resume", "--recipe", str(path)),
        "the checkpoint iter_00001 was made from the sft stage",
        *changed,
        "`rlhf ppo` without --resume starts over on this one",
    )
    assert run.manifest_path("merged").read_bytes() == merged_before  # refused before starting
    assert run.read_manifest("ppo")["outputs"] == outputs  # the last result is kept


# ── files the tool wrote, damaged ────────────────────────────────────────────────────────────


@pytest.mark.parametrize("command", ["merge", "audit", "report"])
def test_a_truncated_ppo_manifest_is_one_line(make_recipe, chdir_tmp, command):
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    completed(run, "sft", recipe, {"model": "model"})
    text = json.dumps(completed(run, "ppo", recipe, {"adapter": "adapter"}))
    run.manifest_path("ppo").write_text(text[: len(text) // 2])
    (run.stage_dir("ppo") / "metrics.jsonl").write_text('{"iteration": 1}\n')
    args = [command] if command == "report" else [command, "--recipe", str(path)]
    one_line_error(invoke(*args), "ppo/manifest.json is unreadable")


def test_a_damaged_metrics_line_in_the_middle_is_one_line(make_recipe, chdir_tmp):
    recipe = load_recipe(make_recipe())
    run = RunDir.for_recipe(recipe)
    completed(run, "ppo", recipe, {"adapter": "adapter"})
    (run.stage_dir("ppo") / "metrics.jsonl").write_text(
        '{"iteration": 1, "env/reward_mean": 0.1}\n{"itera\n{"iteration": 3}\n'
    )
    one_line_error(invoke("report"), "metrics.jsonl:2: not a JSON object")


def test_an_unreadable_latest_is_one_line(make_recipe, chdir_tmp):
    recipe = load_recipe(make_recipe())
    completed(RunDir.for_recipe(recipe), "sft", recipe, {"model": "model"})
    (Path(recipe.run.output_dir) / "LATEST").write_bytes(b"\xff\xfe\x00garbage\n")
    result = invoke("merge")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


# ── inputs the machine or the user got wrong ─────────────────────────────────────────────────


def test_an_output_dir_that_is_a_file_is_refused_by_validate(make_recipe, chdir_tmp):
    (chdir_tmp / "taken").write_text("a file")
    path = make_recipe({"run": {"output_dir": str(chdir_tmp / "taken")}})
    result = invoke("validate", "--recipe", str(path))
    assert result.exit_code == 2 and "is a file, not a folder" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["sft", "train-rm", "ppo", "audit", "report"])
def test_a_run_folder_that_refuses_writes_is_one_line(make_recipe, chdir_tmp, monkeypatch, command):
    """A read-only run folder, as the operating system answers it (root ignores chmod, so
    every file opened for writing under the run is refused the way a read-only one is). The
    audit scores a responses file with a rule-based reward, so it reaches its write."""
    import builtins
    import errno

    politeness = f"{Path(__file__).parents[2] / 'examples' / 'rewards.py'}:politeness"
    path = make_recipe({"reward": {"functions": [{"function": politeness}]}})
    answers = chdir_tmp / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "Hi?", "response": "Hello, thanks!"}) + "\n")
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    for stage in ("sft", "rm", "ppo"):
        completed(run, stage, recipe, {"model": "model", "tokenizer": "tokenizer"})
    (run.stage_dir("ppo") / "metrics.jsonl").write_text('{"iteration": 1, "step": 1}\n')
    inside = str(run.path.resolve())

    def refused(file: object) -> bool:
        return str(Path(os.fsdecode(file)).resolve()).startswith(inside)

    real_os_open, real_open = os.open, builtins.open

    def os_open(file, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and refused(file):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(file))
        return real_os_open(file, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and refused(file):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    args = {"report": ["report"], "audit": ["audit", "--responses", str(answers)]}.get(
        command, [command]
    )
    result = invoke(*args, "--recipe", str(path)) if command != "report" else invoke(*args)
    monkeypatch.undo()
    one_line_error(result, f"{run.path.name}/", "Permission denied")
    assert run.read_manifest("sft")["status"] == "completed"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_run_folder_is_one_line(make_recipe, chdir_tmp):
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    completed(run, "sft", recipe, {"model": "model"})
    os.chmod(run.path, 0o555)
    try:
        one_line_error(invoke("train-rm", "--recipe", str(path)), str(run.path))
    finally:
        os.chmod(run.path, 0o755)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Is this fine?", "chosen": "Yes, it is.", "rejected": None}, "`rejected`"),
        ({"prompt": "Is this fine?", "chosen": "Yes, it is."}, "`rejected` holds nothing"),
    ],
)
def test_preference_rows_without_an_answer_are_refused(make_recipe, chdir_tmp, row, message):
    data = chdir_tmp / "prefs.jsonl"
    good = {"prompt": "Hello?", "chosen": "Hi, how can I help?", "rejected": "What."}
    data.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    path = make_recipe({"data": {"preferences": {"path": str(data)}}})
    one_line_error(invoke("train-rm", "--recipe", str(path)), "prefs.jsonl:2: column", message)


@pytest.mark.parametrize("response", [None, 3, ["a list"]])
def test_audit_rows_that_are_not_text_are_refused(make_recipe, chdir_tmp, response):
    data = chdir_tmp / "answers.jsonl"
    data.write_text(json.dumps({"prompt": "Hi?", "response": response}) + "\n")
    result = invoke("audit", "--responses", str(data), "--recipe", str(make_recipe()))
    one_line_error(result, "answers.jsonl:1: a row needs `prompt` and `response` as text")


# ── signals ──────────────────────────────────────────────────────────────────────────────────


@pytest.mark.slow
@pytest.mark.parametrize("command, stage", [("sft", "sft"), ("train-rm", "rm")])
def test_sigterm_during_training_checkpoints_and_says_so(make_recipe, chdir_tmp, command, stage):
    path = make_recipe({"sft": {"epochs": 200}, "reward": {"epochs": 200}})
    run = RunDir.for_recipe(load_recipe(path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_cli.cli", command, "--recipe", str(path), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=chdir_tmp,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (run.stage_dir(stage) / "metrics.jsonl").exists():  # training has begun
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert f"saved; `rlhf {command} --resume` continues; the manifest says 'interrupted'" in err
    assert run.read_manifest(stage)["status"] == "interrupted"
    assert list((run.stage_dir(stage) / "checkpoints").glob("checkpoint-*/trainer_state.json"))
    assert not (run.path / ".lock").exists()


def test_sigterm_during_an_audit_keeps_the_earlier_report(make_recipe, chdir_tmp, monkeypatch):
    """SIGTERM while the audit measures (here: a responses file) stops it with 130 and one
    line; the earlier audit of the same file and the audit manifest stay as they were."""
    from rlhf_cli.stages import audit

    measure = audit.audit_responses

    def measure_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's stop arrives mid-way
        return measure(*args, **kwargs)

    monkeypatch.setattr(audit, "audit_responses", measure_then_sigterm)
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    before = completed(run, "audit", recipe, {"responses-answers": "responses-answers.json"})
    report = run.stage_dir("audit") / "responses-answers.json"
    report.write_text('{"earlier": true}')
    answers = chdir_tmp / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "Hi?", "response": "Hello, thanks!"}) + "\n")
    result = invoke("audit", "--responses", str(answers), "--recipe", str(path))
    assert result.exit_code == 130, result.output
    assert result.output == "interrupted: nothing was saved; no run was changed\n"
    assert report.read_text() == '{"earlier": true}'
    assert run.read_manifest("audit") == before


def test_auditing_a_file_says_it_is_a_file(make_recipe, chdir_tmp):
    readme = chdir_tmp / "README.md"
    readme.write_text("# not a model\n")
    result = invoke("audit", str(readme), "--recipe", str(make_recipe()))
    one_line_error(result, "README.md is a file, not a PPO run, checkpoint, adapter or model")


def test_without_latest_no_run_is_guessed(make_recipe, chdir_tmp):
    recipe = load_recipe(make_recipe())
    completed(RunDir.for_recipe(recipe), "sft", recipe, {"model": "model"})
    (chdir_tmp / "runs" / "LATEST").unlink()
    one_line_error(invoke("merge"), "runs/LATEST does not name a run", "holds tiny", "--recipe")


def test_status_after_an_interrupted_ppo_names_resume(make_recipe, chdir_tmp):
    recipe = load_recipe(make_recipe())
    run = RunDir.for_recipe(recipe)
    for stage in ("sft", "rm"):
        completed(run, stage, recipe, {"model": "model"})
    with pytest.raises(KeyboardInterrupt), StageRecord(run, "ppo", recipe, {}) as record:
        record.replacing()
        (record.dir / "checkpoints" / "iter_00004").mkdir(parents=True)
        raise KeyboardInterrupt
    result = invoke("status", "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["next"] == "rlhf ppo --resume"
    assert [r["status"] for r in status["stages"]][:3] == ["completed", "completed", "interrupted"]
    human = invoke("status")
    assert "next: rlhf ppo --resume" in human.stdout
    listing = json.loads(invoke("status", "--all", "--json").stdout)
    assert listing[0]["run"] == "tiny" and listing[0]["latest"]
    assert listing[0]["completed"] == ["sft", "rm"]
