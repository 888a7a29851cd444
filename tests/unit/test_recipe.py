"""Recipes: validation at load, one line per problem naming the dotted field and the YAML line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.errors import RecipeError
from rlhf_cli.recipe import load_recipe, parse_recipe

TINY_DATA = Path(__file__).resolve().parents[2] / "data" / "tiny"

# Line numbers (1-based) are pinned by the tests below: edit with care.
VALID = f"""\
run:
  name: t
  output_dir: runs
model:
  name_or_path: builtin:tiny-lm
data:
  sft:
    path: {TINY_DATA / "sft.jsonl"}
  preferences:
    path: {TINY_DATA / "preferences.jsonl"}
  prompts:
    path: {TINY_DATA / "prompts.jsonl"}
reward:
  base_model: builtin:minilm
ppo:
  learning_rate: 1.0e-5
  batch_size: 16
  mini_batch_size: 4
  gradient_accumulation_steps: 2
"""
LINE = {
    "data": 6,
    "data.sft.path": 8,
    "reward": 13,
    "ppo.learning_rate": 16,
    "ppo.batch_size": 17,
    "ppo.mini_batch_size": 18,
    "ppo.gradient_accumulation_steps": 19,
}


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return info.value.problems


def validate_cli(path: Path, *extra: str):
    return CliRunner().invoke(app, ["validate", "--recipe", str(path), *extra])


def test_line_numbers_of_the_fixture_are_right() -> None:
    lines = VALID.splitlines()
    assert lines[LINE["ppo.learning_rate"] - 1].strip().startswith("learning_rate:")
    assert lines[LINE["data.sft.path"] - 1].strip().startswith("path:")
    assert lines[LINE["ppo.gradient_accumulation_steps"] - 1].strip().startswith("gradient_")


# ── a valid recipe ──────────────────────────────────────────────────────────────────────────


def test_valid_recipe_fills_defaults_and_resolves_paths(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, VALID))
    assert recipe.ppo.batch_size == 16 and recipe.ppo.mini_batch_size == 4
    assert recipe.sft.learning_rate == 2e-4  # default
    assert recipe.model.lora.target_modules[0] == "q_proj"  # the guide's defaults
    assert recipe.model.name_or_path == "builtin:tiny-lm"  # kept, not built at validation
    assert recipe.data.sft.path == str((TINY_DATA / "sft.jsonl").resolve())


def test_relative_data_path_resolves_against_the_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.jsonl").write_text('{"prompt": "a b c d e f"}\n')
    text = edit(VALID, f"path: {TINY_DATA / 'prompts.jsonl'}", "path: d/p.jsonl")
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.data.prompts.path == str((tmp_path / "d" / "p.jsonl").resolve())


def test_hub_names_are_kept_as_given(tmp_path: Path) -> None:
    text = edit(VALID, f"path: {TINY_DATA / 'prompts.jsonl'}", "path: Anthropic/hh-rlhf")
    assert load_recipe(write(tmp_path, text)).data.prompts.path == "Anthropic/hh-rlhf"


def test_sha256_changes_with_content_only(tmp_path: Path) -> None:
    one = load_recipe(write(tmp_path, VALID, "a.yaml"))
    same = load_recipe(write(tmp_path, VALID.replace("  name: t\n", "  name: t   # x\n"), "b.yaml"))
    other = load_recipe(write(tmp_path, edit(VALID, "batch_size: 16", "batch_size: 32"), "c.yaml"))
    assert one.sha256() == same.sha256()
    assert one.sha256() != other.sha256()


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, VALID))
    again = parse_recipe(recipe.to_yaml(), base_dir=tmp_path)
    assert again.model_dump() == recipe.model_dump()


def test_validate_prints_the_resolved_recipe(tmp_path: Path) -> None:
    result = validate_cli(write(tmp_path, VALID))
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["sft"]["learning_rate"] == 2e-4  # a default, filled in
    assert printed["ppo"]["mini_batch_size"] == 4
    assert printed["data"]["sft"]["path"] == str((TINY_DATA / "sft.jsonl").resolve())


def test_validate_json_prints_one_object(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    result = validate_cli(path, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == load_recipe(path).model_dump(mode="json")
    assert printed["reward"]["base_model"] == "builtin:minilm"
    assert printed["audit"]["sycophancy_threshold"] == 0.2


def test_embedded_default_recipe_validates(repo_root: Path) -> None:
    result = validate_cli(repo_root / "recipes" / "tiny.yaml", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["name_or_path"] == "builtin:tiny-lm"


# ── one line per problem, with the dotted path and the line ──────────────────────────────────


@pytest.mark.parametrize(
    ("old", "new", "field", "line", "words"),
    [
        (
            "  gradient_accumulation_steps: 2\n",
            "  gradient_accumulation_steps: 2\n  lerning_rate: 1\n",
            "ppo.lerning_rate",
            20,
            "unknown key",
        ),
        (
            "batch_size: 16",
            "batch_size: many",
            "ppo.batch_size",
            LINE["ppo.batch_size"],
            "valid integer",
        ),
        (
            "learning_rate: 1.0e-5",
            "learning_rate: -1.0e-5",
            "ppo.learning_rate",
            LINE["ppo.learning_rate"],
            "greater than 0",
        ),
        (
            "mini_batch_size: 4",
            "mini_batch_size: 5",
            "ppo.mini_batch_size",
            LINE["ppo.mini_batch_size"],
            "must divide ppo.batch_size (16)",
        ),
        (
            "gradient_accumulation_steps: 2",
            "gradient_accumulation_steps: 3",
            "ppo.gradient_accumulation_steps",
            LINE["ppo.gradient_accumulation_steps"],
            "(12) must divide ppo.batch_size (16)",
        ),
        (
            f"path: {TINY_DATA / 'sft.jsonl'}",
            "path: missing/sft.jsonl",
            "data.sft.path",
            LINE["data.sft.path"],
            "data file not found",
        ),
        (
            "  base_model: builtin:minilm\n",
            "  base_model: builtin:minilm\n  pretrained: builtin:tiny-lm\n",
            "reward.pretrained",
            15,
            "not both",
        ),
        (
            "  gradient_accumulation_steps: 2\n",
            "  gradient_accumulation_steps: 2\n  loss_aggregation: dapo\n",
            "ppo.loss_aggregation",
            20,
            "'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum_norm'",
        ),
        (
            "  gradient_accumulation_steps: 2\n",
            "  gradient_accumulation_steps: 2\n  logprob_support: nucleus\n",
            "ppo.logprob_support",
            20,
            "'sampled' or 'full'",
        ),
        (
            "  gradient_accumulation_steps: 2\n",
            "  gradient_accumulation_steps: 2\n  cliprange_high: 0\n",
            "ppo.cliprange_high",
            20,
            "greater than 0",
        ),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "negative-lr",
        "mini-batch",
        "grad-accum",
        "missing-file",
        "two-reward-sources",
        "loss-aggregation",
        "logprob-support",
        "cliprange-high",
    ],
)
def test_each_problem_names_its_field_and_line(
    tmp_path: Path, old: str, new: str, field: str, line: int, words: str
) -> None:
    path = write(tmp_path, edit(VALID, old, new))
    problems = problems_of(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}:{line}: {field}: "), problems[0]
    assert words in problems[0]

    result = validate_cli(path)
    assert result.exit_code == 2
    assert f"{path}:{line}: {field}: " in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_union_field_is_one_line_without_type_tags(tmp_path: Path) -> None:
    text = edit(
        VALID,
        "  name_or_path: builtin:tiny-lm\n",
        "  name_or_path: builtin:tiny-lm\n  lora:\n    target_modules: 5\n",
    )
    path = write(tmp_path, text)
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:7: model.lora.target_modules: "), problem
    assert "valid list" in problem and "all-linear" in problem


def test_two_problems_give_two_lines(tmp_path: Path) -> None:
    text = edit(VALID, "learning_rate: 1.0e-5", "learning_rate: -1")
    text = edit(text, "  name: t\n", "  name: t\n  sed: 3\n")  # shifts every later line by one
    path = write(tmp_path, text)
    problems = problems_of(path)
    assert problems == [
        f"{path}:3: run.sed: unknown key (check the spelling; `rlhf validate` lists every field)",
        f"{path}:17: ppo.learning_rate: Input should be greater than 0",
    ]
    result = validate_cli(path)
    assert result.exit_code == 2
    error_lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(error_lines) == 2
    assert f"{path}:3: run.sed:" in error_lines[0]
    assert f"{path}:17: ppo.learning_rate:" in error_lines[1]


def test_cross_section_rule_names_the_section(tmp_path: Path) -> None:
    text = edit(VALID, f"  sft:\n    path: {TINY_DATA / 'sft.jsonl'}\n", "")
    path = write(tmp_path, text)
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:6: data: ")  # `data:` is on line 6
    assert "data.sft is not set" in problem


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    text = VALID + "audit:\n  prompts: [a, b\n"  # an unclosed flow sequence
    path = write(tmp_path, text)
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:"), problem
    assert "YAML syntax error" in problem
    assert int(problem.split(":")[1]) >= 21  # at or after the opening line (21)

    result = validate_cli(path)
    assert result.exit_code == 2
    assert "YAML syntax error" in result.output and "Traceback" not in result.output


def test_bad_indentation_is_a_yaml_error_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: t\n model: x\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3: YAML syntax error")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_recipe_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    (problem,) = problems_of(write(tmp_path, text))
    assert "must be a mapping" in problem


def test_missing_recipe_file(tmp_path: Path) -> None:
    result = validate_cli(tmp_path / "nope.yaml")
    assert result.exit_code == 2
    assert "recipe file not found" in result.output


def test_required_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: t\n")
    problems = problems_of(path)
    assert any(p.startswith(f"{path}: model: Field required") for p in problems), problems
    assert any(p.startswith(f"{path}: reward: Field required") for p in problems), problems


def test_run_name_pattern(tmp_path: Path) -> None:
    path = write(tmp_path, edit(VALID, "name: t", "name: ../escape"))
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:2: run.name: ")


@pytest.mark.parametrize("key", ["learning-rate", "lr[0]", "2"])
def test_unknown_key_keeps_its_spelling(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, edit(VALID, "  batch_size: 16\n", f"  batch_size: 16\n  '{key}': 1\n"))
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:18: ppo.{key}: unknown key"), problem


@pytest.mark.parametrize(
    "ppo, data, message",
    [
        ({"advantage_estimator": "rloo"}, {}, "num_generations: rloo compares each completion"),
        ({"num_generations": 5}, {}, "num_generations: 5 must divide ppo.batch_size"),
        ({"eval_every": 5}, {"eval_fraction": 0.0}, "ppo.eval_every is set but no prompts"),
    ],
)
def test_estimator_and_evaluation_settings_that_cannot_work_are_refused(
    make_recipe, ppo, data, message
):

    path = make_recipe({"ppo": {"batch_size": 32, **ppo}, "data": {"prompts": data}})
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("vllm_sleep: true", "vllm.sleep"),
        ("vllm_tensor_parallel_size: 2", "vllm.tensor_parallel_size"),
        ("vllm_gpu_memory_utilization: 0.5", "vllm.gpu_memory_utilization"),
    ],
)
def test_a_flat_vllm_field_names_its_new_place(tmp_path: Path, old: str, new: str) -> None:
    text = edit(VALID, "ppo:\n", f"ppo:\n  generation:\n    {old}\n")
    (problem,) = problems_of(write(tmp_path, text))
    assert "ppo.generation" in problem and f"is now {new}" in problem, problem
    nested = edit(VALID, "ppo:\n", "ppo:\n  generation:\n    vllm:\n      sleep: true\n")
    assert load_recipe(write(tmp_path, nested, "ok.yaml")).ppo.generation.vllm.sleep


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("Q: {question}\nA: {response} {prompt}", "unknown placeholder {question}"),
        ("{prompt} {response} {0}", "unknown placeholder {0}"),
        ("{prompt} {response} {}", "unknown placeholder {}"),
        ("{prompt} {response} }", "a literal brace is written {{ or }}"),
        ("{prompt} { {response}", "a literal brace is written {{ or }}"),
        ("{prompt!z} {response}", "a literal brace is written {{ or }}"),
        ("{prompt}", "must contain both {prompt} and {response}"),
    ],
)
def test_a_bad_reward_template_is_one_line_at_validate(tmp_path, template, says) -> None:
    text = edit(VALID, "reward:\n", f"reward:\n  template: {json.dumps(template)}\n")
    (problem,) = problems_of(write(tmp_path, text))
    assert "reward.template" in problem and says in problem, problem


def test_literal_braces_in_a_reward_template_still_work(tmp_path) -> None:
    template = '{{"q": "{prompt}", "a": "{response}"}}'
    text = edit(VALID, "reward:\n", f"reward:\n  template: {json.dumps(template)}\n")
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.reward.template.format(prompt="p", response="r") == '{"q": "p", "a": "r"}'


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{% for m in messages %}{{ m.content }", "Jinja syntax error on line 1"),
        ("{{ messages[3].content }}", "does not render a user turn"),
        ("{% for m in messages %}{{ m.role }}{% endfor %}", "without its content"),
    ],
)
def test_a_broken_chat_template_file_is_one_line_at_validate(tmp_path, content, says) -> None:
    (tmp_path / "t.jinja").write_text(content, encoding="utf-8")
    text = edit(VALID, "model:\n", "model:\n  chat_template: t.jinja\n")
    (problem,) = problems_of(write(tmp_path, text))
    assert "model.chat_template" in problem and "t.jinja" in problem and says in problem


@pytest.mark.parametrize(
    ("data", "says"), [(b"\n  \n", "holds no prompt"), (b"\xff\xfe\x00bad", "not UTF-8 text")]
)
def test_an_unusable_audit_prompts_file_is_one_line_at_validate(tmp_path, data, says) -> None:
    (tmp_path / "p.txt").write_bytes(data)
    text = VALID + "audit:\n  prompts_file: p.txt\n"
    (problem,) = problems_of(write(tmp_path, text))
    assert "audit.prompts_file" in problem and says in problem, problem


def test_a_set_value_in_yaml_flow_style_is_text_where_the_field_is_text(tmp_path) -> None:
    """`--set` reads values as YAML, but `{x}` or `[wip] ...` given to a text field is text."""
    path = write(tmp_path, VALID)
    recipe = load_recipe(path, ["push.commit_message=[wip] tune β"])
    assert recipe.push.commit_message == "[wip] tune β"
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["reward.template={question}"])
    (problem,) = info.value.problems
    assert "--set reward.template={question}" in problem and "unknown placeholder" in problem
    with pytest.raises(RecipeError, match="valid number"):  # numbers stay YAML
        load_recipe(path, ["ppo.learning_rate=[1]"])
