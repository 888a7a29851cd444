"""The PPO iteration loop: rollout, KL-shaped rewards and GAE, K epochs of mini-batch updates,
the adaptive β, logging, health checks and checkpoints.

Reads top to bottom like CleanRL's ppo.py; the maths lives in core.py.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from rlhf_cli.errors import CheckpointWriteError, NonFiniteError, write_remedy
from rlhf_cli.generation import Generator, response_logprobs, row_seed, score_temperature
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo import core
from rlhf_cli.ppo.checkpoint import save_checkpoint
from rlhf_cli.ppo.health import RANGES, HealthMonitor
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.rollout import Rollout, collect_rollout, logprob_mismatch
from rlhf_cli.ppo.sharding import Engine
from rlhf_cli.recipe import PpoSection
from rlhf_cli.rundir import graceful_stop
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.tracking import MetricsWriter, make_progress


@dataclass
class PPOContext:
    """Everything the loop touches; built by stages/ppo.py."""

    cfg: PpoSection
    accelerator: Any
    engine: Engine  # how the actor is spread over the processes
    actor: Any  # PolicyAndValue, as the engine wrapped it (DDP, DeepSpeed) or sharded it (FSDP2)
    reference: Reference
    scorer: RewardScorer
    generator: Generator
    tokenizer: Any
    prompts: list[str]
    queries: list[list[int]]
    optimizer: Any
    scheduler: Any
    kl_ctl: Any
    sampler: torch.Generator
    stage_dir: Path
    writer: MetricsWriter
    samples: MetricsWriter
    console: Console
    health: HealthMonitor = field(default_factory=HealthMonitor)
    score_moments: core.RunningMoments | None = None  # `ppo.score_norm`
    history: list[dict[str, Any]] = field(default_factory=list)
    on_warning: Callable[[str], None] = print
    max_nonfinite: int = 3
    seed: int = 0  # the run's seed: rollout rows sample from seeds derived from it
    audit: Callable[[PolicyAndValue], dict[str, Any]] | None = None  # on the whole actor
    audit_every: int | None = None
    audit_kl_step: float = 0.0
    evaluate: Callable[[PolicyAndValue], dict[str, float]] | None = None  # held-out prompts
    inputs: dict[str, Any] = field(default_factory=dict)  # the stages trained on (manifest's)

    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.accelerator.unwrap_model(self.actor)


# ── one iteration ───────────────────────────────────────────────────────────────────────────────


def sample_batch(ctx: PPOContext) -> list[int]:
    """This process's share of `batch_size` prompt indices (same draw on every process): with
    `num_generations` k, batch_size / k prompts, each on k consecutive rows (a group)."""
    acc, k = ctx.accelerator, ctx.cfg.num_generations
    n = ctx.cfg.batch_size // k
    draws = []
    while len(draws) < n:  # epochs over the prompt pool when it is smaller than a batch
        draws.extend(torch.randperm(len(ctx.prompts), generator=ctx.sampler).tolist())
    rows = [i for i in draws[:n] for _ in range(k)]
    return rows[acc.process_index :: acc.num_processes]


def global_sum(acc: Any) -> core.Reducer:
    """Sums over every process (an all-reduce), so whitening and statistics are those of the
    global batch; None on one process."""
    if acc.num_processes == 1:
        return None
    return lambda t: acc.reduce(t.to(acc.device).contiguous(), "sum").to(t.device)


GlobalRows = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def global_rows(acc: Any) -> GlobalRows:
    """`apply(fn, local)`: `fn` on the global batch's rows in order (this process holds rows
    rank, rank + world, ...), and this process's rows of the result: how a group statistic
    sees every member of a group, wherever it was generated."""
    world, rank = acc.num_processes, acc.process_index

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        if world == 1:
            return fn(local)
        gathered = acc.gather(local.to(acc.device).contiguous()).view(world, -1)
        out = fn(gathered.t().reshape(-1)).view(-1, world)
        return out[:, rank].to(local.device)

    return apply


def advantages_of(
    rollout: Rollout,
    kl_coef: float,
    cfg: PpoSection,
    reduce_sum: core.Reducer = None,
    across: GlobalRows = lambda fn, x: fn(x),
) -> tuple[torch.Tensor, ...]:
    """Per-token rewards (the score on the last token, minus β × the KL estimate per token when
    `kl_in: reward`), then `advantage_estimator`'s advantages: GAE on the critic's values, then
    whitened (Huang et al. details 5-7); REINFORCE++'s whitened returns; RLOO's or GRPO's
    group advantage of each response's summed reward, on all its tokens. Statistics are the
    global batch's (`reduce_sum` sums over processes, `across` sees every row). Returns
    (rewards, k1 KL per token, advantages, returns); returns are 0 without a critic."""
    mask = rollout.response_mask
    beta = kl_coef if cfg.kl_in == "reward" else 0.0
    rewards, kl = core.kl_penalized_rewards(
        rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, beta, cfg.kl_estimator
    )
    if cfg.whiten_rewards:
        rewards = core.masked_whiten(rewards, mask, shift_mean=False, reduce_sum=reduce_sum)
    no_returns = torch.zeros_like(rewards)
    if cfg.advantage_estimator == "gae":
        advantages, returns = core.compute_gae(rollout.values, rewards, mask, cfg.gamma, cfg.lam)
        return rewards, kl, core.masked_whiten(advantages, mask, reduce_sum=reduce_sum), returns
    if cfg.advantage_estimator == "reinforce_pp":
        advantages = core.reinforce_pp_advantages(rewards, mask, cfg.gamma, reduce_sum)
        return rewards, kl, advantages, no_returns
    group = (
        core.leave_one_out_advantages
        if cfg.advantage_estimator == "rloo"
        else core.group_normalized_advantages
    )
    per_response = across(lambda r: group(r, cfg.num_generations), rewards.sum(1))
    return rewards, kl, per_response[:, None] * mask, no_returns


def minibatch_loss(
    cfg: PpoSection,
    actor: Any,
    rollout: Rollout,
    idx: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of rollouts `idx` (b_mb of them) under the current policy, and its parts,
    each a mean over this process's response tokens: the clipped surrogate, the clipped value
    loss (with a critic), the entropy bonus, and with `kl_in: loss` β × the KL estimate to the
    reference (differentiable, GRPO's placement).

    Log-probs are those of the sampled distribution (generation.response_logprobs). The entropy
    bonus stays out of the autograd graph when its coefficient is 0: at a 32k vocabulary it
    would keep a (b_mb, r, vocab) tensor alive for nothing."""
    batch = rollout.select(idx)
    mask = batch["response_mask"]
    logits, values = actor(batch["input_ids"], batch["attention_mask"], mask.shape[1])
    logprobs = response_logprobs(logits, batch["response_ids"], cfg.generation)
    old, sampled, cap = rollout.logprobs[idx], rollout.sampler_logprobs, cfg.generation.tis_cap
    weights = None  # truncated importance sampling against the rollout engine's numerics
    if cap is not None and sampled is not None:
        weights = core.tis_weights(old, sampled[idx].to(old.device), cap)
    pg_loss, clipfrac = core.ppo_policy_loss(
        logprobs, old, advantages[idx], mask, cfg.cliprange, weights
    )
    with nullcontext() if cfg.entropy_coef > 0 else torch.no_grad():
        scaled = logits.float() / score_temperature(cfg.generation)  # the full distribution
        entropy = core.masked_mean(core.entropy_from_logits(scaled), mask)
    loss = pg_loss - cfg.entropy_coef * entropy
    parts = {
        "ppo/loss/policy": pg_loss,
        "objective/clipfrac": clipfrac,
        "ppo/policy/entropy": entropy,
        "ppo/policy/approxkl": core.approx_kl(logprobs, old, mask),
    }
    if cfg.advantage_estimator == "gae":
        vf_loss, parts["ppo/val/clipfrac"] = core.ppo_value_loss(
            values, rollout.values[idx], returns[idx], mask, cfg.cliprange_value
        )
        loss = loss + cfg.vf_coef * vf_loss
        parts["ppo/loss/value"] = vf_loss
    if cfg.kl_in == "loss":
        ref = rollout.ref_logprobs[idx]
        kl_loss = core.masked_mean(core.kl_estimate(logprobs, ref, mask, cfg.kl_estimator), mask)
        loss = loss + kl_coef * kl_loss
        parts["ppo/loss/kl"] = kl_loss
    parts["ppo/loss/total"] = loss
    return loss, parts


