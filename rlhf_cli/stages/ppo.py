"""Stage 3 of 4 (the guide's stage 4): PPO alignment. Our own, on torch + transformers + peft +
accelerate (TRL 1.x has no PPO trainer).

Four models: the policy (the SFT model with a fresh LoRA adapter), the value head on its backbone
(or a separate critic), the frozen reward model, and the frozen reference (the policy with its
PPO adapter off: no second copy of the weights). Dropout is off in all of them: PPO's ratio
compares log-probs of the same tokens at two times, and dropout noise would bias it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from safetensors.torch import save_file

from rlhf_cli.data import (
    audit_prompts,
    hold_out,
    load_prompts,
    matched_keywords,
    prompt_text,
    reward_keywords,
)
from rlhf_cli.errors import DataError
from rlhf_cli.generation import Generator, require_engine, tokenize_prompts
from rlhf_cli.modeling import (
    Reference,
    check_devices,
    load_policy_tokenizer,
    mixed_precision,
    pick_device,
    resolve_dtype,
    save_trained,
)
from rlhf_cli.ppo import core
from rlhf_cli.ppo.checkpoint import TrainState, checkpoint_state, load_checkpoint
from rlhf_cli.ppo.distributed import lost_process_as_error, main_decides
from rlhf_cli.ppo.health import HealthMonitor
from rlhf_cli.ppo.logs import RunLogs, summarize
from rlhf_cli.ppo.loop import train
from rlhf_cli.ppo.models import PolicyAndValue, PpoSources, build_actor
from rlhf_cli.ppo.run import Hooks, Models, PPORun
from rlhf_cli.ppo.sharding import build_accelerator, engine_for
from rlhf_cli.recipe import PpoSection, Recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.resume import (
    BEST_CHECKPOINT,
    PPO_CHECKPOINT,
    check_same_inputs,
    ppo_checkpoint_problem,
    resume_point,
    undone_by,
)
from rlhf_cli.rewards import lacking_columns
from rlhf_cli.rundir import InputRecord, Manifest, RunDir
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.stages.common import seed_everything, start_or_resume
from rlhf_cli.stages.data_figures import prompt_figures
from rlhf_cli.stages.trained import (
    frozen_scorer,
    generation_engine,
    load_judge,
    policy_source,
    reward_source,
)
from rlhf_cli.tracking import (
    Trackers,
    finish_trackers,
    read_metrics,
    tracker_config,
)


def run_ppo(recipe: Recipe, console: Console, resume: bool = False) -> Manifest:
    """Align the policy with PPO; write `runs/<name>/ppo/`; return its manifest."""
    run = RunDir.for_recipe(recipe)
    device = pick_device(recipe.run.device)
    check_devices(recipe, "ppo")
    require_engine(recipe.ppo.generation)
    if device.type == "cuda":
        warn_over_plan(recipe, console)
    trackers = Trackers.for_stage(recipe.run, "ppo", run.stage_dir("ppo"))
    # Trained weights stay fp32; a half-precision recipe computes under autocast (CUDA only).
    accelerator = build_accelerator(
        recipe,
        cpu=device.type == "cpu",
        mixed_precision=mixed_precision(resolve_dtype(recipe.model.dtype, device), device),
        log_with=trackers.for_accelerate(),
    )
    inputs: dict[str, InputRecord] = {}
    sources = PpoSources(*policy_source(recipe, run, inputs), *reward_source(recipe, run, inputs))
    seed_everything(recipe.run.seed)  # the same fresh LoRA weights on every process
    # found before the manifest is touched: a refused --resume leaves the last result's intact
    checkpoints = run.stage_dir("ppo") / "checkpoints"
    checkpoint = (
        resume_point(checkpoints, PPO_CHECKPOINT, ppo_checkpoint_problem, "rlhf ppo")
        if resume
        else None
    )
    if checkpoint is not None:
        check_same_inputs(
            checkpoint_state(checkpoint[0]),
            inputs,
            ("sft", "rm"),
            f"the checkpoint {checkpoint[0].name}",
            "its weights were trained on the earlier one; `rlhf ppo` without --resume starts "
            "over on this one",
        )
    with (
        StageRecord(run, "ppo", recipe, inputs=inputs, write=accelerator.is_main_process) as record,
        lost_process_as_error(accelerator, checkpoints),  # a machine gone: one line, resumable
    ):
        ppo, start = setup(recipe, run, sources, accelerator, record, console, checkpoint)
        try:
            summary = train(ppo, start)
        finally:
            ppo.logs.close()
            finish_trackers(accelerator)
            record.manifest["metrics"] = {
                **summarize(ppo.logs.history),
                "kl_coef_now": ppo.state.kl_ctl.value,
            }
            record.manifest["best"] = ppo.best  # `rlhf merge --checkpoint best`
            record.manifest["rollbacks"] = ppo.rollbacks
            record.save()
        models = ppo.models
        with models.engine.gathered(models.actor) as actor:  # the final weights, whole, once
            if accelerator.is_main_process:
                save(ppo, actor, sources, record, summary)
    return record.manifest


PLAN_MARGIN = 1.1  # the estimate is rough: warn only when it is clearly over


def warn_over_plan(recipe: Recipe, console: Console) -> None:
    """Before anything loads: a warning (never a refusal) when the plan's PPO peak exceeds
    the GPU's free memory by more than PLAN_MARGIN, with what `rlhf plan` would change."""
    import torch

    from rlhf_cli.plan import planned_stage_peak

    free, _ = torch.cuda.mem_get_info()
    planned = planned_stage_peak(recipe, "ppo")
    if planned is not None and planned > PLAN_MARGIN * free:
        console.print(
            f"[yellow]warning:[/] the plan estimates {planned / 2**30:.1f} GiB for PPO, over "
            f"the {free / 2**30:.1f} GiB free: `rlhf plan --memory {free // 2**20}MiB` "
            "lists --set changes that fit"
        )


