"""What the PPO loop holds (`PPORun`: the recipe and a few typed parts) and what happens around
an iteration: checkpoints, the live audit (`audit.every`), the held-out evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.audit.detectors import GUIDE_FLAGS
from rlhf_cli.errors import CheckpointWriteError, write_remedy
from rlhf_cli.generation import Generator
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo.checkpoint import TrainState, save_checkpoint
from rlhf_cli.ppo.distributed import any_process
from rlhf_cli.ppo.experience import Drafts
from rlhf_cli.ppo.logs import RunLogs
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.sharding import Engine
from rlhf_cli.recipe import Recipe
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders
from rlhf_cli.rundir import InputRecord
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

    audit: Callable[[PolicyAndValue], dict[str, Any]] | None
    evaluate: Callable[[PolicyAndValue], dict[str, float]] | None


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
    stage_dir: Path
    inputs: dict[str, InputRecord]  # the stages trained on (the manifest's)
    drafts: Drafts = field(default_factory=Drafts)  # rollouts asked for ahead (`async_steps`)

    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.accelerator.unwrap_model(self.models.actor)


def checkpoint(run: PPORun, iteration: int) -> Path:
    """Every process writes its part (`checkpoint.save_checkpoint`)."""
    root, models = run.stage_dir / "checkpoints", run.models
    extra = {
        "inputs": run.inputs,  # what the weights fit: `--resume` and audit check it
        "health_seen": sorted(run.logs.health.seen),
    }
    try:
        return save_checkpoint(root, iteration, models.engine, models.actor, run.state, extra)
    except OSError as exc:
        previous = checkpoint_folders(root, PPO_CHECKPOINT)
        raise CheckpointWriteError(
            f"writing checkpoint iter_{iteration:05d} failed ({exc.strerror or exc}); "
            f"the previous checkpoint ({previous[-1].name if previous else 'none'}) is intact and "
            f"the manifest records this failure: {write_remedy(exc)}, then `rlhf ppo --resume`"
        ) from None


def live_audit(run: PPORun, iteration: int) -> dict[str, float]:
    """The in-training audit every `audit.every` iterations: its rates go into metrics.jsonl,
    and when it flags hacking β is raised by `audit.kl_coef_step` (on every process). Every
    process audits (the members of a tensor-parallel vLLM engine sample together); the main
    process's report counts. It samples and scores in the precision of the rollout (autocast),
    as the held-out evaluation does."""
    every, acc = run.recipe.audit.every, run.accelerator
    if run.hooks.audit is None or not every or iteration % every:
        return {}
    with acc.autocast(), run.models.engine.gathered(run.models.actor) as actor:  # all join
        report = run.hooks.audit(actor)
    if not acc.is_main_process:
        report = None
    raise_beta = any_process(acc, bool(report and set(report["flags"]) & set(GUIDE_FLAGS)))
    if raise_beta:
        run.state.kl_ctl.raise_by(run.recipe.audit.kl_coef_step)
    if report is None:
        return {}
    if report["hacking_detected"]:
        run.logs.warn(
            f"iteration {iteration}: the audit flagged {', '.join(report['flags'])}; "
            + (f"β raised to {run.state.kl_ctl.value:.4f}" if raise_beta else "β left as it was")
        )
    keys = ("verbosity_score", "sycophancy_score", "repetition_score", "avg_response_len")
    keys += ("length_ratio",) if "length_ratio" in report else ()
    metrics = {f"audit/{k}": float(report[k]) for k in keys}
    return {**metrics, "audit/hacking_detected": float(report["hacking_detected"])}


def heldout_eval(run: PPORun, iteration: int) -> dict[str, float]:
    """The held-out evaluation, every `ppo.eval_every` iterations and at the last one. Every
    process evaluates (as the audit does); the main process's numbers are logged."""
    every, last = run.recipe.ppo.eval_every, iteration == run.recipe.ppo.iterations
    if run.hooks.evaluate is None or not (last or (every and iteration % every == 0)):
        return {}
    with run.accelerator.autocast(), run.models.engine.gathered(run.models.actor) as actor:
        metrics = run.hooks.evaluate(actor)
    return metrics if run.accelerator.is_main_process else {}
