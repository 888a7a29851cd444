"""A crash never reads as a result, and values are checked where they enter.

Part one: values the schema used to accept and a library refused later, with a traceback
(issue 40, item 5): each is now one `error:` line naming the recipe field, exit 2. Part two: a
bug (an exception that is not an `RlhfError`) in any command exits 70, never 1 (`rlhf audit`'s
"hacking found"), its traceback in `error.log` in the open stage's folder (else the run's, else
the temp folder), one stderr line naming the error and the log, the run's earlier results intact.
Nothing trains here: a forced error is a monkeypatched stage function.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from test_cli_audit_push import assert_one_line_error
from test_faults import completed
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.errors import INTERNAL_ERROR, ModelLoadError, crash_log_name
from rlhf_cli.modeling import load_tokenizer
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ── values checked where they enter: one line naming the field, exit 2 ────────────────────────


@pytest.mark.parametrize("seed", ["1180591620717411303424", "4294967296", "-1"])
@pytest.mark.parametrize("command", ["validate", "sft"])
def test_a_seed_numpy_refuses_is_a_recipe_error(make_recipe, chdir_tmp, command, seed):
    result = invoke(command, "--recipe", str(make_recipe()), "--set", f"run.seed={seed}")
    assert_one_line_error(result, f"--set run.seed={seed}: run.seed: {seed} is out of range")
    assert "0 to 2147483647" in result.output


def test_the_largest_seed_is_taken_by_every_seeded_library(make_recipe):
    """2**31 - 1, plus a PPO process index, seeds Python, NumPy and torch (the stages'
    `seed_everything`) and transformers' Trainer (`set_seed`)."""
    import random

    import numpy as np
    from transformers import set_seed

    from rlhf_cli.stages.common import seed_everything

    seed = load_recipe(make_recipe({"run": {"seed": 2**31 - 1}})).run.seed
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        for process in range(8):
            seed_everything(seed + process)
            set_seed(seed + process)
    finally:  # the other tests' generators as they were
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def test_a_device_map_transformers_refuses_is_a_recipe_error(make_recipe, chdir_tmp):
    result = invoke("validate", "--recipe", str(make_recipe({"model": {"device_map": "gpu0"}})))
    assert_one_line_error(result, "model.device_map: 'gpu0' is not a device_map")
    for taken in ("auto", "balanced_low_0", "cpu", "cuda", "cuda:1"):
        load_recipe(make_recipe({"model": {"device_map": taken}}))


def test_lora_targets_the_model_lacks_are_one_line(make_recipe, chdir_tmp):
    """peft refuses a list none of which matches (a traceback) and silently skips a typo beside
    a name that does."""
    path = make_recipe({"sft": {"full_finetune": False}})
    result = invoke(
        "sft", "--recipe", str(path), "--set", "model.lora.target_modules=[q_prj, v_proj]"
    )
    assert_one_line_error(result, "model.lora.target_modules: q_prj names no module of the model")
    assert "q_proj" in result.output  # the names it could have meant
    assert not RunDir.for_recipe(load_recipe(path)).path.exists()


def test_a_reward_max_length_over_the_reward_models_context_is_one_line(make_recipe, chdir_tmp):
    """MiniLM has 512 positions: a longer pair fails inside BERT's embeddings."""
    result = invoke("train-rm", "--recipe", str(make_recipe()), "--set", "reward.max_length=1024")
    assert_one_line_error(
        result, "reward.max_length (1024) exceeds the reward model's context of 512 tokens"
    )


def test_a_reward_tokenizer_with_ids_past_the_models_embeddings_is_one_line(make_recipe, chdir_tmp):
    path = make_recipe({"reward": {"base_model": "builtin:tiny-lm", "tokenizer": "builtin:minilm"}})
    result = invoke("train-rm", "--recipe", str(path))
    # the tiny model's vocabulary is its tokenizer's, built from the shipped data
    vocabulary = len(load_tokenizer("builtin:tiny-lm"))
    assert_one_line_error(
        result,
        f"reward.tokenizer: the tokenizer has 30522 tokens but the reward model only {vocabulary} "
        "embeddings",
    )