def setup(
    recipe: Recipe,
    run: RunDir,
    sources: PpoSources,
    accelerator: Any,
    record: StageRecord,
    console: Console,
    checkpoint: tuple[Path, list[str]] | None,
) -> tuple[PPORun, int]:
    """Everything the loop needs, and the iteration to start after (0, or the checkpoint's)."""
    cfg, device, stage_dir = recipe.ppo, accelerator.device, run.stage_dir("ppo")
    # 1. Tokenizer, prompts, and the guide's "common mistakes" caught before training.
    tokenizer, train, heldout = prompt_inputs(recipe, run, sources, record, console)

    # 2. Models: frozen reward model, actor (policy + value), reference; the rollout engine.
    engine = engine_for(accelerator)
    with engine.loading():
        scorer = frozen_scorer(recipe.reward, sources.reward, sources.reward_tokenizer, device)
        judge = load_judge(recipe, run, device, needed_by="rlhf ppo") if heldout[0] else None
        actor, reference = build_actor(recipe, sources, device, scorer, tokenizer)
    generator = generation_engine(cfg.generation, actor.policy, tokenizer, recipe, stage_dir)

    # 3. The engine wraps (or shards) the actor and builds its optimizer; the rest of the
    # training state; then the fresh start or the resume, with the logs.
    prepared_actor, optimizer = engine.prepare(actor, optimizer_factory(cfg))
    state = fresh_state(recipe, optimizer)
    # models are built alike everywhere (FSDP2 shards each process's copy); now per process
    seed_everything(recipe.run.seed + accelerator.process_index)
    health = HealthMonitor()

    def restore(folder: Path) -> int:
        saved = load_checkpoint(folder, engine, prepared_actor, state)
        health.seen.update(saved.get("health_seen") or [])
        console.print(f"resuming from {folder.name} (iteration {saved['iteration']})")
        return int(saved["iteration"])

    logs = ("metrics.jsonl", "samples.jsonl")
    start, (metrics, samples) = start_or_resume(record, checkpoint, console, restore, logs)
    accelerator.wait_for_everyone()  # every process reads the log as it was cut back

    # 4. The trackers, and what the loop holds.
    accelerator.init_trackers(recipe.run.project, tracker_config(recipe.model_dump(mode="json")))
    ppo = PPORun(
        recipe=recipe,
        accelerator=accelerator,
        models=Models(engine, prepared_actor, reference, scorer, generator, tokenizer),
        state=state,
        hooks=Hooks(
            audit=_live_audit(recipe, tokenizer, reference, scorer, generator, train, heldout),
            evaluate=_live_eval(recipe, heldout, reference, (scorer, judge), generator),
        ),
        logs=RunLogs(
            writer=metrics,
            samples=samples,
            console=console,
            warn=record.warn,
            log_every=cfg.log_every,
            health=health,
            history=read_metrics(stage_dir / "metrics.jsonl", through=start),
        ),
        prompts=train[0],
        queries=train[1],
        columns=train[2],
        stage_dir=stage_dir,
        inputs=record.manifest["inputs"],
        **main_decides(accelerator, lambda: watch_from(checkpoint[0] if start else None)),
    )
    return ppo, start


