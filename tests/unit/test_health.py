"""The guide's Part 9 table: each danger sign fires once, with the guide's fix."""

from rlhf_cli.ppo.health import HealthMonitor

HEALTHY = {
    "objective/kl": 5.0,
    "objective/clipfrac": 0.2,
    "objective/entropy": 4.0,
    "ppo/loss/value": 0.5,
    "env/reward_mean": 1.0,
}


def test_healthy_metrics_fire_nothing():
    assert HealthMonitor().check(HEALTHY, 150, [HEALTHY] * 30) == []


def test_each_danger_fires_once_with_its_fix():
    monitor = HealthMonitor()
    bad = {**HEALTHY, "objective/kl": 30.0, "objective/entropy": 0.5}
    history = [HEALTHY, bad]  # entropy 4.0 at the first iteration
    first = monitor.check(bad, 5, history)
    assert len(first) == 2
    assert any("KL jumped above 25" in m and "Increase β, reduce learning rate" in m for m in first)
    assert any("Increase c₂" in m for m in first)
    assert monitor.check(bad, 6, history) == []  # once per kind of problem


def test_thresholds_that_depend_on_the_iteration():
    monitor = HealthMonitor()
    assert monitor.check({**HEALTHY, "ppo/loss/value": 3.0}, 99, []) == []
    assert "value loss above 2.0" in monitor.check({**HEALTHY, "ppo/loss/value": 3.0}, 100, [])[0]
    assert monitor.check({**HEALTHY, "objective/clipfrac": 0.01}, 9, []) == []
    assert "reduce KL coef" in monitor.check({**HEALTHY, "objective/clipfrac": 0.01}, 10, [])[0]
    falling = [{"env/reward_mean": 2.0}] * 10 + [{"env/reward_mean": 1.0}] * 10
    assert "Check reward model" in monitor.check(HEALTHY, 60, falling)[0]
    assert HealthMonitor(already=["kl_high"]).check({**HEALTHY, "objective/kl": 30.0}, 5, []) == []


def test_docs_table_is_the_code_table():
    from pathlib import Path

    from rlhf_cli.ppo.health import ranges_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert ranges_markdown() in doc.read_text(), "paste ranges_markdown() into docs/metrics.md"


def test_bands_say_what_the_guide_says():
    from rlhf_cli.ppo.health import RANGES

    kl, clip, entropy = (
        RANGES[k] for k in ("objective/kl", "objective/clipfrac", "objective/entropy")
    )
    assert (kl.healthy_now(14.9), kl.healthy_now(15.1)) == (True, False)
    assert (
        clip.healthy_now(0.10),
        clip.healthy_now(0.35),
        clip.healthy_now(0.36),
        clip.healthy_now(0.09),
    ) == (True, True, False, False)
    # relative to the run's first value: the guide's 3.0 of its 6.2 start is about half
    assert (entropy.healthy_now(3.1, first=6.2), entropy.healthy_now(3.09, first=6.2)) == (
        True,
        False,
    )
    assert entropy.healthy_now(0.5, first=0.9) is True  # an instruct model's start
    assert entropy.healthy_now(0.5) is None  # no first value yet: no verdict
    assert RANGES["env/reward_mean"].healthy_now(-5.0) is None  # a trend, not a band


def test_the_troubleshooting_table_is_the_rules_the_loop_checks():
    from pathlib import Path

    from rlhf_cli.ppo.health import rules_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
    assert rules_markdown() in doc.read_text(), "paste rules_markdown() into troubleshooting.md"


def test_entropy_collapse_is_measured_against_the_runs_own_start():
    from rlhf_cli.ppo.health import HealthMonitor

    def fired(first: float, now: float) -> list[str]:
        history = [{"objective/entropy": first}, {"objective/entropy": now}]
        return HealthMonitor().check(history[-1], 2, history)

    assert fired(0.8, 0.7) == []  # an instruct model at T 0.8 sits under 1 nat: healthy
    assert fired(6.2, 1.1) == []  # the guide's base model above its 1.0 line
    (message,) = fired(6.2, 1.0)
    assert "entropy collapsed below a sixth" in message and "ppo.entropy_coef" in message
    assert len(fired(0.8, 0.1)) == 1