def minibatch_rows(
    batch_size: int, mini_batch_size: int, world: int, rank: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """This process's rows (indices into its share of the batch) of each mini-batch of one
    epoch, in order.

    Global mini-batch k takes one row of each residue class modulo `mini_batch_size`, every
    class's rows in a random order (`generator` draws alike on every process). The rows were
    drawn in random order (`sample_batch`), so this is as good as a uniform reshuffle; and it
    splits every mini-batch into the same rows, evenly, for any number of processes dividing
    `mini_batch_size`: N processes take the optimiser steps of one."""
    groups = batch_size // mini_batch_size
    order = torch.stack(
        [torch.randperm(groups, generator=generator) for _ in range(mini_batch_size)], dim=1
    )
    rows = order * mini_batch_size + torch.arange(mini_batch_size)  # (groups, mb), global
    return [r[r % world == rank] // world for r in rows]


def token_share(acc: Any, loss: torch.Tensor, mask: torch.Tensor) -> tuple[float, bool]:
    """(this process's share of the global mini-batch's response tokens times the number of
    processes, whether every process's loss is finite): one all-reduce.

    A loss that is a mean over this process's tokens, multiplied by the share, averages over
    the processes (as DDP, DeepSpeed and FSDP average gradients) to the mean over all the
    mini-batch's tokens: the loss and gradient one process would compute on the whole
    mini-batch, whatever the split of tokens between processes."""
    local = mask.sum().float().to(acc.device)
    nonfinite = (~torch.isfinite(loss.detach())).float().to(acc.device)
    tokens, bad = acc.reduce(torch.stack([local, nonfinite]), "sum").tolist()
    return float(local) * acc.num_processes / max(tokens, 1.0), bad == 0


def ppo_update(
    ctx: PPOContext,
    rollout: Rollout,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    kl_coef: float = 0.0,
) -> dict[str, float]:
    """`ppo_epochs` passes over shuffled mini-batches; one optimizer step per
    `gradient_accumulation_steps` mini-batches (accelerate's `accumulate`, which drives
    DeepSpeed's boundary too); non-finite losses skip their mini-batch on every process.
    train() mode (gradient checkpointing needs it); dropout is 0 in every module (set at load).
    Logged parts are token means over the global mini-batch."""
    cfg, acc, actor = ctx.cfg, ctx.accelerator, ctx.actor
    actor.train()
    stats: dict[str, list[float]] = defaultdict(list)
    params = [p for group in ctx.optimizer.param_groups for p in group["params"]]
    acc.step = 0  # accumulation windows start with each iteration's update
    skipped = 0
    for _ in range(cfg.ppo_epochs):
        shares = minibatch_rows(
            cfg.batch_size, cfg.mini_batch_size, acc.num_processes, acc.process_index, ctx.sampler
        )
        for idx in shares:
            with acc.accumulate(actor):
                loss, parts = minibatch_loss(cfg, actor, rollout, idx, advantages, returns, kl_coef)
                share, finite = token_share(acc, loss, rollout.response_mask[idx])
                if not finite:  # every process agrees, or the collectives would hang
                    skipped += 1
                    continue
                acc.backward(loss * share)
                if acc.sync_gradients:
                    norm = acc.clip_grad_norm_(params, cfg.max_grad_norm)
                    stats["grad_norm"].append(_scalar(norm))
                    ctx.optimizer.step()
                    ctx.scheduler.step()
                    ctx.optimizer.zero_grad(set_to_none=True)
            for key, value in parts.items():
                stats[key].append(value.item() * share)
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    out["ppo/optimizer_steps"] = float(len(stats["grad_norm"]))
    out["ppo/skipped_minibatches"] = float(skipped)
    return out


def _scalar(x: Any) -> float:
    """A gradient norm as a float: a tensor, a DTensor (FSDP2) or DeepSpeed's float."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x) if x is not None else float("nan")


def _gather_mean_std(acc: Any, x: torch.Tensor) -> tuple[float, float]:
    allx = acc.gather(x.float().contiguous())
    return float(allx.mean()), float(allx.std()) if allx.numel() > 1 else 0.0


def iteration_metrics(
    ctx: PPOContext,
    rollout: Rollout,
    kl: torch.Tensor,
    rewards: torch.Tensor,
    returns: torch.Tensor,
    kl_coef: float,
    stats: dict[str, float],
) -> dict[str, float]:
    acc, mask = ctx.accelerator, rollout.response_mask
    lengths, reduce_sum = mask.sum(1).float(), global_sum(ctx.accelerator)
    reward_mean, reward_std = _gather_mean_std(acc, rollout.scores)
    metrics = {
        "env/reward_mean": reward_mean,
        "env/reward_std": reward_std,
        "env/raw_score_mean": _gather_mean_std(acc, rollout.raw_scores)[0],
        "objective/kl": _gather_mean_std(acc, kl.sum(1))[0],
        "objective/kl_coef": kl_coef,
        "objective/entropy": 0.0,
        "ppo/mean_non_score_reward": _gather_mean_std(
            acc, (rewards.sum(1) - rollout.scores).detach()
        )[0],
        "response/length_mean": _gather_mean_std(acc, lengths)[0],
        "response/ended_frac": _gather_mean_std(acc, rollout.ended.float())[0],
        "reward/truncated_inputs": float(
            acc.reduce(torch.tensor(float(rollout.n_truncated), device=acc.device), "sum")
        ),
    }
    if ctx.cfg.advantage_estimator == "gae":  # the critic's
        metrics["ppo/val/explained_variance"] = float(
            core.explained_variance(rollout.values, returns, mask, reduce_sum)
        )
        metrics["ppo/val/mean"] = float(
            core.masked_mean(rollout.values, mask, reduce_sum=reduce_sum)
        )
        metrics["ppo/returns/mean"] = float(core.masked_mean(returns, mask, reduce_sum=reduce_sum))
    for key, value in stats.items():
        metrics[key] = float(acc.reduce(torch.tensor(value, device=acc.device), "mean"))
    metrics["objective/entropy"] = metrics.pop("ppo/policy/entropy", 0.0)
    return metrics


# ── the loop ────────────────────────────────────────────────────────────────────────────────────


def checkpoint(ctx: PPOContext, iteration: int) -> Path:
    """Every process writes its part (`checkpoint.save_checkpoint`)."""
    try:
        return save_checkpoint(
            ctx.stage_dir / "checkpoints",
            iteration,
            engine=ctx.engine,
            actor=ctx.actor,
            optimizer=ctx.optimizer,
            scheduler=ctx.scheduler,
            kl_ctl=ctx.kl_ctl,
            sampler=ctx.sampler,
            extra={
                "inputs": ctx.inputs,  # what the weights fit: `--resume` and audit check it
                "health_seen": sorted(ctx.health.seen),
                "score_moments": ctx.score_moments and ctx.score_moments.state_dict(),
            },
        )
    except OSError as exc:
        previous = sorted(p.name for p in (ctx.stage_dir / "checkpoints").glob("iter_*"))
        raise CheckpointWriteError(
            f"writing checkpoint iter_{iteration:05d} failed ({exc.strerror or exc}); "
            f"the previous checkpoint ({previous[-1] if previous else 'none'}) is intact and "
            f"the manifest records this failure: {write_remedy(exc)}, then `rlhf ppo --resume`"
        ) from None


def log_block(ctx: PPOContext, iteration: int, m: dict[str, float], rollout: Rollout) -> None:
    """The guide's every-N-iterations health block, with a sample prompt and response; each
    value with a healthy band (`health.RANGES`) is marked ok or check."""

    def mark(key: str) -> str:
        healthy = RANGES[key].healthy_now(m[key]) if key in RANGES and key in m else None
        return {True: " [green]ok[/]", False: " [yellow]check[/]", None: ""}[healthy]

    c = ctx.console
    c.print(f"\n--- Iteration {iteration:4d} ---")
    rows = [
        ("Avg Reward", "env/reward_mean", "+.4f"),
        ("KL Divergence", "objective/kl", ".4f"),
        ("KL Coef (β)", "objective/kl_coef", ".4f"),
        ("Policy Loss", "ppo/loss/policy", ".4f"),
        ("Value Loss", "ppo/loss/value", ".4f"),
        ("Entropy", "objective/entropy", ".4f"),
        ("Clip Fraction", "objective/clipfrac", ".4f"),
    ]
    for label, key, fmt in rows:
        c.print(f"  {label + ':':<15}{format(m.get(key, float('nan')), fmt)}{mark(key)}")
    c.print(f"  Sample prompt:   {rollout.prompts[0][:60]}", markup=False)
    c.print(f"  Sample response: {rollout.texts[0][:120]}", markup=False)


def run_iteration(
    ctx: PPOContext, iteration: int
) -> tuple[dict[str, float], Rollout, torch.Tensor]:
    """One PPO iteration: rollout, advantages, K epochs of updates, β update. Returns the
    iteration's metrics, its rollout and the per-token KL (b, r) the rewards were shaped with."""
    cfg, acc = ctx.cfg, ctx.accelerator
    t0 = time.perf_counter()
    # 1. Rollout: sample prompts, generate (each row from its own seed), score, old log-probs,
    #    values, reference.
    index = sample_batch(ctx)
    rows = range(acc.process_index, cfg.batch_size, acc.num_processes)  # global batch rows
    # the precision the update computes in (fp32 master weights); sharded weights gathered once
    with acc.autocast(), ctx.engine.gathered(ctx.actor) as actor:
        ctx.generator.sync(actor.policy)  # a separate engine (vLLM) gets the latest weights
        rollout = collect_rollout(
            actor,
            ctx.reference,
            ctx.scorer,
            ctx.generator,
            [ctx.prompts[i] for i in index],
            [ctx.queries[i] for i in index],
            cfg,
            ctx.score_moments,
            lambda x: acc.gather(x.to(acc.device)).cpu(),
            seeds=[row_seed(ctx.seed, iteration, row) for row in rows],
        )
    # 2. Advantages from KL-shaped rewards (β as it stands at this iteration).
    kl_coef = ctx.kl_ctl.value
    rewards, kl, advantages, returns = advantages_of(
        rollout, kl_coef, cfg, global_sum(acc), global_rows(acc)
    )
    # 3. Update: K epochs over shuffled mini-batches.
    t_update = time.perf_counter()
    stats = ppo_update(ctx, rollout, advantages, returns, kl_coef)
    update_s = time.perf_counter() - t_update
    # 4. β moves once per iteration, toward the target KL.
    metrics = iteration_metrics(ctx, rollout, kl, rewards, returns, kl_coef, stats)
    if math.isfinite(metrics["objective/kl"]):
        ctx.kl_ctl.update(metrics["objective/kl"], cfg.batch_size)
    n_tokens = float(acc.reduce(rollout.response_mask.sum().float(), "sum"))
    # the slowest process sets the pace: times (and the mismatch) are maxima over processes
    slowest = {
        **rollout.timings,
        "time/update_s": update_s,
        "time/iteration_s": time.perf_counter() - t0,
        "rollout/logprob_mismatch": logprob_mismatch(rollout),
    }
    maxima = acc.reduce(torch.tensor(list(slowest.values()), device=acc.device), "max")
    metrics.update(dict(zip(slowest, maxima.tolist(), strict=True)))
    metrics["tokens/generated_per_s"] = n_tokens / metrics["time/rollout_s"]
    metrics["iteration"] = iteration
    return metrics, rollout, kl


def record_iteration(
    ctx: PPOContext, iteration: int, metrics: dict[str, float], rollout: Rollout, kl: torch.Tensor
) -> None:
    """Main process: metrics.jsonl, the truncation warning, health rules, the console block and
    samples.jsonl every `log_every` iterations; the recipe's trackers get the same numbers."""
    ctx.writer.log(metrics, step=iteration)
    ctx.accelerator.log(metrics, step=iteration)
    if rollout.n_truncated and "reward_truncation" not in ctx.health.seen:
        ctx.health.seen.add("reward_truncation")
        ctx.on_warning(
            f"iteration {iteration}: {rollout.n_truncated} of "
            f"{len(rollout.prompts)} reward inputs were longer than "
            "reward.max_length and truncated (reward/truncated_inputs counts them "
            "each iteration)"
        )
    for message in ctx.health.check(metrics, iteration, ctx.history):
        ctx.console.print(f"[yellow]health[/]: {message}", markup=True)
        ctx.on_warning(message)
    if iteration % ctx.cfg.log_every == 0 or iteration == 1:
        log_block(ctx, iteration, metrics, rollout)
        _write_samples(ctx, iteration, rollout, kl)


def train(ctx: PPOContext, start_iteration: int = 0) -> dict[str, Any]:
    """Run iterations `start_iteration+1 .. cfg.iterations`; return a summary. Ctrl-C or
    SIGTERM finishes the iteration and checkpoints; divergence checkpoints and raises."""
    cfg, acc = ctx.cfg, ctx.accelerator
    progress = make_progress(ctx.console)
    nonfinite_streak = 0
    with graceful_stop(ctx.console, "iteration") as stop, progress:
        task = progress.add_task("ppo", total=cfg.iterations, completed=start_iteration, info="")
        for iteration in range(start_iteration + 1, cfg.iterations + 1):
            metrics, rollout, kl = run_iteration(ctx, iteration)
            nonfinite_streak = nonfinite_streak + 1 if not _finite(metrics) else 0
            metrics.update(_audit_metrics(ctx, iteration))
            metrics.update(_eval_metrics(ctx, iteration))
            ctx.history.append(metrics)
            if acc.is_main_process:
                record_iteration(ctx, iteration, metrics, rollout, kl)
            progress.update(
                task,
                completed=iteration,
                info=(
                    f"reward {metrics['env/reward_mean']:+.3f}  kl {metrics['objective/kl']:.3f}  "
                    f"β {metrics['objective/kl_coef']:.4f}"
                ),
            )
            if nonfinite_streak >= ctx.max_nonfinite:
                checkpoint(ctx, iteration)
                raise NonFiniteError(
                    f"{nonfinite_streak} iterations in a row had non-finite rewards or losses; "
                    "a checkpoint of the last state was written. The guide's fixes: reduce "
                    "ppo.learning_rate, raise ppo.init_kl_coef, check the reward model's scores"
                )
            stop_now = bool(
                acc.reduce(torch.tensor(float(stop["stop"]), device=acc.device), "max").item()
            )
            if iteration % cfg.save_freq == 0 or iteration == cfg.iterations or stop_now:
                stop["saved"] = f"{checkpoint(ctx, iteration).name} (iteration {iteration})"
            if stop_now:
                raise KeyboardInterrupt(f"checkpoint {stop['saved']} saved")
    return summarize(ctx.history)


def _audit_metrics(ctx: PPOContext, iteration: int) -> dict[str, float]:
    """The in-training audit every `audit.every` iterations: its rates go into metrics.jsonl,
    and when it flags hacking β is raised by `audit.kl_coef_step` (on every process). Every
    process audits (the members of a tensor-parallel vLLM engine sample together); the main
    process's report counts."""
    if ctx.audit is None or not ctx.audit_every or iteration % ctx.audit_every:
        return {}
    acc = ctx.accelerator
    with ctx.engine.gathered(ctx.actor) as actor:  # every process joins the gather
        report = ctx.audit(actor)
    if not acc.is_main_process:
        report = None
    flagged = torch.tensor(float(bool(report and report["hacking_detected"])), device=acc.device)
    flagged_any = bool(acc.reduce(flagged, "max").item())
    if flagged_any:
        ctx.kl_ctl.raise_by(ctx.audit_kl_step)
    if report is None:
        return {}
    if flagged_any:
        ctx.on_warning(
            f"iteration {iteration}: the audit flagged {', '.join(report['flags'])}; "
            f"β raised to {ctx.kl_ctl.value:.4f}"
        )
    out = {
        f"audit/{k}": float(report[k])
        for k in ("verbosity_score", "sycophancy_score", "repetition_score", "avg_response_len")
    }
    return {**out, "audit/hacking_detected": float(flagged_any)}


def _eval_metrics(ctx: PPOContext, iteration: int) -> dict[str, float]:
    """The held-out evaluation, every `ppo.eval_every` iterations and at the last one. Every
    process evaluates (as the audit does); the main process's numbers are logged."""
    every, last = ctx.cfg.eval_every, iteration == ctx.cfg.iterations
    if ctx.evaluate is None or not (last or (every and iteration % every == 0)):
        return {}
    with ctx.accelerator.autocast(), ctx.engine.gathered(ctx.actor) as actor:
        metrics = ctx.evaluate(actor)
    return metrics if ctx.accelerator.is_main_process else {}


def _finite(metrics: dict[str, float]) -> bool:
    keys = ("env/reward_mean", "objective/kl", "ppo/loss/total")
    return all(torch.isfinite(torch.tensor(metrics.get(k, 0.0))) for k in keys)


def _write_samples(ctx: PPOContext, iteration: int, rollout: Rollout, kl: torch.Tensor) -> None:
    """The guide: read 10 actual generated responses every so often."""
    for i in range(min(10, len(rollout.prompts))):
        ctx.samples.log(
            {
                "prompt": rollout.prompts[i],
                "response": rollout.texts[i],
                "score": float(rollout.scores[i]),
                "kl": float(kl[i].sum()),
            },
            step=iteration,
        )


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """First-fifth vs last-fifth mean reward, the final KL and β, and the last held-out
    evaluation's `eval/*` numbers."""
    if not history:
        return {}
    fifth = max(1, len(history) // 5)
    first = [h["env/reward_mean"] for h in history[:fifth]]
    last = [h["env/reward_mean"] for h in history[-fifth:]]
    evals = [h for h in history if "eval/reward_mean" in h]
    return {
        **({k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}),
        "iterations": history[-1]["iteration"],
        "reward_first_fifth": sum(first) / len(first),
        "reward_last_fifth": sum(last) / len(last),
        "kl_final": history[-1]["objective/kl"],
        "kl_coef_final": history[-1]["objective/kl_coef"],
        "iteration_s_median": sorted(h["time/iteration_s"] for h in history)[len(history) // 2],
    }
