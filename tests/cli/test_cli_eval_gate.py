"""`rlhf validate` refuses a gate threshold whose suite the recipe does not run: one line naming
the field and its line, exit 2, before anything loads (the rule itself is in
tests/unit/test_eval_gate.py)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from rlhf_cli.cli import app

TINY_DATA = Path(__file__).resolve().parents[2] / "data" / "tiny"
RECIPE = f"""\
run:
  name: t
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
eval:
  benchmarks:
    tasks: [tiny_arith]
  gate:
    min_win_rate: 0.55
"""


def test_a_gate_without_its_suite_fails_validate_naming_the_field(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE, encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", "--recipe", str(recipe)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: {recipe}:17: eval.gate: min_win_rate is set but eval.judge is not (set both)"
    ]
    fixed = ["--set", "eval.gate.min_win_rate=null"]
    assert CliRunner().invoke(app, ["validate", "--recipe", str(recipe), *fixed]).exit_code == 0
