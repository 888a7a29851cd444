"""PPO's "same data" warning compares its prompts with the reward model's training prompts as
both were read: on f41b8ed a PPO prompt whose turn `data.prompts.max_chars` had cut was compared,
cut, with the reward model's uncut prompt, and the overlap went uncounted."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rich.console import Console

from rlhf_cli.ppo.models import PpoSources
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir, atomic_write_json

LONG = "How should I store fresh basil so that it keeps for a week? " * 3  # 180 characters


def test_a_prompt_cut_at_max_chars_still_counts_as_seen_by_the_reward_model(make_recipe, tmp_path):
    from rlhf_cli.stages.ppo import prompt_inputs

    prompts = tmp_path / "prompts.jsonl"
    rows = [LONG.strip(), "A fresh prompt that the reward model never saw in training."]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    recipe = load_recipe(
        make_recipe({"data": {"prompts": {"path": str(prompts), "max_chars": 100}}})
    )
    run = RunDir.for_recipe(recipe)
    run.stage_dir("rm").mkdir(parents=True)
    atomic_write_json(run.stage_dir("rm") / "train_prompts.json", [LONG.strip()])
    atomic_write_json(
        run.manifest_path("rm"),
        {"status": "completed", "outputs": {"train_prompts": "train_prompts.json"}},
    )
    warnings: list[str] = []
    record = SimpleNamespace(manifest={}, warn=warnings.append)
    sources = PpoSources("builtin:tiny-lm", None, "builtin:tiny-lm", None, None)
    prompt_inputs(recipe, run, sources, record, Console(quiet=True))
    assert [w for w in warnings if "reward model's training pairs" in w] == [
        "1 of 2 PPO prompts were in the reward model's training pairs: it overestimates scores "
        "there; use separate prompts (ppo.allow_prompt_overlap: true silences this)"
    ]
