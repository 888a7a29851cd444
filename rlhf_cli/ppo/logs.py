"""What an iteration leaves behind: its metrics (metrics.jsonl and the trackers, the same
numbers under the same keys, docs/metrics.md), the guide's health block on the console, ten
sampled answers in samples.jsonl, health warnings, and the run's summary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console

from rlhf_cli.ppo import core
from rlhf_cli.ppo.distributed import gather_mean_std, global_sum
from rlhf_cli.ppo.experience import Rollout
from rlhf_cli.ppo.health import RANGES, HealthMonitor
from rlhf_cli.tracking import MetricsWriter


def iteration_metrics(
    acc: Any,
    rollout: Rollout,
    kl: torch.Tensor | None,
    rewards: torch.Tensor,
    returns: torch.Tensor | None,
    kl_coef: float,
    stats: dict[str, float],
) -> dict[str, float]:
    """The iteration's numbers over the global batch; the critic's when `returns` is given, the
    KL to the reference when `kl` is (no reference ran at β = 0)."""
    mask = rollout.response_mask
    reward_mean, reward_std = gather_mean_std(acc, rollout.scores)
    metrics = {
        "env/reward_mean": reward_mean,
        "env/reward_std": reward_std,
        "env/raw_score_mean": gather_mean_std(acc, rollout.raw_scores)[0],
        "objective/kl_coef": kl_coef,
        "objective/entropy": 0.0,
        "ppo/mean_non_score_reward": gather_mean_std(
            acc, (rewards.sum(1) - rollout.scores).detach()
        )[0],
        "response/length_mean": gather_mean_std(acc, mask.sum(1).float())[0],
        "response/ended_frac": gather_mean_std(acc, rollout.ended.float())[0],
        "reward/truncated_inputs": float(
            acc.reduce(torch.tensor(float(rollout.n_truncated), device=acc.device), "sum")
        ),
    }
    for key, value in rollout.reward_metrics.items():  # shares of equal batches: their mean
        metrics[key] = float(acc.reduce(torch.tensor(value, device=acc.device), "mean"))
    if kl is not None:
        metrics["objective/kl"] = gather_mean_std(acc, kl.sum(1))[0]
    if returns is not None:
        reduce_sum = global_sum(acc)
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


def finite(metrics: dict[str, float]) -> bool:
    keys = ("env/reward_mean", "objective/kl", "ppo/loss/total")
    return all(torch.isfinite(torch.tensor(metrics.get(k, 0.0))) for k in keys)


def progress_info(metrics: dict[str, float]) -> str:
    kl = f"kl {metrics['objective/kl']:.3f}  " if "objective/kl" in metrics else ""
    return f"reward {metrics['env/reward_mean']:+.3f}  {kl}β {metrics['objective/kl_coef']:.4f}"


@dataclass
class RunLogs:
    """The main process's record of the run (other processes keep `history` alone: the
    health rules and the summary read it)."""

    writer: MetricsWriter  # metrics.jsonl
    samples: MetricsWriter  # samples.jsonl
    console: Console
    warn: Callable[[str], None]  # into the manifest's warnings
    log_every: int
    health: HealthMonitor = field(default_factory=HealthMonitor)
    history: list[dict[str, Any]] = field(default_factory=list)

    def record(
        self,
        acc: Any,
        iteration: int,
        metrics: dict[str, float],
        rollout: Rollout,
        kl: torch.Tensor | None,
    ) -> None:
        """metrics.jsonl and the trackers, the truncation warning, health rules, and every
        `log_every` iterations the console block and samples.jsonl."""
        self.writer.log(metrics, step=iteration)
        acc.log(metrics, step=iteration)
        if rollout.n_truncated and "reward_truncation" not in self.health.seen:
            self.health.seen.add("reward_truncation")
            self.warn(
                f"iteration {iteration}: {rollout.n_truncated} of "
                f"{len(rollout.prompts)} reward inputs were longer than "
                "reward.max_length and truncated (reward/truncated_inputs counts them "
                "each iteration)"
            )
        for message in self.health.check(metrics, iteration, self.history):
            self.console.print(f"[yellow]health[/]: {message}", markup=True)
            self.warn(message)
        if iteration % self.log_every == 0 or iteration == 1:
            self.block(iteration, metrics, rollout)
            self.write_samples(iteration, rollout, kl)

    def block(self, iteration: int, m: dict[str, float], rollout: Rollout) -> None:
        """The guide's every-N-iterations health block, with a sample prompt and response;
        each value with a healthy band (`health.RANGES`) is marked ok or check."""

        first = self.history[0] if self.history else {}

        def mark(key: str) -> str:
            healthy = None
            if key in RANGES and key in m:
                healthy = RANGES[key].healthy_now(m[key], first.get(key))
            return {True: " [green]ok[/]", False: " [yellow]check[/]", None: ""}[healthy]

        c = self.console
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
            value = format(m[key], fmt) if key in m else "—"  # none: no critic, or β = 0
            c.print(f"  {label + ':':<15}{value}{mark(key)}")
        c.print(f"  Sample prompt:   {rollout.prompts[0][:60]}", markup=False)
        c.print(f"  Sample response: {rollout.texts[0][:120]}", markup=False)

    def write_samples(self, iteration: int, rollout: Rollout, kl: torch.Tensor | None) -> None:
        """The guide: read 10 actual generated responses every so often (their KL to the
        reference when it was measured)."""
        for i in range(min(10, len(rollout.prompts))):
            sample = {
                "prompt": rollout.prompts[i],
                "response": rollout.texts[i],
                "score": float(rollout.scores[i]),
            }
            if kl is not None:
                sample["kl"] = float(kl[i].sum())
            self.samples.log(sample, step=iteration)

    def close(self) -> None:
        self.writer.close()
        self.samples.close()


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """First-fifth vs last-fifth mean reward, the final KL (when measured) and β, the last
    held-out evaluation's `eval/*` numbers, and with a judge how many evaluations flagged
    over-optimisation."""
    if not history:
        return {}
    fifth = max(1, len(history) // 5)
    first = [h["env/reward_mean"] for h in history[:fifth]]
    last = [h["env/reward_mean"] for h in history[-fifth:]]
    evals = [h for h in history if "eval/reward_mean" in h]
    measured = "objective/kl" in history[-1]  # no KL without a reference forward (β = 0)
    judged = [h["audit/overoptimization"] for h in history if "audit/overoptimization" in h]
    return {
        **({"overoptimization_flags": int(sum(judged))} if judged else {}),
        **({k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}),
        **({"kl_final": history[-1]["objective/kl"]} if measured else {}),
        "iterations": history[-1]["iteration"],
        "reward_first_fifth": sum(first) / len(first),
        "reward_last_fifth": sum(last) / len(last),
        "kl_coef_final": history[-1]["objective/kl_coef"],
        "iteration_s_median": sorted(h["time/iteration_s"] for h in history)[len(history) // 2],
    }
