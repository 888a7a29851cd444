"""The `rlhf` command: exit codes and messages of audit --responses, push and report.

No model is trained here: audit reads responses from a file, and push runs on a hand-made merged
run (a manifest and a model folder of placeholder files; push never reads the weights). The
models end to end are in tests/stages/test_audit_merge_push.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir

REPORT_KEYS = {
    "verbosity_score",
    "sycophancy_score",
    "repetition_score",
    "avg_response_len",
    "n_responses",
    "hacking_detected",
    "flags",
}
CANARY = "hf_canary_cli_0123456789abcdefXYZ"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


# ── audit --responses ─────────────────────────────────────────────────────────────────────────

CLEAN = [
    {
        "prompt": "How do I keep flowers fresh?",
        "response": "Trim the stems and change the water every day.",
    },
    {
        "prompt": "How do I clean glasses?",
        "response": "Use warm water, dish soap and a microfibre cloth.",
    },
]
HACKED = [
    {"prompt": "How do I keep flowers fresh?", "response": "Great question! Trim them."},
    {"prompt": "How do I clean glasses?", "response": "Absolutely right to ask! Rinse."},
]


def test_audit_responses_clean_exits_0_and_saves_the_report(make_recipe, chdir_tmp) -> None:
    recipe = make_recipe()
    responses = write_jsonl(chdir_tmp / "clean.jsonl", CLEAN)
    result = invoke("audit", "--responses", str(responses), "--recipe", str(recipe), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert REPORT_KEYS <= set(report)
    assert report["n_responses"] == 2 and report["flags"] == []
    assert report["hacking_detected"] is False
    assert report["avg_response_len"] == 9.0  # 9 words each
    saved = chdir_tmp / "runs" / load_recipe(recipe).run.name / "audit" / "responses-clean.json"
    assert Path(report["path"]) == saved and saved.is_file()
    on_disk = json.loads(saved.read_text())
    assert {k: on_disk[k] for k in REPORT_KEYS} == {k: report[k] for k in REPORT_KEYS}
    assert on_disk["samples"][0] == CLEAN[0]


def test_audit_responses_hacking_exits_1(make_recipe, chdir_tmp) -> None:
    responses = write_jsonl(chdir_tmp / "hacked.jsonl", HACKED)
    result = invoke(
        "audit", "--responses", str(responses), "--recipe", str(make_recipe()), "--json"
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["sycophancy_score"] == 1.0
    assert report["flags"] == ["sycophancy"] and report["hacking_detected"] is True
    assert "reward hacking detected: sycophancy" in result.stderr
    assert "Traceback" not in result.output
    assert (chdir_tmp / "runs" / "tiny" / "audit" / "responses-hacked.json").is_file()


def test_audit_responses_missing_file_exits_2(make_recipe, chdir_tmp) -> None:
    result = invoke(
        "audit",
        "--responses",
        str(chdir_tmp / "nope.jsonl"),
        "--recipe",
        str(make_recipe()),
        "--json",
    )
    assert_one_line_error(result, "file not found", "nope.jsonl")


@pytest.mark.parametrize("command", ["audit", "compare"])
def test_a_command_run_before_ppo_names_itself_and_what_to_run(
    make_recipe, chdir_tmp, command
) -> None:
    result = invoke(command, "--recipe", str(make_recipe()))
    assert_one_line_error(result, f"rlhf {command} needs the ppo stage", "run `rlhf ppo` first")


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([CLEAN[0], {"prompt": "no answer here"}], "hacked.jsonl:2: a row needs"),
        ([CLEAN[0], "this is { not json"], "hacked.jsonl:2: not a JSON object"),
        ([json.dumps(["a", "list"])], "hacked.jsonl:1: a row needs"),
        ([], "no responses"),
    ],
)
def test_audit_responses_bad_rows_exit_2(make_recipe, chdir_tmp, rows, needle) -> None:
    responses = write_jsonl(chdir_tmp / "hacked.jsonl", rows)
    result = invoke(
        "audit", "--responses", str(responses), "--recipe", str(make_recipe()), "--json"
    )
    assert_one_line_error(result, needle)
    assert not (chdir_tmp / "runs" / "tiny" / "audit" / "responses-hacked.json").exists()


def test_audit_responses_binary_file_exits_2_not_1(make_recipe, chdir_tmp) -> None:
    responses = chdir_tmp / "model.safetensors"
    responses.write_bytes(b"\xff\xfe\x00\x01 not text")
    result = invoke("audit", "--responses", str(responses), "--recipe", str(make_recipe()))
    assert_one_line_error(result, "not UTF-8 text")


# ── push on a hand-made merged run ────────────────────────────────────────────────────────────


@pytest.fixture
def merged_run(make_recipe, chdir_tmp) -> tuple[Path, RunDir]:
    """A run whose merged stage is completed: manifest + a folder of placeholder files."""
    path = make_recipe({"push": {"repo_id": "tester/cli-push"}})
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    run.prepare(recipe)
    model = run.stage_dir("merged") / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    save_file({}, str(model / "model.safetensors"))  # whole, and holding no weights
    run.manifest_path("merged").write_text(
        json.dumps(
            {"stage": "merged", "status": "completed", "outputs": {"model": "model"}, "metrics": {}}
        )
    )
    return path, run


@pytest.fixture
def no_saved_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token")
    )


def test_push_without_a_token_exits_2_naming_hf_token(merged_run, no_saved_login) -> None:
    path, run = merged_run
    result = invoke("push", "--recipe", str(path))
    assert_one_line_error(result, "HF_TOKEN")
    assert run.read_manifest("push") is None


def test_push_hub_error_exits_2_with_the_token_redacted(merged_run, monkeypatch) -> None:
    """No hub is reachable here: create_repo is replaced by one that fails like an HTTP 401
    whose message echoes the token, to check the token never reaches output or files."""
    import huggingface_hub

    path, run = merged_run
    monkeypatch.setenv("HF_TOKEN", CANARY)

    def refusing_create_repo(self, repo_id, **kwargs):
        raise RuntimeError(
            f"401 Client Error: invalid token {CANARY} for {repo_id}\n"
            f"Authorization: Bearer {CANARY}"
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refusing_create_repo)
    result = invoke("push", "--recipe", str(path))
    assert_one_line_error(result, "push to tester/cli-push failed", "invalid token ***")
    assert CANARY not in result.output
    assert run.read_manifest("push")["status"] == "failed"
    for file in run.path.rglob("*"):
        if file.is_file():
            assert CANARY.encode() not in file.read_bytes(), file


def test_push_before_merge_names_the_command(make_recipe, chdir_tmp) -> None:
    path = make_recipe({"push": {"repo_id": "tester/cli-push"}})
    result = invoke("push", "--dry-run", "--recipe", str(path))
    assert_one_line_error(result, "rlhf merge")


def test_push_without_repo_id_exits_2(make_recipe, chdir_tmp) -> None:
    result = invoke("push", "--dry-run", "--recipe", str(make_recipe({"push": {"repo_id": None}})))
    assert_one_line_error(result, "push.repo_id is not set")


def test_merge_unknown_stage_exits_2(make_recipe, chdir_tmp) -> None:
    result = invoke("merge", "--stage", "rm", "--recipe", str(make_recipe()))
    assert_one_line_error(result, "--stage must be ppo or sft")


# ── report ────────────────────────────────────────────────────────────────────────────────────


def test_report_with_no_runs_exits_2(chdir_tmp) -> None:
    result = invoke("report")
    assert_one_line_error(result, "no run yet under runs")


def test_report_of_an_unknown_run_exits_2(merged_run) -> None:
    result = invoke("report", "nosuch")
    assert_one_line_error(result, "no run named 'nosuch'")


def test_report_of_a_run_without_ppo_exits_2(merged_run) -> None:
    result = invoke("report")
    assert_one_line_error(result, "has no PPO metrics", "rlhf ppo")
