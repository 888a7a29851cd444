"""The PPO loop, top to bottom: `train` runs iterations; `run_iteration` is rollout, advantages,
update, β; `ppo_update` is K epochs of mini-batch optimiser steps; `minibatch_loss` is the
guide's loss (clipped surrogate, clipped value loss, entropy bonus); `advantages_of` is the
KL-shaped reward and the estimator's advantages. The maths is in core.py and estimators.py; how
the batch is spread over processes in distributed.py; what is logged in logs.py; what the loop
holds, checkpoints, the live audit and the held-out evaluation in run.py.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch

from rlhf_cli.errors import GenerationServerLost, NonFiniteError
from rlhf_cli.generation import response_logprobs, score_temperature
from rlhf_cli.ppo import core
from rlhf_cli.ppo.distributed import (
    any_process,
    global_max,
    global_rows,
    global_sum,
    main_decides,
    minibatch_rows,
    minibatch_shares,
    scalar,
)
from rlhf_cli.ppo.estimators import Batch, GlobalRows, estimator
from rlhf_cli.ppo.experience import Rollout
from rlhf_cli.ppo.logs import finite, iteration_metrics, progress_info, summarize
from rlhf_cli.ppo.rollout import collect_rollout, keep_old_logprobs, logprob_mismatch
from rlhf_cli.ppo.run import (
    PPORun,
    checkpoint,
    heldout_eval,
    keep_best,
    live_audit,
    react_to_hacking,
)
from rlhf_cli.recipe import PpoSection
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders
from rlhf_cli.stopping import graceful_stop
from rlhf_cli.tensor_peak import WINDOW_STEPS, close_window, release_freed_memory
from rlhf_cli.tracking import make_progress


def train(run: PPORun, start_iteration: int = 0) -> dict[str, Any]:
    """Run iterations `start_iteration+1 .. ppo.iterations`; return a summary. Ctrl-C or
    SIGTERM finishes the iteration and checkpoints; divergence checkpoints and raises; a
    rollout server lost for good (to any process: every process raises it at the same point)
    checkpoints the last whole iteration and raises; a rollback is checkpointed at once. What
    one process decides for all is agreed first (distributed.py)."""
    cfg, acc, logs = run.recipe.ppo, run.accelerator, run.logs
    progress = make_progress(logs.console)
    nonfinite_streak = 0
    with graceful_stop(logs.console, "iteration") as stop, progress, _drafts_dropped(run):
        task = progress.add_task("ppo", total=cfg.iterations, completed=start_iteration, info="")
        saved = start_iteration
        for iteration in range(start_iteration + 1, cfg.iterations + 1):
            drawn = run.state.sampler.get_state()
            try:
                metrics, rollout, kl = run_iteration(run, iteration)
            except GenerationServerLost as exc:
                run.state.sampler.set_state(drawn)  # the resume draws this batch again
                raise _lost(run, iteration - 1, saved, exc) from None
            nonfinite_streak = 0 if finite(metrics) else nonfinite_streak + 1
            try:
                audited, flags = live_audit(run, iteration)
                metrics.update(audited)
                metrics.update(heldout_eval(run, iteration))
            except GenerationServerLost as exc:
                _log(run, iteration, metrics, rollout, kl)
                raise _lost(run, iteration, saved, exc) from None
            if metrics.get("audit/overoptimization"):
                flags.append("overoptimization")
            try:
                metrics.update(react_to_hacking(run, iteration, flags))
            finally:  # `audit.on_hacking: stop` raises, its iteration logged first
                _log(run, iteration, metrics, rollout, kl)
            progress.update(task, completed=iteration, info=progress_info(metrics))
            if iteration - start_iteration == WINDOW_STEPS:
                close_window()  # the steady state's peak is counted (record.py)
            diverged = nonfinite_streak >= cfg.max_nonfinite
            if main_decides(acc, lambda: diverged):  # noqa: B023 - called at once
                checkpoint(run, iteration)
                raise NonFiniteError(
                    f"{nonfinite_streak} iterations in a row had non-finite rewards or losses; "
                    "a checkpoint of the last state was written. The guide's fixes: reduce "
                    "ppo.learning_rate, raise ppo.init_kl_coef, check the reward model's scores"
                )
            stop_now = any_process(acc, stop.requested)
            rolled_back = "audit/rollback" in metrics  # its undone checkpoints never resume
            save_now = (
                iteration % cfg.save_freq == 0
                or iteration == cfg.iterations
                or stop_now
                or rolled_back
            )
            if save_now:
                stop.saved = f"{checkpoint(run, iteration).name} (iteration {iteration})"
                saved = iteration
            if not rolled_back:  # evaluated weights that still stand
                keep_best(run, iteration, metrics, saved=save_now)
            if stop_now:
                raise KeyboardInterrupt(f"checkpoint {stop.saved} saved")
    return summarize(logs.history)


def _log(run: PPORun, iteration: int, metrics: dict[str, float], rollout: Rollout, kl: Any) -> None:
    run.logs.history.append(metrics)
    if run.accelerator.is_main_process:
        run.logs.record(run.accelerator, iteration, metrics, rollout, kl)


@contextmanager
def _drafts_dropped(run: PPORun) -> Iterator[None]:
    """Rollouts asked for ahead are never trained on once the loop ends, however it ends."""
    try:
        yield
    finally:
        run.drafts.drop()


def _lost(run: PPORun, done: int, saved: int, exc: GenerationServerLost) -> GenerationServerLost:
    """The error a lost rollout server ends the run with, once the last whole iteration
    (`done`) is checkpointed (unless it already was: `saved`)."""
    run.drafts.drop()
    if done > saved:
        checkpoint(run, done)
        saved = done
    folders = checkpoint_folders(run.stage_dir / "checkpoints", PPO_CHECKPOINT)
    then = (
        f"checkpoint {folders[-1].name} (iteration {saved}) holds the run: once the server "
        "answers, `rlhf ppo --resume` continues"
        if folders
        else "no checkpoint yet: once the server answers, run `rlhf ppo` again"
    )
    return GenerationServerLost(f"{exc}; {then}")


def run_iteration(
    run: PPORun, iteration: int
) -> tuple[dict[str, float], Rollout, torch.Tensor | None]:
    """One PPO iteration: rollout, advantages, K epochs of updates, β update. Returns the
    iteration's metrics, its rollout and the per-token KL (b, r) the rewards were shaped with
    (None at β = 0, when no reference ran)."""
    cfg, acc, state = run.recipe.ppo, run.accelerator, run.state
    t0 = time.perf_counter()
    kl_coef = state.kl_ctl.value  # β as it stands at this iteration
    # 1. Rollout: this process's prompts, answers, scores, old log-probs (or none yet: the
    #    update's forward gives them, rollout.old_logprobs_at_update), values, reference
    #    log-probs.
    rollout = collect_rollout(run, iteration)
    release_freed_memory()  # generation's blocks, which the update's do not fit
    # 2. Advantages from KL-shaped rewards.
    shaped = advantages_of(rollout, kl_coef, cfg, global_sum(acc), global_rows(acc))
    # 3. Update: K epochs over shuffled mini-batches.
    t_update = time.perf_counter()
    stats = ppo_update(run, rollout, shaped.advantages, shaped.returns, kl_coef)
    update_s = time.perf_counter() - t_update
    # 4. β moves once per iteration, toward the target KL (measured after the update, whose
    #    forward may have given the old log-probs).
    kl = reference_kl(rollout)
    returns = shaped.returns if cfg.needs_critic else None
    metrics = iteration_metrics(acc, rollout, kl, shaped.rewards, returns, kl_coef, stats)
    if math.isfinite(metrics.get("objective/kl", math.nan)):  # no KL measured at β = 0
        state.kl_ctl.update(metrics["objective/kl"], cfg.batch_size)
    n_tokens = float(acc.reduce(rollout.response_mask.sum().float(), "sum"))
    slowest = {
        **rollout.timings,
        "time/update_s": update_s,
        "time/iteration_s": time.perf_counter() - t0,
        "rollout/logprob_mismatch": logprob_mismatch(rollout),
        "rollout/staleness": float(rollout.staleness),
    }
    metrics.update(global_max(acc, slowest))  # the slowest process sets the pace
    metrics["tokens/generated_per_s"] = n_tokens / metrics["time/generate_s"]
    metrics["iteration"] = iteration
    return metrics, rollout, kl


def ppo_update(
    run: PPORun,
    rollout: Rollout,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    kl_coef: float = 0.0,
) -> dict[str, float]:
    """`ppo_epochs` passes over shuffled mini-batches; one optimizer step per
    `gradient_accumulation_steps` mini-batches (accelerate's `accumulate`, which drives
    DeepSpeed's boundary too); non-finite losses skip their mini-batch on every process.
    train() mode (gradient checkpointing needs it); dropout is 0 in every module (set at load).
    Logged parts are means over the global mini-batch: the `ppo/loss/*` ones aggregated as
    `ppo.loss_aggregation` says, the others (clip fractions, entropy, approx-KL) token means."""
    cfg, acc, actor, state = run.recipe.ppo, run.accelerator, run.models.actor, run.state
    actor.train()
    stats: dict[str, list[float]] = defaultdict(list)
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    acc.step = 0  # accumulation windows start with each iteration's update
    skipped = 0
    for _ in range(cfg.ppo_epochs):
        shares = minibatch_rows(
            cfg.batch_size, cfg.mini_batch_size, acc.num_processes, acc.process_index,
            state.sampler,
        )  # fmt: skip
        for idx in shares:
            with acc.accumulate(actor):
                loss, parts = minibatch_loss(cfg, actor, rollout, idx, advantages, returns, kl_coef)
                part = minibatch_shares(acc, loss, rollout.response_mask[idx], cfg.loss_aggregation)
                if not part.all_finite:  # every process agrees, or the collectives would hang
                    skipped += 1
                    continue
                # `part.loss` weighs this process's loss, aggregated over its own rows, by its
                # share of the global mini-batch's aggregation units times the number of
                # processes (which the gradient mean divides back out), so the step is the one
                # a single process would take on the whole mini-batch.
                acc.backward(loss * part.loss)
                if acc.sync_gradients:
                    stats["grad_norm"].append(
                        scalar(acc.clip_grad_norm_(params, cfg.max_grad_norm))
                    )
                    state.optimizer.step()
                    state.scheduler.step()
                    state.optimizer.zero_grad(set_to_none=True)
            for key, value in parts.items():
                share = part.loss if key.startswith("ppo/loss/") else part.tokens
                stats[key].append(value.item() * share)
            release_freed_memory()  # this mini-batch's activations, before the next one's
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    out["ppo/optimizer_steps"] = float(len(stats["grad_norm"]))
    out["ppo/skipped_minibatches"] = float(skipped)
    return out


def minibatch_loss(
    cfg: PpoSection,
    actor: Any,
    rollout: Rollout,
    idx: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of rollouts `idx` (b_mb of them) under the current policy, and its parts:
    the clipped surrogate (`cliprange`, `cliprange_high`; per-token or per-answer ratios,
    `importance_ratio`), the clipped value loss (with a
    critic), the entropy bonus, and with `kl_in: loss` β × the KL estimate to the reference
    (differentiable, GRPO's placement; weighted by π/π_old with `kl_importance_weight`). Each
    loss term is aggregated over this process's rows as `loss_aggregation` says (verl's
    `agg_loss` does the same for all its terms), so one share weighs them all
    (`distributed.minibatch_shares`); the logged clip fractions, entropy and approx-KL are token
    means.

    Log-probs are those of `logprob_support` (generation.response_logprobs). A rollout without
    old log-probs (`rollout.old_logprobs_at_update`) gets this forward's, detached. The entropy
    bonus stays out of the autograd graph when its coefficient is 0: at a 32k vocabulary it
    would keep a (b_mb, r, vocab) tensor alive for nothing."""
    batch = rollout.select(idx)
    mask = batch["response_mask"]
    how = {"aggregation": cfg.loss_aggregation, "norm_len": cfg.generation.max_new_tokens}
    logits, values = actor(batch["input_ids"], batch["attention_mask"], mask.shape[1])
    logprobs = response_logprobs(logits, batch["response_ids"], cfg.generation, cfg.logprob_support)
    if rollout.logprobs is None:  # the rollout's weights: this forward is π_old
        keep_old_logprobs(rollout, idx, logits, logprobs, cfg)
    old, sampled, cap = rollout.logprobs[idx], rollout.sampler_logprobs, cfg.generation.tis_cap
    weights = None  # truncated importance sampling against the rollout engine's numerics
    if cap is not None and sampled is not None:
        weights = core.tis_weights(rollout.warped_logprobs[idx], sampled[idx].to(old.device), cap)
    pg_loss, clipfrac = core.ppo_policy_loss(
        logprobs, old, advantages[idx], mask, cfg.cliprange, weights, cfg.cliprange_high,
        level=cfg.importance_ratio, **how,
    )  # fmt: skip
    with nullcontext() if cfg.entropy_coef > 0 else torch.no_grad():  # the full distribution
        entropy = core.entropy_from_logits(logits, score_temperature(cfg.generation))
    loss = pg_loss - cfg.entropy_coef * core.aggregate_loss(entropy, mask, **how)
    parts = {
        "ppo/loss/policy": pg_loss,
        "objective/clipfrac": clipfrac,
        "ppo/policy/entropy": core.masked_mean(entropy, mask),
        "ppo/policy/approxkl": core.approx_kl(logprobs, old, mask),
    }
    if cfg.needs_critic:
        vf_loss, parts["ppo/val/clipfrac"] = core.ppo_value_loss(
            values, rollout.values[idx], returns[idx], mask, cfg.cliprange_value, **how
        )
        loss = loss + cfg.vf_coef * vf_loss
        parts["ppo/loss/value"] = vf_loss
    if cfg.kl_in == "loss" and rollout.ref_logprobs is not None:  # none ran at β = 0
        ref = rollout.ref_logprobs[idx]
        weigh = old if cfg.kl_importance_weight else None
        kl = core.kl_estimate(logprobs, ref, mask, cfg.kl_estimator, weigh)
        kl_loss = core.aggregate_loss(kl, mask, **how)
        loss = loss + kl_coef * kl_loss
        parts["ppo/loss/kl"] = kl_loss
    parts["ppo/loss/total"] = loss
    return loss, parts


class Advantages(NamedTuple):
    """What `advantages_of` gives the update and the logs, each (b, r)."""

    rewards: torch.Tensor  # per token: the score on the last one, KL-shaped, maybe whitened
    advantages: torch.Tensor
    returns: torch.Tensor  # the value targets; 0 without a critic


def advantages_of(
    rollout: Rollout,
    kl_coef: float,
    cfg: PpoSection,
    reduce_sum: core.Reducer = None,
    across: GlobalRows = lambda fn, x: fn(x),
) -> Advantages:
    """Per-token rewards (the score on the last token, minus β × the KL estimate per token when
    `kl_in: reward`, whitened when `whiten_rewards`), then the estimator's advantages and
    returns (estimators.py). Statistics are the global batch's (`reduce_sum` sums over
    processes, `across` sees every row). Only the KL in the rewards reads the old log-probs."""
    mask = rollout.response_mask
    if cfg.kl_in == "reward" and rollout.ref_logprobs is not None:
        rewards, _ = core.kl_penalized_rewards(
            rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_coef, cfg.kl_estimator
        )
    else:  # the scores alone (the KL is in the loss, or β = 0): no log-probs read, zeros
        zeros = torch.zeros(mask.shape, device=mask.device)
        rewards, _ = core.kl_penalized_rewards(rollout.scores, zeros, None, mask, 0.0)
    if cfg.whiten_rewards:
        rewards = core.masked_whiten(rewards, mask, shift_mean=False, reduce_sum=reduce_sum)
    batch = Batch(rewards, rollout.values, mask)
    advantages, returns = estimator(cfg.advantage_estimator).fn(batch, cfg, reduce_sum, across)
    return Advantages(rewards, advantages, returns)


def reference_kl(rollout: Rollout) -> torch.Tensor | None:
    """k1 = log π_old − log π_ref per token (b, r), 0 off the responses: what `objective/kl`,
    β's update and samples.jsonl read, whatever `kl_estimator` penalises. None when no
    reference ran (β = 0)."""
    if rollout.ref_logprobs is None:
        return None
    return core.kl_estimate(rollout.logprobs, rollout.ref_logprobs, rollout.response_mask, "k1")
