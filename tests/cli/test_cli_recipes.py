"""`rlhf validate`: the shipped recipes validate, mistral7b.yaml carries the guide's settings
exactly, and without --recipe the latest run's snapshot or the embedded default is used."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def validate_json(name: str) -> dict:
    result = CliRunner().invoke(app, ["validate", "--recipe", str(RECIPES / name), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_mistral7b_has_the_guides_values():
    r = validate_json("mistral7b.yaml")
    assert r["model"]["name_or_path"] == "mistralai/Mistral-7B-Instruct-v0.2"
    assert r["model"]["quantization"] == {
        "load_in_4bit": True,
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
    }
    lora = r["model"]["lora"]
    assert (lora["enabled"], lora["r"], lora["alpha"], lora["dropout"]) == (True, 16, 32, 0.05)
    assert lora["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    reward = r["reward"]
    assert reward["pretrained"] == "OpenAssistant/reward-model-deberta-v3-large-v2"
    assert reward["template"] == "Human: {prompt}\n\nAssistant: {response}"
    assert reward["max_length"] == 512
    prompts = r["data"]["prompts"]
    assert (prompts["path"], prompts["split"], prompts["max_samples"]) == (
        "Anthropic/hh-rlhf",
        "train",
        3000,
    )
    assert (prompts["min_words"], prompts["max_chars"], prompts["max_tokens"]) == (6, 512, 256)
    ppo = r["ppo"]
    expected = {
        "learning_rate": 1.4e-5,
        "batch_size": 32,
        "mini_batch_size": 4,
        "ppo_epochs": 4,
        "gradient_accumulation_steps": 2,
        "init_kl_coef": 0.2,
        "target_kl": 6.0,
        "horizon": 10000,
        "gamma": 1.0,
        "lam": 0.95,
        "vf_coef": 0.1,
        "cliprange": 0.2,
        "cliprange_value": 0.2,
        "max_grad_norm": 0.5,
        "adaptive_kl": True,
        "iterations": 500,
        "save_freq": 50,
    }
    assert {k: ppo[k] for k in expected} == expected
    guide = {"max_new_tokens": 200, "temperature": 0.8, "top_p": 0.9, "top_k": 0, "do_sample": True}
    assert {k: ppo["generation"][k] for k in guide} == guide
    assert (ppo["generation"]["backend"], ppo["generation"]["tis_cap"]) == ("hf", None)
    # beyond the guide, what a 7B run needs: unended answers penalised, the scores clipped after
    # the penalty, no weight decay, activations recomputed
    assert (ppo["missing_eos_penalty"], ppo["weight_decay"]) == (1.0, 0.0)
    assert r["model"]["gradient_checkpointing"] is True


def test_real_recipes_penalise_unended_answers():
    assert validate_json("qwen2.5-0.5b.yaml")["ppo"]["missing_eos_penalty"] == 1.0


@pytest.mark.parametrize("name", ["tiny.yaml", "qwen2.5-0.5b.yaml"])
def test_shipped_recipes_validate(name):
    assert validate_json(name)["run"]["name"]


def test_every_stage_is_a_command():
    import re

    out = CliRunner().invoke(app, ["--help"]).output
    listed = set(re.findall(r"^│ ([a-z-]+) ", out, re.M))
    assert {
        "sft",
        "train-rm",
        "ppo",
        "audit",
        "merge",
        "push",
        "validate",
        "report",
        "compare",
    } <= listed, out
    for command in [*sorted(listed), None]:
        args = [command, "--help"] if command else ["--help"]
        result = CliRunner().invoke(app, args, terminal_width=120)
        assert result.exit_code == 0 and "Usage" in result.output, command
        assert "--help" in result.output
        typed_flags = [x for x in result.output.splitlines() if "<bool>" in x]
        assert not typed_flags, typed_flags  # a flag takes no value: no type shown


def test_validate_without_recipe_uses_the_latest_run(make_recipe, tmp_path: Path) -> None:
    recipe = load_recipe(make_recipe({"run": {"name": "picked"}}))
    RunDir.for_recipe(recipe).prepare(recipe)
    result = CliRunner().invoke(app, ["validate", "--json", "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["run"]["name"] == "picked"


def test_validate_without_recipe_or_runs_uses_the_embedded_default(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["validate", "--json", "--runs-dir", str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["name_or_path"] == "builtin:tiny-lm"


def test_set_overrides_are_typed_validated_and_recorded(make_recipe, tmp_path: Path) -> None:
    path = make_recipe()
    args = ["validate", "--recipe", str(path), "--json"]
    sets = ["--set", "ppo.learning_rate=1e-5", "--set", "model.lora.r=8", "--set", "run.name=o"]
    result = CliRunner().invoke(app, args + sets)
    assert result.exit_code == 0, result.output
    resolved = json.loads(result.stdout)
    assert resolved["ppo"]["learning_rate"] == 1e-5 and resolved["model"]["lora"]["r"] == 8
    assert resolved["run"]["name"] == "o"
    # what a stage snapshots into the run is the overridden recipe
    recipe = load_recipe(path, ["ppo.iterations=3", "run.name=o"])
    RunDir.for_recipe(recipe).prepare(recipe)
    snapshot = load_recipe(tmp_path / "runs" / "o" / "recipe.yaml")
    assert (snapshot.ppo.iterations, snapshot.run.name) == (3, "o")


@pytest.mark.parametrize(
    "arg, message",
    [
        ("ppo.nope=1", "error: --set ppo.nope=1: ppo.nope: unknown key"),
        ("ppo.batch_size=abc", "error: --set ppo.batch_size=abc: ppo.batch_size: Input should be"),
        ("ppo.batch_size.x=3", "error: --set ppo.batch_size.x=3: ppo.batch_size is not a section"),
        ("ppo", "error: --set ppo: write it as dotted.path=value"),
        ("ppo.num_generations=5", "error: --set ppo.num_generations=5: ppo.num_generations: 5"),
    ],
)
def test_a_bad_override_names_the_argument_and_the_field(make_recipe, arg, message) -> None:
    result = CliRunner().invoke(app, ["sft", "--recipe", str(make_recipe()), "--set", arg])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output


@pytest.mark.parametrize("command", ["validate", "sft", "train-rm", "ppo"])
@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_a_tracker_not_installed_is_one_line_naming_the_extra(
    make_recipe, monkeypatch, tmp_path: Path, command: str, tracker: str
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, tracker, None)  # as if the package were not installed
    args = [command, "--recipe", str(make_recipe()), "--set", f"run.trackers=[{tracker}]"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: run.trackers lists {tracker} but the {tracker} package is not installed: "
        f"pip install 'rlhf-cli[{tracker}]'\n"
    )
    assert not (tmp_path / "runs").exists()  # refused before the run is touched