def watch_from(folder: Path | None) -> dict[str, Any]:
    """What a resume takes over from checkpoint `folder` besides the training state: the
    rollbacks made so far (`audit.max_rollbacks` counts across it) and the best evaluated
    checkpoint when it is not newer than `folder` and no rollback undid it (a damaged best.json
    is dropped: the next evaluation names a best again). The main process's reading is every
    process's."""
    if folder is None:
        return {}
    saved = checkpoint_state(folder)
    watch: dict[str, Any] = {"rollbacks": saved.get("rollbacks") or []}
    try:
        best = json.loads((folder.parent / BEST_CHECKPOINT).read_text())
        named = folder.parent / best["checkpoint"]
        if best["iteration"] <= saved["iteration"] and undone_by(named) is None:
            watch["best"] = best
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none kept, or not readable
    return watch


# texts, their token ids, and each one's extra columns (the reward functions' keywords)
Prompts = tuple[list[str], list[list[int]], list[dict[str, Any]]]


def prompt_inputs(
    recipe: Recipe, run: RunDir, sources: PpoSources, record: StageRecord, console: Console
) -> tuple[Any, Prompts, Prompts]:
    """The policy tokenizer, the PPO training prompts and the held-out ones
    (`data.prompts.eval_fraction`), each with their token ids and extra columns; the guide's
    "common mistakes" about them are warned about (console and manifest). A reward function
    that needs a column the prompts lack is refused here, before any model loads."""
    tokenizer = load_policy_tokenizer(recipe.model, sources.tokenizer, "left")
    source = recipe.data.prompts
    data = load_prompts(source, cache_dir=run.path / ".cache")
    problem = lacking_columns(recipe, data.columns)
    if problem is not None:
        raise DataError(problem)
    chat = recipe.model.prompt_format == "chat"
    rows = replace(data, items=list(zip(data.items, data.columns, strict=True)))
    train_rows, heldout_rows = hold_out(rows, source.eval_fraction)
    train, heldout = [p for p, _ in train_rows], [p for p, _ in heldout_rows]
    # the prompts' texts before max_chars cut them, as the reward model's data holds them
    for warning in [*startup_warnings(recipe, run, data.texts), *data.warnings]:
        record.warn(warning)
        console.print(f"[yellow]warning[/]: {escape(warning)}", highlight=False)
    record.manifest["prompts"] = {"train": len(train), "heldout": len(heldout)}
    limits = (source.max_tokens, recipe.ppo.generation.max_new_tokens)
    figures = prompt_figures(data, tokenizer, chat, limits, source.eval_fraction)
    record.manifest["data"] = {"prompts": figures}
    return (
        tokenizer,
        (
            [prompt_text(p) for p in train],
            tokenize_prompts(tokenizer, train, chat, source.max_tokens),
            [c for _, c in train_rows],
        ),
        (
            [prompt_text(p) for p in heldout],
            tokenize_prompts(tokenizer, heldout, chat, source.max_tokens),
            [c for _, c in heldout_rows],
        ),
    )


def save(
    ppo: PPORun,
    actor: PolicyAndValue,
    sources: PpoSources,
    record: StageRecord,
    summary: dict[str, Any],
) -> None:
    """Final artifacts on the main process, from the whole `actor`: adapter (or model), value
    head, tokenizer."""
    stage_dir = ppo.stage_dir
    kind = "adapter" if ppo.recipe.model.lora.enabled else "model"
    # the weights as the module holds them now (whole; state_dict() would give FSDP2's shards)
    save_trained(actor.policy, stage_dir / kind)
    ppo.models.tokenizer.save_pretrained(stage_dir / "tokenizer")
    outputs = {kind: kind, "tokenizer": "tokenizer"}
    if actor.has_values:
        save_file(actor.value_state_dict(), stage_dir / "value_head.safetensors")
        outputs["value_head"] = "value_head.safetensors"
    record.manifest["outputs"] = {
        **outputs,
        "metrics": "metrics.jsonl",
        "samples": "samples.jsonl",
        "checkpoints": "checkpoints",
    }
    record.manifest["base_model"] = sources.base
    record.manifest["reward_model"] = sources.reward
    record.manifest["metrics"] = {**summary, "kl_coef_now": ppo.state.kl_ctl.value}


def optimizer_factory(cfg: PpoSection) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """AdamW over a module's trainable weights, eps and weight decay from the recipe (the engine
    calls it once the weights are wrapped or sharded)."""

    def make(actor: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in actor.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=cfg.learning_rate, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )

    return make


