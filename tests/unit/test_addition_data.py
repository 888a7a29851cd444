"""data/addition/ (issue #53's offline task with checkable answers) is what
scripts/make_addition_data.py writes: every sum right, the 180 additions split between the
training prompts and the checks with none in both, and the recipe holding 40 or more prompts out
of training for the held-out evaluation."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlhf_cli.data import split_heldout
from rlhf_cli.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "addition"
FILES = ("prompts.jsonl", "checks.jsonl", "README.md")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def operands(prompt: str) -> tuple[int, int]:
    assert prompt.startswith("What is ") and prompt.endswith("?"), prompt
    a, b = prompt[len("What is ") : -1].split(" + ")
    return int(a), int(b)


def test_the_shipped_files_are_what_the_script_writes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_addition_data", ROOT / "scripts" / "make_addition_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_every_sum_is_right_and_every_addition_is_in_one_file() -> None:
    prompts, checks = rows(DATA / "prompts.jsonl"), rows(DATA / "checks.jsonl")
    assert (len(prompts), len(checks)) == (150, 30)
    for row in prompts + checks:
        assert set(row) == {"prompt", "solution"}
        a, b = operands(row["prompt"])
        assert row["solution"] == str(a + b), row
    pairs = [operands(r["prompt"]) for r in prompts + checks]
    assert sorted(pairs) == [(a, b) for a in range(1, 21) for b in range(1, 10)]  # each once


def test_the_checks_are_the_eval_checks_additions_and_never_trained_on() -> None:
    shipped = [r for r in rows(ROOT / "data" / "eval" / "checks.jsonl") if "solution" in r]
    assert rows(DATA / "checks.jsonl") == shipped
    trained = {r["prompt"] for r in rows(DATA / "prompts.jsonl")}
    assert trained.isdisjoint(r["prompt"] for r in shipped)


def test_the_recipe_holds_out_45_prompts() -> None:
    recipe = load_recipe(ROOT / "recipes" / "smollm2-addition.yaml")
    assert Path(recipe.data.prompts.path) == DATA / "prompts.jsonl"
    train, heldout = split_heldout(rows(DATA / "prompts.jsonl"), recipe.data.prompts.eval_fraction)
    assert (len(train), len(heldout)) == (105, 45)
