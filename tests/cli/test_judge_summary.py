"""`rlhf ppo`'s end-of-stage output shows the judge (`audit.judge`) beside the proxy: its last
held-out evaluation, the rollbacks and the best checkpoint; a run without a judge shows none."""

from __future__ import annotations

from rich.console import Console

from rlhf_cli import views

JUDGED = {
    "status": "completed",
    "dir": "runs/hackable-tiny/ppo",
    "metrics": {
        "eval/reward_mean": 1.25,
        "eval/judge_reward_mean": -0.125,
        "eval/judge_reward_reference_mean": -0.25,
        "eval/judge_win_rate": 0.625,
        "eval/reward_gain": 2.5,
        "eval/judge_reward_gain": 0.375,
        "eval/proxy_judge_gap": 2.125,
        "overoptimization_flags": 2,
    },
    "rollbacks": [{"iteration": 25, "restored": 20}],
    "best": {"iteration": 15, "checkpoint": "iter_00015", "metric": "eval/judge_reward_mean",
             "value": 0.5},
}  # fmt: skip


def shown(manifest: dict) -> str:
    out = Console(record=True, width=160)
    views.stage_summary(manifest, "rlhf ppo", out)
    return out.export_text()


def test_the_judge_block_shows_its_numbers_rollbacks_and_the_best_checkpoint() -> None:
    text = shown(JUDGED)
    assert "judge · last held-out evaluation" in text
    flat = " ".join(text.replace("│", " ").split())  # the table's borders and padding aside
    for row in ("Judge reward, policy  -0.1250", "Judge reward, SFT policy  -0.2500",
                "Judge win rate against SFT  62%", "Judge gain (σ of its SFT scores)  +0.375",
                "Proxy gain (σ of its SFT scores)  +2.500", "Proxy − judge gain  +2.125",
                "Overoptimization flagged  ⚠ 2 evaluation(s)", "25 → 20",
                "iter_00015 (eval/judge_reward_mean +0.5000)"):  # fmt: skip
        assert " ".join(row.split()) in flat, row


def test_no_judge_no_block() -> None:
    plain = {"status": "completed", "dir": "runs/tiny/ppo", "metrics": {"eval/reward_mean": 0.5}}
    assert "judge" not in shown(plain)
