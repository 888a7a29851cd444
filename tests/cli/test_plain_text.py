"""What the CLI prints is printed as it is: rich turns `:name:` into an emoji unless told not to,
so a path and line number such as `recipe.yaml:100:` came out as `recipe.yaml💯`."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from rlhf_cli.cli import app


def test_an_error_line_keeps_a_path_and_line_that_reads_like_an_emoji(tmp_path: Path) -> None:
    recipe = tmp_path / ":thumbs_up:" / "recipe.yaml"
    recipe.parent.mkdir()
    recipe.write_text("run:\n  name: a\n" + "\n" * 97 + "run:\n  name: b\n")
    result = CliRunner().invoke(app, ["validate", "--recipe", str(recipe)])
    assert result.exit_code == 2
    assert f"{recipe}:100: `run` is given twice (lines 1 and 100)" in result.stderr
    assert "\N{HUNDRED POINTS SYMBOL}" not in result.stderr
    assert "\N{THUMBS UP SIGN}" not in result.stderr
