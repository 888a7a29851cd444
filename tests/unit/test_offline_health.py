"""The offline methods' health table: each rule fires on a hand-made history of logged training
rows that shows its sign, and none fires on a healthy one."""

from __future__ import annotations

import math

import pytest

from rlhf_cli.stages.offline_health import check, rules_markdown, with_kl

BETA = 0.1


def rows(**columns: list[float]) -> list[dict[str, float]]:
    """Training rows, step 1 on, from one list per metric."""
    n = len(next(iter(columns.values())))
    return [
        {"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in columns.items()}}
        for i in range(n)
    ]


# margins rise, accuracies climb, chosen log-probs hold while rejected fall, drift stays small
HEALTHY = dict(
    loss=[0.693, 0.66, 0.61, 0.55, 0.50, 0.46],
    rewards__chosen=[0.0, 0.01, 0.02, 0.02, 0.03, 0.03],
    rewards__rejected=[0.0, -0.03, -0.07, -0.12, -0.18, -0.22],
    rewards__margins=[0.0, 0.04, 0.09, 0.14, 0.21, 0.25],
    rewards__accuracies=[0.5, 0.6, 0.7, 0.8, 0.85, 0.9],
    logps__chosen=[-40.0, -39.9, -39.8, -39.8, -39.7, -39.7],
    logps__rejected=[-45.0, -45.3, -45.7, -46.2, -46.8, -47.2],
)


def fired(history: list[dict[str, float]], reference: bool = True) -> set[str]:
    return {item["kind"] for item in check(with_kl(history, BETA), reference)}


def test_a_healthy_history_fires_nothing() -> None:
    assert fired(rows(**HEALTHY)) == set()


@pytest.mark.parametrize(
    ("changes", "kind"),
    [
        # chosen and rejected swapped: the margin sinks
        ({"rewards__margins": [0.0, -0.02, -0.05, -0.08, -0.1, -0.12]}, "margins_flat"),
        # both answers lose mass
        ({"logps__chosen": [-40.0, -41.0, -43.0, -45.0, -48.0, -50.0]}, "likelihood_displacement"),
        ({"rewards__accuracies": [0.5, 0.5, 0.55, 0.5, 0.45, 0.55]}, "accuracy_chance"),
        # the policy is the reference: rewards 0, the loss at log 2
        (
            {
                "loss": [math.log(2)] * 6,
                "rewards__chosen": [0.0] * 6,
                "rewards__rejected": [0.0] * 6,
            },
            "policy_is_reference",
        ),
        # both answers drift far from the reference: -(rc + rr) / 2β grows past 10 nats
        (
            {
                "rewards__chosen": [0.0, -0.5, -1.0, -1.5, -2.0, -2.5],
                "rewards__rejected": [0.0, -0.6, -1.2, -1.8, -2.4, -3.0],
            },
            "kl_growing",
        ),
    ],
)
def test_each_rule_fires_on_its_sign(changes: dict[str, list[float]], kind: str) -> None:
    assert kind in fired(rows(**{**HEALTHY, **changes}))


def test_the_kl_rule_reads_ktos_own_kl_and_the_message_names_the_fix() -> None:
    history = rows(**HEALTHY, kl=[0.0, 3.0, 6.0, 9.0, 11.0, 14.0])
    (item,) = [i for i in check(history, reference=True) if i["kind"] == "kl_growing"]
    assert item["step"] == 6 and item["value"] == 14.0
    assert item["message"].startswith("step 6: the drift from the reference")
    assert item["message"].endswith("Fix: Raise β, lower the learning rate, or train fewer epochs")


def test_reference_free_methods_skip_the_reference_rules() -> None:
    # ORPO's and SimPO's rewards are β × log-probs, never the log-ratio to a reference
    still = {"rewards__chosen": [0.0] * 6, "rewards__rejected": [0.0] * 6}
    assert "policy_is_reference" in fired(rows(**{**HEALTHY, **still}))
    assert fired(rows(**{**HEALTHY, **still}), reference=False) == set()


def test_too_few_rows_read_no_trend() -> None:
    short = {k: v[:3] for k, v in HEALTHY.items()}
    short["rewards__margins"] = [0.2, 0.1, 0.0]
    assert fired(rows(**short)) == set()


def test_troubleshooting_holds_the_table() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "troubleshooting.md").read_text()
    assert rules_markdown() in text