class _Tokenizer:
    """As much of a tokenizer as the checks read: its length."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize("section", ["audit", "ppo"])
def test_a_prompt_and_answer_over_the_policys_context_are_refused(
    make_recipe, llama_config, section
):
    """The audit's, compare's and PPO's engine: longer sequences fail a model with learned
    positions, and vLLM refuses them."""
    from transformers import LlamaForCausalLM

    from rlhf_cli.stages.trained import generation_engine

    recipe = load_recipe(make_recipe({section: {"generation": {"max_new_tokens": 100}}}))
    model = LlamaForCausalLM(llama_config(max_position_embeddings=128))
    gen = getattr(recipe, section).generation
    with pytest.raises(ModelLoadError) as caught:
        generation_engine(gen, model, _Tokenizer(64), recipe, Path("unused"))
    assert str(caught.value) == (
        f"data.prompts.max_tokens + {section}.generation.max_new_tokens (64 + 100 = 164) "
        "exceeds the policy's context of 128 tokens: make their sum at most 128"
    )


def test_a_policy_tokenizer_with_ids_past_the_embeddings_is_refused(make_recipe, llama_config):
    from transformers import LlamaForCausalLM

    from rlhf_cli.stages.trained import generation_engine

    recipe = load_recipe(make_recipe())
    model = LlamaForCausalLM(llama_config(vocab_size=64))
    with pytest.raises(ModelLoadError, match=r"model.tokenizer: the tokenizer has 65 tokens"):
        generation_engine(recipe.audit.generation, model, _Tokenizer(65), recipe, Path("unused"))


def test_bfloat16_for_vllm_on_a_gpu_without_it_is_one_line(make_recipe, monkeypatch):
    """A GPU before Ampere: vLLM refuses bfloat16 (a traceback from its engine), torch only
    emulates it; `transformers` generation keeps what was asked (test_modeling)."""
    from types import SimpleNamespace

    from rlhf_cli.stages.trained import generation_engine

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    vllm = {"generation": {"backend": "vllm"}}
    recipe = load_recipe(make_recipe({"model": {"dtype": "bfloat16"}, "audit": vllm}))
    on_a_gpu = SimpleNamespace(  # what the checks before the engine read of a policy
        config=SimpleNamespace(max_position_embeddings=512),
        get_input_embeddings=lambda: SimpleNamespace(num_embeddings=64),
        parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]),
    )
    with pytest.raises(ModelLoadError) as caught:
        generation_engine(recipe.audit.generation, on_a_gpu, _Tokenizer(64), recipe, Path("x"))
    assert str(caught.value) == (
        "model.dtype is bfloat16, which the vLLM engine refuses on this GPU (it computes "
        "bfloat16 natively from Ampere, compute capability 8.0): set model.dtype to float16 or "
        "auto"
    )


# ── a bug in any command: exit 70, the traceback in a log, earlier results intact ─────────────


class Boom(ZeroDivisionError):
    """The forced internal error: nothing a stage raises on purpose."""


def _raise(*args, **kwargs):
    raise Boom("forced\nsecond line")


# command line, the function made to fail, and the folder (under the run) its log goes to: a
# stage's own folder when the failure comes while it is open (its StageRecord), else the run's
CASES = {
    "sft": (["sft"], "rlhf_cli.stages.sft.setup", "sft"),
    "train-rm": (["train-rm"], "rlhf_cli.stages.reward.setup", "rm"),
    "ppo": (["ppo"], "rlhf_cli.stages.ppo.setup", "ppo"),
    "audit": (["audit", "--responses", "RESPONSES"], "rlhf_cli.stages.audit.audit_responses", ""),
    "merge": (["merge"], "rlhf_cli.stages.merge.run_merge", ""),
    "push": (["push", "--dry-run"], "rlhf_cli.stages.push.run_push", ""),
    "report": (["report"], "rlhf_cli.stages.report.run_report", ""),
    "status": (["status"], "rlhf_cli.stages.status.run_status", ""),
    "compare": (["compare"], "rlhf_cli.stages.compare.run_compare", ""),
    "validate": (["validate"], "rlhf_cli.cli.require_trackers", ""),
    "plan": (["plan"], "rlhf_cli.stages.plan.plan_command", ""),
}


@pytest.fixture
def earlier_run(make_recipe, chdir_tmp) -> tuple[Path, RunDir]:
    """A run whose sft and rm stages completed (empty output folders: nothing loads them)."""
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    completed(run, "sft", recipe, {"model": "model", "tokenizer": "tokenizer"})
    completed(run, "rm", recipe, {"model": "model", "tokenizer": "tokenizer"})
    return path, run


def assert_internal_error(result, log_folder: Path) -> Path:
    """Exit 70, one stderr line naming the error and the log, the traceback in the log."""
    assert result.exit_code == INTERNAL_ERROR, result.output
    assert "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    log = log_folder / "error.log"
    assert line == f"error: internal error Boom: forced (traceback: {log})", line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "Boom: forced\nsecond line" in text
    assert "in _raise" in text  # the frame that raised
    return log


@pytest.mark.parametrize("command", list(CASES))
def test_a_bug_in_any_command_exits_70_with_its_log(earlier_run, monkeypatch, command):
    path, run = earlier_run
    args, target, stage = CASES[command]
    sft_before = run.manifest_path("sft").read_bytes()
    rm_before = run.manifest_path("rm").read_bytes()
    responses = path.parent / "responses.jsonl"
    responses.write_text(json.dumps({"prompt": "Hi?", "response": "Hello."}) + "\n")
    args = [str(responses) if a == "RESPONSES" else a for a in args]
    if command not in ("status", "report"):
        args += ["--recipe", str(path)]
    monkeypatch.setattr(target, _raise)

    result = invoke(*args, "--runs-dir", str(run.output_dir))

    assert_internal_error(result, run.path / stage if stage else run.path)
    if command != "sft":  # the earlier results: untouched
        assert run.manifest_path("sft").read_bytes() == sft_before
    if command != "train-rm":
        assert run.manifest_path("rm").read_bytes() == rm_before
    assert (run.output_dir / "LATEST").read_text().strip() == run.name


@pytest.mark.parametrize("stage, command", [("sft", "sft"), ("rm", "train-rm")])
def test_a_stage_that_crashes_before_replacing_keeps_its_completed_result(
    earlier_run, monkeypatch, stage, command
):
    path, run = earlier_run
    _, target, _ = CASES[command]
    monkeypatch.setattr(target, _raise)
    assert_internal_error(invoke(command, "--recipe", str(path)), run.stage_dir(stage))
    manifest = run.read_manifest(stage)
    assert manifest["status"] == "completed"
    assert manifest["last_attempt"]["status"] == "failed"
    assert manifest["last_attempt"]["error"] == "Boom: forced"


def test_a_stage_that_crashes_with_no_earlier_result_says_failed(
    make_recipe, chdir_tmp, monkeypatch
):
    path = make_recipe()
    recipe = load_recipe(path)
    run = RunDir.for_recipe(recipe)
    completed(run, "sft", recipe, {"model": "model", "tokenizer": "tokenizer"})
    sft_before = run.manifest_path("sft").read_bytes()
    monkeypatch.setattr("rlhf_cli.stages.reward.setup", _raise)
    assert_internal_error(invoke("train-rm", "--recipe", str(path)), run.stage_dir("rm"))
    manifest = run.read_manifest("rm")
    assert manifest["status"] == "failed" and manifest["error"] == "Boom: forced"
    assert run.manifest_path("sft").read_bytes() == sft_before


@pytest.fixture
def temp(chdir_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temp folder, for this test: where a log goes when there is no run folder."""
    folder = chdir_tmp / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_bug_with_no_run_folder_logs_to_the_temp_folder(make_recipe, temp, monkeypatch):
    monkeypatch.setattr("rlhf_cli.cli.require_trackers", _raise)
    path = make_recipe()
    result = invoke("validate", "--recipe", str(path))
    assert result.exit_code == INTERNAL_ERROR
    (log,) = temp.glob("rlhf-validate-*.log")
    assert result.stderr.strip() == f"error: internal error Boom: forced (traceback: {log})"
    assert "Boom: forced" in log.read_text()
    assert not RunDir.for_recipe(load_recipe(path)).path.exists()  # no run made for a log


