"""A key given twice in a recipe, at any depth or in a `--set` value, is one line naming the key
and both lines (exit 2): YAML would keep the last and drop the first unseen (#50 item 12)."""

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlhf_cli.cli import app


def validate(recipe: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["validate", "--recipe", str(recipe), *args])


def test_a_second_run_section_is_one_line_naming_both(make_recipe) -> None:
    recipe = make_recipe()
    text = recipe.read_text(encoding="utf-8")
    assert text.startswith("run:\n")
    line = text.count("\n") + 1
    recipe.write_text(text + "run:\n  name: second\n", encoding="utf-8")
    result = validate(recipe)
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {recipe}:{line}: `run` is given twice (lines 1 and {line}); YAML keeps only "
        "the last\n"
    )


def test_a_key_given_twice_deep_in_a_section_names_its_lines(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "run:\n  name: twice\nppo:\n  generation:\n    max_new_tokens: 16\n"
        "    temperature: 0.7\n    max_new_tokens: 32\n",
        encoding="utf-8",
    )
    result = validate(recipe)
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {recipe}:7: `max_new_tokens` is given twice (lines 5 and 7); YAML keeps only "
        "the last\n"
    )


@pytest.mark.parametrize(
    "text",
    [
        "run: {name: a, name: b}\n",  # flow style, one line
        "base: &b {seed: 1}\nrun:\n  <<: *b\n  seed: 2\n  seed: 3\n",  # after a merge
    ],
)
def test_flow_style_and_merged_mappings(tmp_path: Path, text: str) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text, encoding="utf-8")
    result = validate(recipe)
    assert result.exit_code == 2 and "is given twice" in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_merge_may_override_the_keys_it_brings(tmp_path: Path) -> None:
    """`<<` is YAML's way to override: the key it brings and the one given beside it are not
    a key given twice (the recipe then fails on `base`, an unknown section, not on `seed`)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("base: &b {seed: 1}\nrun:\n  <<: *b\n  seed: 2\n", encoding="utf-8")
    result = validate(recipe)
    assert result.exit_code == 2 and "given twice" not in result.stderr
    assert "base" in result.stderr


def test_a_set_value_giving_a_key_twice(make_recipe) -> None:
    arg = "data.sft.columns={prompt: question, prompt: query}"
    result = validate(make_recipe(), "--set", arg)
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --set {arg}: `prompt` is given twice (lines 1 and 1); YAML keeps only the last\n"
    )
