"""What the PPO loop holds (`PPORun`: the recipe and a few typed parts) and what happens around
an iteration: checkpoints, the live audit (`audit.every`), the held-out evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.audit.detectors import GUIDE_FLAGS, overoptimized
from rlhf_cli.errors import CheckpointWriteError, HackingDetected, write_remedy
from rlhf_cli.generation import Generator
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo.checkpoint import TrainState, load_checkpoint, save_checkpoint
from rlhf_cli.ppo.distributed import answered_everywhere, main_decides
from rlhf_cli.ppo.experience import Drafts
from rlhf_cli.ppo.logs import RunLogs
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.sharding import Engine
from rlhf_cli.recipe import Recipe
from rlhf_cli.resume import (
    BEST_CHECKPOINT,
    PPO_CHECKPOINT,
    checkpoint_folders,
    mark_undone,
    ppo_checkpoint_name,
    undone_by,
)
from rlhf_cli.rundir import InputRecord, atomic_write_json
from rlhf_cli.scoring import RewardScorer


@dataclass
class Models:
    engine: Engine  # how the actor is spread over the processes
    actor: Any  # PolicyAndValue, as the engine wrapped it (DDP, DeepSpeed) or sharded it (FSDP2)
    reference: Reference
    scorer: RewardScorer
    generator: Generator
    tokenizer: Any  # the policy's


@dataclass
class Hooks:
    """The live audit (`audit.every`) and held-out evaluation, each on the whole actor."""

    audit: Callable[[PolicyAndValue, int], dict[str, Any]] | None  # (actor, iteration)
    evaluate: Callable[[PolicyAndValue, int], dict[str, float]] | None


@dataclass
class PPORun:
    """Everything the loop touches; built by stages/ppo.py."""

    recipe: Recipe
    accelerator: Any
    models: Models
    state: TrainState  # what a checkpoint saves besides the weights, with `logs.health`
    hooks: Hooks
    logs: RunLogs
    prompts: list[str]
    queries: list[list[int]]  # their token ids
    columns: list[dict[str, Any]]  # each prompt's extra columns, for the reward functions
    stage_dir: Path
    inputs: dict[str, InputRecord]  # the stages trained on (the manifest's)
    drafts: Drafts = field(default_factory=Drafts)  # rollouts asked for ahead (`async_steps`)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # `audit.on_hacking: rollback`
    best: dict[str, Any] | None = None  # the best evaluated iteration (`keep_best`)

    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.accelerator.unwrap_model(self.models.actor)


def checkpoint(run: PPORun, iteration: int) -> Path:
    """Every process writes its part (`checkpoint.save_checkpoint`)."""
    root, models = run.stage_dir / "checkpoints", run.models
    extra = {
        "inputs": run.inputs,  # what the weights fit: `--resume` and audit check it
        "health_seen": sorted(run.logs.health.seen),
        "rollbacks": run.rollbacks,  # `audit.max_rollbacks` counts across a resume
    }
    try:
        return save_checkpoint(root, iteration, models.engine, models.actor, run.state, extra)
    except OSError as exc:
        previous = checkpoint_folders(root, PPO_CHECKPOINT)
        raise CheckpointWriteError(
            f"writing checkpoint {ppo_checkpoint_name(iteration)} failed ({exc.strerror or exc}); "
            f"the previous checkpoint ({previous[-1].name if previous else 'none'}) is intact and "
            f"the manifest records this failure: {write_remedy(exc)}, then `rlhf ppo --resume`"
        ) from None


def live_audit(run: PPORun, iteration: int) -> tuple[dict[str, float], list[str]]:
    """The in-training audit every `audit.every` iterations: its rates for metrics.jsonl, and
    the guide's flags it raised (what `react_to_hacking` answers), both the main process's
    report's on every process (`main_decides`). Every process audits (the members of a
    tensor-parallel vLLM engine sample together; a server lost to any of them is lost to all:
    `answered_everywhere`). It samples and scores in the precision of the rollout (autocast),
    as the held-out evaluation does."""
    every, acc = run.recipe.audit.every, run.accelerator
    if run.hooks.audit is None or not every or iteration % every:
        return {}, []
    with acc.autocast(), run.models.engine.gathered(run.models.actor) as actor:  # all join
        report = answered_everywhere(acc, lambda: run.hooks.audit(actor, iteration))
    return main_decides(acc, lambda: _audit_outcome(run, iteration, report))


def _audit_outcome(
    run: PPORun, iteration: int, report: dict[str, Any]
) -> tuple[dict[str, float], list[str]]:
    """An audit `report`'s metrics and the guide's flags in it, warned about."""
    if report["hacking_detected"]:
        run.logs.warn(f"iteration {iteration}: the audit flagged {', '.join(report['flags'])}")
    keys = ("verbosity_score", "sycophancy_score", "repetition_score", "avg_response_len")
    keys += ("length_ratio",) if "length_ratio" in report else ()
    metrics = {f"audit/{k}": float(report[k]) for k in keys}
    metrics["audit/hacking_detected"] = float(report["hacking_detected"])
    return metrics, [flag for flag in report["flags"] if flag in GUIDE_FLAGS]


def react_to_hacking(run: PPORun, iteration: int, flags: list[str]) -> dict[str, float]:
    """`audit.on_hacking`, on every process alike, to `flags` (the guide's detectors,
    overoptimization; the same on every process: `live_audit`, `heldout_eval`): raise β by
    `kl_coef_step`; or roll back (`roll_back`), at most `max_rollbacks` times; or stop:
    checkpoint this iteration and exit 1 naming the best checkpoint. Returns what goes into
    this iteration's metrics."""
    cfg = run.recipe.audit
    if not flags:
        return {}
    names = ", ".join(flags)
    if cfg.on_hacking == "raise_beta":
        run.state.kl_ctl.raise_by(cfg.kl_coef_step)
        run.logs.warn(f"iteration {iteration}: β raised to {run.state.kl_ctl.value:.4f} ({names})")
        return {}
    if cfg.on_hacking == "rollback" and len(run.rollbacks) < cfg.max_rollbacks:
        return roll_back(run, iteration, names)
    saved = checkpoint(run, iteration)
    after = f" after {len(run.rollbacks)} rollback(s)" if run.rollbacks else ""
    best = (
        f"the best checkpoint is {run.best['checkpoint']} (iteration {run.best['iteration']}, "
        f"{run.best['metric']} {run.best['value']:.4f}): `rlhf merge --checkpoint best`"
        if run.best
        else "no held-out evaluation has named a best checkpoint yet"
    )
    raise HackingDetected(
        f"iteration {iteration}: the audit flagged {names}{after}; training stopped "
        f"(audit.on_hacking: {cfg.on_hacking}) with this state in {saved.name}; {best}"
    )