def test_a_first_stage_that_crashes_leaves_no_run_behind(make_recipe, temp, monkeypatch):
    monkeypatch.setattr("rlhf_cli.stages.sft.setup", _raise)
    path = make_recipe()
    result = invoke("sft", "--recipe", str(path))
    assert result.exit_code == INTERNAL_ERROR
    assert len(list(temp.glob("rlhf-sft-*.log"))) == 1
    assert not RunDir.for_recipe(load_recipe(path)).path.exists()


def test_an_os_error_naming_no_file_is_a_bug_too(earlier_run, monkeypatch):
    path, run = earlier_run

    def reset(*args, **kwargs):
        raise ConnectionResetError("peer reset")

    monkeypatch.setattr("rlhf_cli.stages.compare.run_compare", reset)
    result = invoke("compare", "--recipe", str(path))
    assert result.exit_code == INTERNAL_ERROR
    log = run.path / "error.log"
    line = f"error: internal error ConnectionResetError: peer reset (traceback: {log})"
    assert result.stderr.strip() == line


def test_each_process_of_a_multi_process_run_has_its_own_log(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert crash_log_name() == "error.log"
    monkeypatch.setenv("RANK", "0")
    assert crash_log_name() == "error.log"
    monkeypatch.setenv("RANK", "3")
    assert crash_log_name() == "error.rank3.log"