def fresh_state(recipe: Recipe, optimizer: Any) -> TrainState:
    """The training state at iteration 0: `optimizer` on a constant schedule, the KL controller
    (adaptive or fixed β), the seeded prompt sampler, and `ppo.score_norm`'s running moments."""
    from transformers import get_constant_schedule

    cfg = recipe.ppo
    kl_ctl = (
        core.AdaptiveKLController(cfg.init_kl_coef, cfg.target_kl, cfg.horizon)
        if cfg.adaptive_kl
        else core.FixedKLController(cfg.init_kl_coef)
    )
    return TrainState(
        optimizer,
        get_constant_schedule(optimizer),
        kl_ctl,
        sampler=torch.Generator().manual_seed(recipe.run.seed),
        score_moments=core.RunningMoments() if cfg.score_norm else None,
    )


def startup_warnings(recipe: Recipe, run: RunDir, prompts: list[str]) -> list[str]:
    """The guide's "common mistakes" that do not stop a run: too many PPO epochs, PPO prompts
    the reward model was trained on."""
    cfg, warnings = recipe.ppo, []
    if cfg.ppo_epochs > 4:
        warnings.append(
            f"ppo.ppo_epochs is {cfg.ppo_epochs}: beyond 4 the rollout goes "
            "off-policy (the guide keeps K <= 4; K = 2 is safer)"
        )
    overlap = 0 if cfg.allow_prompt_overlap else prompt_overlap(run, prompts)
    if overlap:
        warnings.append(
            f"{overlap} of {len(prompts)} PPO prompts were in the reward model's "
            "training pairs: it overestimates scores there; use separate prompts "
            "(ppo.allow_prompt_overlap: true silences this)"
        )
    return warnings


def _live_audit(
    recipe: Recipe,
    tokenizer: Any,
    reference: Reference,
    scorer: RewardScorer,
    generator: Generator,
    *data: Prompts,
) -> Callable[[PolicyAndValue, int], dict[str, Any]]:
    """`audit.every`: the same audit as `rlhf audit`, on the live policy (given whole), sampled
    by the rollout engine (the next rollout syncs it back to the policy). The frozen reference's
    answers are sampled at the first audit and kept (the same seeds give the same answers). An
    audit prompt that is a prompt of `data` (texts, ..., columns) carries that row's columns
    to the reward functions; any other has None in each."""
    from rlhf_cli.audit.measure import audit_policy

    chat = recipe.model.prompt_format == "chat"
    prompts = audit_prompts(recipe.audit)
    texts = [text for part in data for text in part[0]]
    keywords = matched_keywords(prompts, texts, [row for part in data for row in part[-1]])
    kept: list[str] = []

    def audit(actor: PolicyAndValue, iteration: int) -> dict[str, Any]:
        report = audit_policy(
            actor.policy,
            tokenizer,
            prompts,
            recipe.audit,
            chat=chat,
            max_tokens=recipe.data.prompts.max_tokens,
            reference=reference,
            scorer=scorer,
            generator=generator,
            seed=recipe.run.seed,
            reference_responses=kept or None,
            keywords=keywords,
            step=iteration,
        )
        kept[:] = [sample["reference"] for sample in report["samples"]]
        return report

    return audit


def _live_eval(
    recipe: Recipe,
    heldout: Prompts,
    reference: Reference,
    scorers: tuple[RewardScorer, RewardScorer | None],
    generator: Any,
) -> Callable[[PolicyAndValue, int], dict[str, float]] | None:
    """The held-out evaluation on the live policy (given whole), sampled by the rollout engine
    with the audit's generation settings, scored by the reward and the judge (`audit.judge`,
    when set: `scorers`); the reference's scores are computed once."""
    from rlhf_cli.audit.measure import ReferenceScores, heldout_eval

    prompts, queries, columns = heldout
    if not prompts:
        return None
    scorer, judge = scorers
    kept: dict[str, ReferenceScores] = {}

    def evaluate(actor: PolicyAndValue, iteration: int) -> dict[str, float]:
        metrics, kept["reference"] = heldout_eval(
            actor.policy,
            prompts,
            queries,
            recipe.audit.generation,
            seed=recipe.run.seed,
            reference=reference,
            scorer=scorer,
            generator=generator,
            judge=judge,
            reference_scores=kept.get("reference"),
            keywords=reward_keywords(columns),
            step=iteration,
            samples_per_prompt=recipe.ppo.eval_samples_per_prompt,
            pass_threshold=recipe.ppo.pass_threshold,
        )
        return metrics

    return evaluate


def prompt_overlap(run: RunDir, prompts: list[str]) -> int:
    """PPO prompts the reward model was trained on (the guide's "same data" mistake)."""
    source = run.owner("rm")
    manifest = source.read_manifest("rm")
    if not manifest or "train_prompts" not in manifest.get("outputs", {}):
        return 0
    seen = set(json.loads(source.resolve_output("rm", manifest, "train_prompts").read_text()))
    return sum(p in seen for p in prompts)
