"""`rlhf compare`: the guide's quick inference test, SFT and PPO answers side by side (or the
offline method's, `dpo` and the others, in a run trained by one)."""

from __future__ import annotations

from typing import Any

from rlhf_cli.data import audit_prompts
from rlhf_cli.errors import StageError
from rlhf_cli.generation import require_engine, row_seed, tokenize_prompts
from rlhf_cli.modeling import pick_device
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import policy_stage
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages.common import seed_everything
from rlhf_cli.stages.trained import (
    generation_engine,
    load_policy,
    load_scorer,
    locate_policy,
)


def run_compare(recipe: Recipe, prompts: list[str] | None = None) -> list[dict[str, Any]]:
    """For each prompt: the SFT (reference) answer, the trained policy's answer (keyed by its
    stage, `policy_stage`: `ppo`, `dpo`, ...), and their reward scores. Seeded from
    `run.seed`, like the audit: the same call twice gives the same answers, and both policies
    answer a prompt from the same seed."""
    run = RunDir.for_recipe(recipe)
    stage = policy_stage(run)
    where = locate_policy(recipe, run, needed_by="rlhf compare", stage=stage)
    device = pick_device(recipe.run.device)
    seed_everything(recipe.run.seed)
    gen = recipe.audit.generation
    require_engine(gen, "audit.generation")
    policy = load_policy(where, recipe.model, device)
    if policy.reference is None:
        raise StageError("compare needs the SFT model of the run as reference")
    scorer = load_scorer(recipe, run, device, needed_by="rlhf compare")
    prompts = prompts or audit_prompts(recipe.audit)
    queries = tokenize_prompts(
        policy.tokenizer,
        prompts,
        recipe.model.prompt_format == "chat",
        recipe.data.prompts.max_tokens,
    )
    generator = generation_engine(gen, policy.model, policy.tokenizer, recipe, run.path)
    seeds = [row_seed(recipe.run.seed, 0, row) for row in range(len(queries))]
    trained = generator.sync(policy.model)
    answers = {stage: generator.generate(queries, gen, seeds, trained).texts}
    with policy.reference.model() as ref:
        sft = generator.sync(ref)
        answers["sft"] = generator.generate(queries, gen, seeds, sft).texts
    rows = [
        {"prompt": p, "sft": s, stage: q}
        for p, s, q in zip(prompts, answers["sft"], answers[stage], strict=True)
    ]
    if scorer is not None:
        for name in ("sft", stage):
            scores, _ = scorer.score(prompts, answers[name])
            for row, score in zip(rows, scores.tolist(), strict=True):
                row[f"{name}_score"] = score
    return rows