def roll_back(run: PPORun, iteration: int, names: str) -> dict[str, float]:
    """Restore `rollback_target`'s checkpoint, the main process's choice on every process
    (weights, optimiser, scheduler, β, score moments, RNG: `load_checkpoint`, as `--resume`
    does), mark the checkpoints it undoes (`undo_after`), drop the rollouts asked for ahead,
    then apply the recipe's correction to the values in force at the flag, not the restored ones
    (so that repeated rollbacks to one checkpoint compound): β × `rollback_kl_factor`, the
    schedule's learning rate × `rollback_lr_factor`. Without a checkpoint before the flag only
    the correction applies. The loop checkpoints the result at once and goes on counting
    iterations from `iteration`."""
    cfg, state = run.recipe.audit, run.state
    target = main_decides(run.accelerator, lambda: rollback_target(run, iteration))
    kl_coef = state.kl_ctl.value * cfg.rollback_kl_factor
    base_lrs = [lr * cfg.rollback_lr_factor for lr in state.scheduler.base_lrs]
    run.drafts.drop()
    restored = 0
    if target is not None:
        restored = int(
            load_checkpoint(target, run.models.engine, run.models.actor, state)["iteration"]
        )
    if run.accelerator.is_main_process:
        undo_after(run, restored, iteration)
    state.kl_ctl.set_to(kl_coef)
    restored_lrs = state.scheduler.base_lrs
    for group, old, new in zip(state.optimizer.param_groups, restored_lrs, base_lrs, strict=True):
        group["lr"] *= new / old  # the restored step of the schedule, on the corrected base
    state.scheduler.base_lrs = base_lrs
    lr = state.optimizer.param_groups[0]["lr"]
    run.rollbacks.append(
        {"iteration": iteration, "restored": restored, "flags": names,
         "kl_coef": state.kl_ctl.value, "learning_rate": lr}
    )  # fmt: skip
    run.logs.warn(
        f"iteration {iteration}: the audit flagged {names}; rolled back to "
        + (f"{target.name}" if target else "no checkpoint (none before the flag)")
        + f", β now {state.kl_ctl.value:.4f}, learning rate {lr:.3g} "
        f"(rollback {len(run.rollbacks)} of {cfg.max_rollbacks})"
    )
    return {"audit/rollback": 1.0, "audit/rolled_back_to": float(restored)}


