"""`rlhf audit`: the guide's reward-hacking audit (Part 10) on a policy (PPO's, an offline
method's, a checkpoint or a folder) or on given responses;
with `audit.judge`, the judge's rewards beside the proxy's and their agreement.

Exit code 1 when hacking is detected, so the command gates a shell pipeline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.console import Console

from rlhf_cli.audit.detectors import audit_responses
from rlhf_cli.audit.measure import audit_policy
from rlhf_cli.data import audit_prompts, load_prompts, matched_keywords, prompt_text, read_responses
from rlhf_cli.generation import require_engine
from rlhf_cli.modeling import check_devices, pick_device
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import StageRecord, policy_stage
from rlhf_cli.resume import named_checkpoint
from rlhf_cli.rewards import lacking_columns
from rlhf_cli.rundir import RunDir, atomic_write_json
from rlhf_cli.stages.common import seed_everything
from rlhf_cli.stages.trained import (
    generation_engine,
    load_judge,
    load_policy,
    load_scorer,
    locate_policy,
)


def run_audit(
    recipe: Recipe,
    console: Console,
    checkpoint: Path | None = None,
    responses_file: Path | None = None,
    samples: int | None = None,
) -> dict[str, Any]:
    """Measure and save the audit report; return it, with `path` (the saved file) and `label`
    (what was audited)."""
    cfg = recipe.audit if samples is None else recipe.audit.model_copy(update={"samples": samples})
    run = RunDir.for_recipe(recipe)
    if responses_file is not None:
        prompts, responses = read_responses(responses_file)
        report = audit_responses(responses, cfg)
        report["samples"] = [
            {"prompt": p, "response": r} for p, r in zip(prompts, responses, strict=True)
        ]
        label = f"responses-{responses_file.stem}"  # never a policy audit's or a stage file's
        report["audited"] = str(responses_file)
    else:
        device = pick_device(recipe.run.device)
        check_devices(recipe, "audit")
        seed_everything(recipe.run.seed)  # the same audit twice samples the same responses
        require_engine(cfg.generation, "audit.generation")
        if checkpoint is not None and not checkpoint.exists():  # best, last, iter_N
            checkpoint = named_checkpoint(run.stage_dir("ppo"), str(checkpoint))
        stage = policy_stage(run)  # ppo, else an offline method's (dpo, ...)
        where = locate_policy(recipe, run, checkpoint, needed_by="rlhf audit", stage=stage)
        policy = load_policy(where, recipe.model, device)
        generator = generation_engine(
            cfg.generation, policy.model, policy.tokenizer, recipe, run.path
        )
        label = policy.label if checkpoint is not None else stage
        prompts = audit_prompts(cfg)
        with console.status(f"auditing {label}: sampling {cfg.samples} responses per prompt"):
            report = audit_policy(
                policy.model,
                policy.tokenizer,
                prompts,
                cfg,
                chat=recipe.model.prompt_format == "chat",
                max_tokens=recipe.data.prompts.max_tokens,
                reference=policy.reference,
                scorer=load_scorer(recipe, run, device, needed_by="rlhf audit"),
                generator=generator,
                seed=recipe.run.seed,
                judge=load_judge(recipe, run, device, needed_by="rlhf audit"),
                keywords=audit_keywords(recipe, run, prompts),
                step=audited_step(run, stage, checkpoint),
            )
        report["audited"] = str(checkpoint or run.stage_dir(stage))
    with StageRecord(run, "audit", recipe, inputs={}) as record:
        earlier = record.previous_manifest()  # read under the lock: no audit's entry is lost
        record.replacing()
        path = record.dir / f"{label}.json"
        atomic_write_json(path, report)
        numbers = {k: v for k, v in report.items() if isinstance(v, (int, float, bool))}
        record.manifest["outputs"] = {**earlier.get("outputs", {}), label: path.name}
        record.manifest["reports"] = {**earlier.get("reports", {}), label: numbers}
        record.manifest["last"] = label
        record.manifest["metrics"] = numbers
    return {**report, "path": str(path), "label": label}


def audit_keywords(recipe: Recipe, run: RunDir, prompts: list[str]) -> dict[str, list[Any]] | None:
    """The reward functions' columns for the audit prompts, as `rlhf ppo`'s audits give them
    (`matched_keywords`): the recipe's prompt data is read only when a reward or judge function
    requires a column (`builtin:math_accuracy`'s `solution`)."""
    source = recipe.data.prompts
    if source is None or lacking_columns(recipe, []) is None:
        return None
    data = load_prompts(source, cache_dir=run.path / ".cache")
    return matched_keywords(prompts, [prompt_text(p) for p in data.items], data.columns)


def audited_step(run: RunDir, stage: str, checkpoint: Path | None) -> int:
    """The reward functions' `step` in a standalone audit: the iteration the audited PPO policy
    was saved at (a checkpoint `iter_N`'s N, the final policy's last iteration); 0 for any other
    policy (an offline method's, an adapter folder)."""
    if checkpoint is not None:
        found = re.fullmatch(r"iter_(\d+)", checkpoint.name)
        return int(found.group(1)) if found else 0
    if stage != "ppo":
        return 0
    manifest = run.read_manifest(stage) or {}
    return int(manifest.get("metrics", {}).get("iterations", 0))
