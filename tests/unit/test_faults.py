"""Bad input and concurrent use survived: recipe fuzzing, the run lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_cli.errors import RecipeError, StageError
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.rundir import RunDir, StageRecord

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _parse(text: str) -> None:
    try:
        result = parse_recipe(text, "fuzz.yaml", base_dir=REPO / "recipes")
    except RecipeError as err:
        assert err.problems and all(line.startswith("fuzz.yaml") for line in err.problems)
        assert all("\n" not in line for line in err.problems)
    else:
        assert isinstance(result, Recipe)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(documents.map(yaml.safe_dump), st.text(max_size=200)))
def test_arbitrary_documents_give_a_recipe_or_one_line_errors(text):
    _parse(text)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))


PATHS = list(_paths(TINY))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(PATHS), st.one_of(scalars, st.just("__delete__"))),
                min_size=1, max_size=4))
def test_mutated_tiny_recipe_gives_a_recipe_or_one_line_errors(mutations):
    data = yaml.safe_load(yaml.safe_dump(TINY))
    for path, value in mutations:
        node = data
        for key in path[:-1]:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            if isinstance(node, dict):
                if value == "__delete__":
                    node.pop(path[-1], None)
                else:
                    node[path[-1]] = value
    _parse(yaml.safe_dump(data))


def _recipe(tmp_path: Path) -> Recipe:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


def test_a_live_lock_holder_is_named(tmp_path):
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run.path.mkdir(parents=True)
        (run.path / ".lock").write_text(f'{{"pid": {holder.pid}, "command": "rlhf ppo"}}')
        with pytest.raises(StageError, match=f"busy: pid {holder.pid} \\(rlhf ppo"):
            with StageRecord(run, "sft", recipe, inputs={}):
                pass
        assert run.read_manifest("sft") is None  # nothing written by the refused command
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_and_released(tmp_path):
    recipe = _recipe(tmp_path)
    run = RunDir.for_recipe(recipe)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.path.mkdir(parents=True)
    (run.path / ".lock").write_text(f'{{"pid": {dead.pid}, "command": "rlhf sft"}}')
    with StageRecord(run, "sft", recipe, inputs={}):
        assert f'"pid": {__import__("os").getpid()}' in (run.path / ".lock").read_text()
    assert not (run.path / ".lock").exists()
    assert run.read_manifest("sft")["status"] == "completed"


def test_cli_busy_run_exits_2_naming_the_holder(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rlhf_cli.cli import app

    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    for key in ("sft", "preferences", "prompts"):
        data["data"][key]["path"] = str(REPO / "data" / "tiny" / Path(
            data["data"][key]["path"]).name)
    data["audit"]["prompts_file"] = str(REPO / "data" / "tiny" / "audit_prompts.txt")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(data))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "runs" / "tiny" / ".lock"
        lock.parent.mkdir(parents=True)
        lock.write_text(f'{{"pid": {holder.pid}, "command": "rlhf train-rm"}}')
        result = CliRunner().invoke(app, ["sft", "--recipe", str(recipe)])
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 2
    assert f"busy: pid {holder.pid}" in result.output
    assert "Traceback" not in result.output


def _fake_model(context: int, vocab: int = 100):
    from types import SimpleNamespace

    import torch

    embeddings = torch.nn.Embedding(vocab, 2)
    return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context),
                           get_input_embeddings=lambda: embeddings)


def test_mismatches_are_caught_before_training(tmp_path):
    from rlhf_cli.errors import DataError
    from rlhf_cli.stages.ppo import check_fit

    recipe = _recipe(tmp_path)  # prompts 64 tokens + 32 new, reward max_length 128
    tokenizer = list(range(100))
    check_fit(recipe, _fake_model(96), _fake_model(128), tokenizer)  # fits exactly
    with pytest.raises(DataError, match=r"= 96 exceeds the policy's context of 95"):
        check_fit(recipe, _fake_model(95), _fake_model(128), tokenizer)
    with pytest.raises(DataError, match=r"reward.max_length \(128\) exceeds .* 127"):
        check_fit(recipe, _fake_model(96), _fake_model(127), tokenizer)
    with pytest.raises(DataError, match="101 tokens but the reward model only 100"):
        check_fit(recipe, _fake_model(96), _fake_model(128), list(range(101)))


def test_prompt_overlap_with_reward_training_is_counted(tmp_path):
    import json

    from rlhf_cli.rundir import atomic_write_json
    from rlhf_cli.stages.ppo import prompt_overlap

    run = RunDir.for_recipe(_recipe(tmp_path))
    (run.stage_dir("rm")).mkdir(parents=True)
    atomic_write_json(run.stage_dir("rm") / "train_prompts.json", ["seen one", "seen two"])
    atomic_write_json(run.manifest_path("rm"), {"status": "completed", "outputs": {
        "train_prompts": "train_prompts.json"}})
    assert prompt_overlap(run, ["seen one", "fresh", "seen two", "seen one"]) == 3
    assert json.loads(run.manifest_path("rm").read_text())["status"] == "completed"


def test_reward_truncation_is_counted_not_silent():
    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.scoring import RewardScorer

    tokenizer = load_tokenizer("builtin:minilm", padding_side="right")
    scorer = RewardScorer(model=None, tokenizer=tokenizer, template="{prompt} {response}",
                          max_length=16)
    ids, n_truncated = scorer.encode(scorer.texts(["short", "long " * 40], ["ok", "ok"]))
    assert n_truncated == 1
    assert max(len(x) for x in ids) == 16
