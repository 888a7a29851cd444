"""The guide's Part 9 diagnostic table as data, checked on every iteration.

Each rule fires at most once per run: its warning and the guide's fix are printed and recorded
in the manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

History = list[dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    kind: str
    metric: str
    danger: str
    fix: str
    fires: Callable[[float, int, History], bool]


def _reward_falling(value: float, iteration: int, history: History, window: int = 10) -> bool:
    """Mean reward of the last `window` iterations below the `window` before, after iter 50."""
    if iteration < 50 or len(history) < 2 * window:
        return False
    recent = [h["env/reward_mean"] for h in history[-window:]]
    before = [h["env/reward_mean"] for h in history[-2 * window: -window]]
    return sum(recent) / window < sum(before) / window


RULES = [
    Rule("kl_high", "objective/kl", "KL jumped above 25", "Increase β, reduce learning rate",
         lambda v, it, h: v > 25),
    Rule("clipfrac_high", "objective/clipfrac", "clip fraction above 0.5", "reduce LR",
         lambda v, it, h: v > 0.5),
    Rule("clipfrac_low", "objective/clipfrac", "clip fraction below 0.02 after iteration 10",
         "reduce KL coef",
         lambda v, it, h: it >= 10 and v < 0.02),
    Rule("entropy_collapse", "objective/entropy", "entropy collapsed below 1.0",
         "Increase c₂ (entropy coefficient, ppo.entropy_coef)", lambda v, it, h: v < 1.0),
    Rule("value_loss_high", "ppo/loss/value", "value loss above 2.0 after iteration 100",
         "Increase c₁ (ppo.vf_coef), more ppo_epochs", lambda v, it, h: it >= 100 and v > 2.0),
    Rule("reward_falling", "env/reward_mean", "mean reward falling after iteration 50",
         "Check reward model, reduce KL coef", _reward_falling),
]


class HealthMonitor:
    def __init__(self, already: list[str] | None = None):
        self.seen: set[str] = set(already or [])

    def check(self, metrics: dict[str, Any], iteration: int, history: History) -> list[str]:
        """Messages for rules that fire now for the first time."""
        fired = []
        for rule in RULES:
            value = metrics.get(rule.metric)
            if rule.kind in self.seen or value is None:
                continue
            if rule.fires(float(value), iteration, history):
                self.seen.add(rule.kind)
                fired.append(f"iteration {iteration}: {rule.danger} ({rule.metric} = "
                             f"{float(value):.4g}). Fix: {rule.fix}")
        return fired
