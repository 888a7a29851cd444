"""`rlhf validate --data` on a sliced split read through `datasets` (as a hub dataset is): it
reads the rows training reads, and the first `--sample` of them, where it used to stream and
meet `datasets`' refusal to stream a sliced split, exit 2 (#50 item 3)."""

import json
from pathlib import Path

from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.data import load_prompts, prompt_text
from rlhf_cli.recipe import load_recipe

TINY_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "tiny" / "prompts.jsonl"


def test_validate_data_reads_a_sliced_split_as_training_does(make_recipe, tmp_path: Path) -> None:
    folder = tmp_path / "prompts"  # a dataset folder: `datasets` reads it, not our file readers
    folder.mkdir()
    lines = TINY_PROMPTS.read_text(encoding="utf-8").splitlines()[:60]
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    recipe = make_recipe({"data": {"prompts": {"path": str(folder), "split": "train[10:40]"}}})
    args = ["validate", "--data", "--json", "--recipe", str(recipe)]
    result = CliRunner().invoke(app, [*args, "--sample", "5", "--row", "1"])
    assert result.exit_code == 0, result.output
    prompts = json.loads(result.stdout)["stages"]["prompts"]
    assert (prompts["rows_read"], prompts["sampled"]) == (5, True)
    training = load_prompts(load_recipe(recipe).data.prompts).items  # what `rlhf ppo` reads
    assert len(training) == 30 and prompt_text(training[0]) == json.loads(lines[10])["prompt"]
    assert prompt_text(training[0]) in prompts["row"]["generates_from"]
    whole = CliRunner().invoke(app, args)
    assert whole.exit_code == 0, whole.output
    assert json.loads(whole.stdout)["stages"]["prompts"]["rows_read"] == 30
