"""`rlhf serve --model JUDGE`: a judge for `rlhf eval` served instead of the policy, its model
resolved as the recipe's `model.name_or_path` is (a `builtin:` name built, a `.gguf` file
dequantized), served under the name given, and the `--set` line that points `rlhf eval` at it;
no stage of the run is needed. A name that does not resolve is one line, exit 2. The server
itself, judging for `rlhf eval`, is tests/stages/test_vllm_judge.py (`make test-vllm`)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rlhf_cli import modeling, views
from rlhf_cli.cli import app
from rlhf_cli.modeling import resolve_model_path
from rlhf_cli.recipe import load_recipe

PORT = "8123"
URL = f"http://127.0.0.1:{PORT}"


def print_command(recipe: Path, model: str, *extra: str):
    return CliRunner().invoke(
        app,
        ["serve", "--recipe", str(recipe), "--port", PORT, "--model", model, "--print-command",
         *extra],
    )  # fmt: skip


def _value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_a_builtin_judge_needs_no_run_and_is_served_under_its_name(make_recipe, chdir_tmp):
    recipe = make_recipe()  # SFT on, and no run: the policy's server could not start
    result = print_command(recipe, "builtin:tiny-lm", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    command = info["command"]
    assert _value(command, "--model") == resolve_model_path("builtin:tiny-lm")
    assert _value(command, "--tokenizer") == _value(command, "--model")
    assert _value(command, "--served-model-name") == "builtin:tiny-lm"
    assert _value(command, "--max-model-len") == "auto"  # a prompt and two answers: its context
    assert _value(command, "--dtype") == "float32" and "--enforce-eager" in command
    assert "--enable-lora" not in command and "--logprobs-mode" not in command  # the policy's
    assert info["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # no dev endpoints on a judge
    assert (info["role"], info["model"], info["url"]) == ("judge", "builtin:tiny-lm", URL)
    assert info["set"] == f"--set eval.judge.url={URL} --set eval.judge.model=builtin:tiny-lm"
    assert not (chdir_tmp / "runs" / "tiny" / "sft").exists()


def test_the_printed_eval_line_sets_the_judge_it_serves(make_recipe, chdir_tmp, capsys):
    """Once the judge answers, stdout has the `rlhf eval` line, whose --set options load (a
    name with a space quoted) into the recipe's eval.judge."""
    recipe = make_recipe()
    judge = chdir_tmp / "my judge"
    judge.mkdir()
    info = json.loads(print_command(recipe, str(judge), "--json").stdout)
    assert info["command"][info["command"].index("--model") + 1] == str(judge)
    views.serve_ready(info, started=True, as_json=False, console=Console(stderr=True))
    line = capsys.readouterr().out.strip()
    assert line.startswith("rlhf eval --set eval.judge.url=")
    words = shlex.split(line)
    sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    loaded = load_recipe(recipe, sets).eval.judge
    assert loaded is not None and (loaded.url, loaded.model) == (URL, str(judge))


def test_the_plain_print_command_is_the_judge_server_command(make_recipe, chdir_tmp):
    result = print_command(make_recipe(), "builtin:tiny-lm")
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    assert words[0] == "VLLM_CPU_KVCACHE_SPACE=1"
    assert words[2:4] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _value(words, "--served-model-name") == "builtin:tiny-lm"


def test_a_gguf_file_is_dequantized_as_the_policys_gguf_is(
    make_recipe, chdir_tmp, monkeypatch: pytest.MonkeyPatch
):
    gguf = chdir_tmp / "judge.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    read: list[Path] = []

    def dequantized(path: Path) -> Path:
        read.append(path)
        return chdir_tmp / "float-judge"

    monkeypatch.setattr(modeling, "gguf_folder", dequantized)
    result = print_command(make_recipe(), str(gguf), "--json")
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["command"]
    assert read == [gguf] and _value(command, "--model") == str(chdir_tmp / "float-judge")
    assert _value(command, "--served-model-name") == str(gguf)


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("./no-such-judge", "--model ./no-such-judge: model folder not found: "),
        ("builtin:gpt5", "--model builtin:gpt5: unknown built-in model 'builtin:gpt5'"),
    ],
)
def test_a_judge_that_does_not_resolve_is_one_line_exit_2(make_recipe, chdir_tmp, model, needle):
    result = print_command(make_recipe(), model)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {needle}"), result.output