def rollback_target(run: PPORun, iteration: int) -> Path | None:
    """The checkpoint a flag at iteration `iteration` restores: the newest written before it
    that no earlier rollback undid, or with `audit.rollback_to: best` the best one before it
    (`run.best`) when there is one; None without any."""
    root = run.stage_dir / "checkpoints"
    before = [
        f for f in checkpoint_folders(root, PPO_CHECKPOINT)
        if int(f.name.removeprefix(PPO_CHECKPOINT)) < iteration and undone_by(f) is None
    ]  # fmt: skip
    best = run.best if run.recipe.audit.rollback_to == "best" else None
    if best is not None and best["iteration"] < iteration and (root / best["checkpoint"]).is_dir():
        return root / best["checkpoint"]
    return before[-1] if before else None


def undo_after(run: PPORun, restored: int, iteration: int) -> None:
    """Mark the checkpoints written after iteration `restored` and before the flag at
    `iteration` as undone (`resume.mark_undone`): the weights the rollback threw away, which
    `--resume`, `rollback_to` and `best` never pick again (main process)."""
    for folder in checkpoint_folders(run.stage_dir / "checkpoints", PPO_CHECKPOINT):
        if restored < int(folder.name.removeprefix(PPO_CHECKPOINT)) < iteration:
            mark_undone(folder, iteration, restored)


def keep_best(run: PPORun, iteration: int, metrics: dict[str, float], saved: bool) -> None:
    """After a held-out evaluation: when its reward (the judge's when the recipe has one, else
    the proxy's) beats every earlier one (the main process judges, `main_decides`), make sure
    iteration `iteration` has a checkpoint (written now unless `saved`) and name it in
    `checkpoints/best.json` and, on every process, `run.best`. Every process calls it (the
    checkpoint is collective)."""
    acc = run.accelerator
    best = main_decides(acc, lambda: _better(run, metrics))
    if best is None:
        return
    folder = (
        checkpoint(run, iteration)
        if not saved
        else run.stage_dir / "checkpoints" / ppo_checkpoint_name(iteration)
    )
    key, value = best
    run.best = {"iteration": iteration, "checkpoint": folder.name, "metric": key, "value": value}
    if acc.is_main_process:
        atomic_write_json(folder.parent / BEST_CHECKPOINT, run.best)


def _better(run: PPORun, metrics: dict[str, float]) -> tuple[str, float] | None:
    """The held-out reward in `metrics` (the judge's when there is one) when it beats
    `run.best`'s, with its key; None otherwise."""
    key = "eval/judge_reward_mean" if "eval/judge_reward_mean" in metrics else "eval/reward_mean"
    value = metrics.get(key)
    if value is None or (run.best is not None and value <= run.best["value"]):
        return None
    return key, float(value)


def heldout_eval(run: PPORun, iteration: int) -> dict[str, float]:
    """The held-out evaluation, every `ppo.eval_every` iterations and at the last one. Every
    process evaluates (as the audit does); the main process's numbers, with its
    over-optimisation verdict, are every process's (`main_decides`): `keep_best` and
    `react_to_hacking` act on them."""
    acc, every = run.accelerator, run.recipe.ppo.eval_every
    last = iteration == run.recipe.ppo.iterations
    if run.hooks.evaluate is None or not (last or (every and iteration % every == 0)):
        return {}
    with acc.autocast(), run.models.engine.gathered(run.models.actor) as actor:
        metrics = answered_everywhere(acc, lambda: run.hooks.evaluate(actor, iteration))
    return main_decides(acc, lambda: {**metrics, **overoptimization(run, iteration, metrics)})


def overoptimization(run: PPORun, iteration: int, metrics: dict[str, float]) -> dict[str, float]:
    """With a judge (`audit.judge`), `audit/overoptimization`: 1.0 when this held-out
    evaluation (`metrics`) and the earlier ones (`run.logs.history`) show the proxy's reward
    rising while the judge's falls (`detectors.overoptimized` on each one's gain over the
    reference, over `audit.judge.window` evaluations, beyond its `margin` and the judge's
    sampling noise), else 0.0; only
    evaluations since the last rollback count (the weights they measured were undone). A flag
    is warned about here; `react_to_hacking` answers it."""
    keys = ("eval/reward_gain", "eval/judge_reward_gain")
    if keys[1] not in metrics:
        return {}
    cfg, since = run.recipe.audit.judge, max((r["iteration"] for r in run.rollbacks), default=0)
    rows = [
        row
        for row in [*run.logs.history, metrics]
        if row.get("iteration", iteration) > since and row.get(keys[1]) is not None
    ]
    flagged = overoptimized(
        [(row[keys[0]], row[keys[1]]) for row in rows],
        cfg.window,
        cfg.margin,
        [row.get("eval/judge_reward_gain_se", 0.0) for row in rows],
    )
    if flagged:
        run.logs.warn(
            f"iteration {iteration}: overoptimization: over the last {cfg.window} held-out "
            "evaluations the proxy's reward rose while the judge's fell"
        )
    return {"audit/overoptimization": float(flagged)}
