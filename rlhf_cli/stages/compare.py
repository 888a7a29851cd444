"""`rlhf compare`: the guide's quick inference test, SFT and PPO answers side by side."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.errors import StageError
from rlhf_cli.modeling import pick_device
from rlhf_cli.ppo.rollout import decode, generate, stop_token_ids, tokenize_prompts
from rlhf_cli.recipe import Recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages.audit import audit_prompts
from rlhf_cli.stages.trained import load_scorer, load_trained_policy


def run_compare(recipe: Recipe, prompts: list[str] | None = None) -> list[dict[str, Any]]:
    """For each prompt: the SFT (reference) answer, the PPO answer, and their reward scores."""
    run = RunDir.for_recipe(recipe)
    device = pick_device(recipe.run.device)
    policy = load_trained_policy(recipe, run, device)
    if policy.reference is None:
        raise StageError("compare needs the SFT model of the run as reference")
    scorer = load_scorer(recipe, run, device)
    prompts = prompts or audit_prompts(recipe.audit)
    gen = recipe.audit.generation
    queries = tokenize_prompts(policy.tokenizer, prompts, recipe.model.prompt_format == "chat",
                               recipe.data.prompts.max_tokens)
    stops = stop_token_ids(policy.tokenizer, policy.model)
    answers = {}
    with torch.inference_mode():
        _, _, ids, mask, _ = generate(policy.model, policy.tokenizer, queries, gen, stops)
        answers["ppo"] = decode(policy.tokenizer, ids, mask)
        with policy.reference.model() as ref:
            _, _, ids, mask, _ = generate(ref, policy.tokenizer, queries, gen, stops)
        answers["sft"] = decode(policy.tokenizer, ids, mask)
    rows = [{"prompt": p, "sft": s, "ppo": q}
            for p, s, q in zip(prompts, answers["sft"], answers["ppo"], strict=True)]
    if scorer is not None:
        for name in ("sft", "ppo"):
            scores, _ = scorer.score(prompts, answers[name])
            for row, score in zip(rows, scores.tolist(), strict=True):
                row[f"{name}_score"] = score
    return rows
