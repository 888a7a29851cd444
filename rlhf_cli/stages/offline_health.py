"""The offline methods' health table: what goes wrong in DPO-style training, each sign with its
fix, checked on the stage's logged training rows when it ends, printed and recorded in the
manifest (`health`). The rows are PPO's `health.Rule`s, read the same way (value, step, history);
`docs/troubleshooting.md` holds the table (`rules_markdown`, checked by a test).

The signs, from what users of TRL and LLaMA-Factory report: margins that do not rise (chosen and
rejected swapped, LLaMA-Factory #6050), both answers' log-probs falling (likelihood
displacement: the policy moves mass to answers in neither column), a loss stuck at log 2 with
identical logits (the policy is still the reference, TRL #1236, #2553), accuracies at chance,
and the drift from the reference growing.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console

from rlhf_cli.ppo import health
from rlhf_cli.ppo.health import History, Rule
from rlhf_cli.record import StageRecord
from rlhf_cli.tracking import read_metrics

MIN_ROWS = 4  # logged training rows before a trend is read: two halves of two
SAME = 1e-6  # |reward| under this: the policy's log-prob is the reference's
KL_LIMIT = 10.0  # nats per answer of drift from the reference that a rising trend must pass


def _halves(history: History, metric: str) -> tuple[float, float] | None:
    """(mean of the first half, mean of the second half) of the rows' `metric`; None with
    fewer than `MIN_ROWS` values."""
    values = [row[metric] for row in history if metric in row]
    if len(values) < MIN_ROWS:
        return None
    half = len(values) // 2
    return sum(values[:half]) / half, sum(values[-half:]) / half


def _not_rising(metric: str) -> Any:
    def fires(value: float, step: int, history: History) -> bool:
        halves = _halves(history, metric)
        return halves is not None and halves[1] <= halves[0]

    return fires


def _both_falling(value: float, step: int, history: History) -> bool:
    chosen, rejected = _halves(history, "logps/chosen"), _halves(history, "logps/rejected")
    return bool(chosen and rejected) and chosen[1] < chosen[0] and rejected[1] < rejected[0]


def _policy_is_reference(value: float, step: int, history: History) -> bool:
    sides = ("rewards/chosen", "rewards/rejected")
    rows = [row for row in history if all(side in row for side in sides)]
    return len(rows) >= 2 and all(abs(row[side]) < SAME for row in rows for side in sides)


def _chance(value: float, step: int, history: History) -> bool:
    halves = _halves(history, "rewards/accuracies")
    return halves is not None and halves[1] <= 0.55


def _drift_growing(value: float, step: int, history: History) -> bool:
    halves = _halves(history, "kl")
    return halves is not None and halves[1] > halves[0] and value > KL_LIMIT


RULES = [
    Rule(
        "margins_flat",
        "rewards/margins",
        "the reward margin (chosen minus rejected) did not rise: its second half's mean is not "
        "above its first's",
        "Check that chosen and rejected are not swapped (the source's `columns`); raise the "
        "learning rate or the epochs",
        _not_rising("rewards/margins"),
    ),
    Rule(
        "likelihood_displacement",
        "logps/chosen",
        "the chosen and the rejected answers' log-probs both fell (likelihood displacement: the "
        "mass went to answers in neither column)",
        "Add the chosen answers' NLL (dpo.loss_type: [sigmoid, sft]; ORPO has it), lower the "
        "learning rate, or raise β",
        _both_falling,
    ),
    Rule(
        "accuracy_chance",
        "rewards/accuracies",
        "the reward accuracy stayed at chance (≤ 0.55 over the second half)",
        "Check the pairs carry a preference (`rlhf validate --data`; chosen and rejected not "
        "swapped); raise the learning rate",
        _chance,
    ),
]
# only where the rewards are log-ratios to a reference (DPO, KTO)
REFERENCE_RULES = [
    Rule(
        "policy_is_reference",
        "loss",
        "the loss stuck at its start (log 2 for DPO's sigmoid) with logits identical to the "
        "reference's: every logged reward is 0",
        "Raise the learning rate (no step moved the weights); check the reference is frozen "
        "(a reference trained with the policy stays equal to it)",
        _policy_is_reference,
    ),
    Rule(
        "kl_growing",
        "kl",
        f"the drift from the reference (KL, nats per answer) kept growing, above {KL_LIMIT:g}",
        "Raise β, lower the learning rate, or train fewer epochs",
        _drift_growing,
    ),
]


def check(history: History, reference: bool) -> list[dict[str, Any]]:
    """The rules that fire on the training rows `history`, each read at its metric's last
    value: kind, metric, step, value and the message with its fix."""
    fired = []
    for rule in RULES + (REFERENCE_RULES if reference else []):
        rows = [row for row in history if rule.metric in row]
        if not rows:
            continue
        value, step = float(rows[-1][rule.metric]), int(rows[-1].get("step", len(rows)))
        if rule.fires(value, step, history):
            message = f"step {step}: {rule.danger} ({rule.metric} = {value:.4g}). Fix: {rule.fix}"
            fired.append(
                {
                    "kind": rule.kind,
                    "metric": rule.metric,
                    "step": step,
                    "value": value,
                    "message": message,
                }  # fmt: skip
            )
    return fired


def with_kl(history: History, beta: float) -> History:
    """The rows with `kl` where TRL logs none (DPO): the mean log-ratio of the reference to the
    policy on the batch's chosen and rejected answers, -(reward chosen + reward rejected) / 2β
    (the rewards are β × the policy's log-ratio), an estimate of the drift on the data's answers;
    KTO logs its own batch estimate."""
    sides = ("rewards/chosen", "rewards/rejected")
    return [
        {**row, "kl": -(row[sides[0]] + row[sides[1]]) / (2 * beta)}
        if "kl" not in row and all(side in row for side in sides)
        else row
        for row in history
    ]


def report_health(record: StageRecord, console: Console, reference: bool, beta: float) -> None:
    """The table checked on the stage's logged training rows (not the held-out evaluations),
    printed and recorded in the manifest's `health` (empty: nothing fired)."""
    rows = read_metrics(record.dir / "metrics.jsonl")
    history = [row for row in rows if "loss" in row and not math.isnan(row["loss"])]
    fired = check(with_kl(history, beta) if reference else history, reference)
    for item in fired:
        console.print(f"[yellow]health[/]: {item['message']}", markup=True)
    record.manifest["health"] = fired  # type: ignore[typeddict-unknown-key]


def rules_markdown() -> str:
    """The table of `docs/troubleshooting.md`'s offline section."""
    return health.rules_markdown(RULES + REFERENCE_RULES)
