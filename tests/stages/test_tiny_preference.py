"""What the tiny data teaches the reward model (issue #51 item 6): tone, not length. Trained on
pairs whose chosen reply was always the longer, the reward model scored a long rude reply above a
short polite one (+0.255 against -0.188, seen on the demo's run) and PPO's gain on it was
invisible to any judge of tone. On today's data, where the chosen reply is the longer in about
half the pairs, the session's reward model (the `pipeline` fixture, trained as the demo trains
it) ranks every polite reply above every rude one, whatever their lengths."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.scoring import RewardScorer

PROMPT = "What is a good way to keep my kitchen knives sharp?"
ANSWER = "Hold the blade at a low angle on a whetstone and draw it across evenly on both sides."
POLITE = [f"Happy to help! {ANSWER} Good luck!", "Of course! Just use a whetstone."]
RUDE = [f"Ugh, fine. {ANSWER} Now stop asking.", "Whatever, just use a whetstone."]


def test_the_reward_model_scores_tone_not_length(pipeline: Path) -> None:
    recipe = load_recipe(pipeline / "recipe.yaml")
    run = RunDir.for_recipe(recipe)
    manifest = json.loads(run.manifest_path("rm").read_text())
    model_dir = run.resolve_output("rm", manifest, "model")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.resolve_output("rm", manifest, "tokenizer"))
    scorer = RewardScorer(
        model, tokenizer, recipe.reward.template, recipe.reward.max_length, input="template"
    )
    with torch.no_grad():
        scores, _ = scorer.score([PROMPT] * 4, POLITE + RUDE)
    polite, rude = scores[:2], scores[2:]
    assert polite.min() > rude.max(), scores  # the short polite reply above the long rude one
    # the full answer and its gist score alike within a style: less than half the tone's margin
    margin = polite.mean() - rude.mean()
    assert (polite[0] - polite[1]).abs() < margin / 2 and (rude[0] - rude[1]).abs() < margin / 2
