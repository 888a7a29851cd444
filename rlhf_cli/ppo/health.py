"""The guide's Part 9 diagnostic table as data: the one place its healthy ranges and danger signs
live. The console block, `rlhf report`'s shaded bands, the health check below and the table in
`docs/metrics.md` (checked by a test) all read `RANGES`.

Each danger rule fires at most once per run: its warning and the guide's fix are printed and
recorded in the manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

History = list[dict[str, Any]]


@dataclass(frozen=True)
class Range:
    """One row of the guide's table. `band` is the numeric healthy range (None where the guide
    describes a trend instead), `low` / `high` open-ended when None; a `relative` band is in
    units of the run's first-iteration value of the metric."""

    metric: str
    healthy: str
    danger: str
    fix: str
    band: tuple[float | None, float | None] | None = None
    relative: bool = False

    def limits(self, first: float | None = None) -> tuple[float | None, float | None] | None:
        """The band in the metric's units (None without a band, or when a relative band has
        no first value)."""
        if self.band is None or not self.relative:
            return self.band
        if first is None:
            return None
        low, high = self.band
        return (None if low is None else low * first, None if high is None else high * first)

    def healthy_now(self, value: float, first: float | None = None) -> bool | None:
        """Whether `value` lies in the band (None when the row has no numeric band); `first`:
        the run's first-iteration value, for a relative band."""
        band = self.limits(first)
        if band is None:
            return None
        low, high = band
        return (low is None or value >= low) and (high is None or value <= high)


RANGES: dict[str, Range] = {
    r.metric: r
    for r in [
        Range(
            "env/reward_mean",
            "steadily increasing",
            "flat or decreasing after iteration 50",
            "Check reward model, reduce KL coef",
        ),
        Range(
            "objective/kl",
            "grows slowly, stays < 15",
            "jumps above 25 suddenly",
            "Increase β, reduce learning rate",
            band=(0.0, 15.0),
        ),
        Range(
            "ppo/loss/policy",
            "decreasing, stable oscillation",
            "wild swings, spikes every few iterations",
            "Reduce LR, reduce mini_batch_size",
        ),
        Range(
            "ppo/loss/value",
            "decreasing over the first 100 iterations",
            "stays above 2.0 after iteration 100",
            "Increase c₁ (ppo.vf_coef), more ppo_epochs",
        ),
        Range(
            "objective/clipfrac",
            "0.10 – 0.35",
            "> 0.5 or < 0.02",
            "High: reduce LR. Low: reduce KL coef",
            band=(0.10, 0.35),
        ),
        # The guide's 3.0 and 1.0 nats are a base model's at T 0.8 (6.2 at its iteration 0);
        # an instruct model starts under 1 nat per token. So the band is the guide's shares of
        # the run's own start: above half of it, collapse below a sixth.
        Range(
            "objective/entropy",
            "slow decrease, stays above half its first value (the guide: 3.0 from 6.2)",
            "collapses below a sixth of its first value quickly (the guide: < 1.0)",
            "Increase c₂ (entropy coefficient, ppo.entropy_coef)",
            band=(0.5, None),
            relative=True,
        ),
    ]
}


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
    before = [h["env/reward_mean"] for h in history[-2 * window : -window]]
    return sum(recent) / window < sum(before) / window


def _rule(
    kind: str,
    metric: str,
    danger: str,
    fires: Callable[[float, int, History], bool],
    fix: str | None = None,
) -> Rule:
    return Rule(kind, metric, danger, fix or RANGES[metric].fix, fires)


RULES = [
    _rule("kl_high", "objective/kl", "KL jumped above 25", lambda v, it, h: v > 25),
    _rule(
        "clipfrac_high",
        "objective/clipfrac",
        "clip fraction above 0.5",
        lambda v, it, h: v > 0.5,
        fix="reduce LR",
    ),
    _rule(
        "clipfrac_low",
        "objective/clipfrac",
        "clip fraction below 0.02 after iteration 10",
        lambda v, it, h: it >= 10 and v < 0.02,
        fix="reduce KL coef",
    ),
    _rule(
        "entropy_collapse",
        "objective/entropy",
        "entropy collapsed below a sixth of its first-iteration value",
        lambda v, it, h: bool(h) and v < h[0].get("objective/entropy", 0.0) / 6,
    ),
    _rule(
        "value_loss_high",
        "ppo/loss/value",
        "value loss above 2.0 after iteration 100",
        lambda v, it, h: it >= 100 and v > 2.0,
    ),
    _rule(
        "reward_falling",
        "env/reward_mean",
        "mean reward falling after iteration 50",
        _reward_falling,
    ),
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
                fired.append(
                    f"iteration {iteration}: {rule.danger} ({rule.metric} = "
                    f"{float(value):.4g}). Fix: {rule.fix}"
                )
        return fired


def _band_text(r: Range) -> str:
    if r.band is None:
        return "—"
    low, high = r.band
    unit = " × first value" if r.relative else ""
    if high is None:
        return f"≥ {low:g}{unit}"
    return f"≤ {high:g}{unit}" if low is None else f"{low:g} – {high:g}{unit}"


def ranges_markdown() -> str:
    """The table of `docs/metrics.md`'s "Healthy ranges" section."""
    lines = [
        "| metric (key here) | healthy | band checked | danger sign | fix |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r.metric}` | {r.healthy} | {_band_text(r)} | {r.danger} | {r.fix} |"
        for r in RANGES.values()
    ]
    return "\n".join(lines)


def rules_markdown(rules: list[Rule] = RULES) -> str:
    """A table of `docs/troubleshooting.md`: each warning of `rules` (the PPO loop's by
    default), the metric that shows it and the guide's fix."""
    lines = ["| warning (`kind`) | metric | when it fires | fix |", "|---|---|---|---|"]
    lines += [f"| `{r.kind}` | `{r.metric}` | {r.danger} | {r.fix} |" for r in rules]
    return "\n".join(lines)
