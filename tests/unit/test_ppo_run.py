"""Around the PPO iteration (ppo/run.py): the live audit and the held-out evaluation run in the
rollout's precision, on every process, and only the main process's numbers are kept."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from rlhf_cli.ppo.run import heldout_eval, live_audit, react_to_hacking

REPORT = {
    "hacking_detected": False,
    "flags": [],
    "verbosity_score": 0.1,
    "sycophancy_score": 0.0,
    "repetition_score": 0.0,
    "avg_response_len": 12.0,
}


class FakeAccelerator:
    is_main_process = True
    num_processes = 1
    device = "cpu"

    def __init__(self) -> None:
        self.in_autocast = False

    @contextlib.contextmanager
    def autocast(self):
        self.in_autocast = True
        try:
            yield
        finally:
            self.in_autocast = False

    def reduce(self, tensor: Any, op: str) -> Any:
        return tensor


def fake_run(seen: dict[str, Any], report: dict[str, Any] = REPORT) -> Any:
    acc = FakeAccelerator()
    engine = SimpleNamespace(gathered=lambda actor: contextlib.nullcontext(actor))

    def audit(actor: Any, iteration: int) -> dict[str, Any]:
        seen["audit"] = acc.in_autocast
        return report

    def evaluate(actor: Any, iteration: int) -> dict[str, float]:
        seen["evaluate"] = acc.in_autocast
        return {"eval/reward_mean": 1.0}

    recipe = SimpleNamespace(
        audit=SimpleNamespace(every=2, kl_coef_step=0.05, on_hacking="raise_beta"),
        ppo=SimpleNamespace(iterations=4, eval_every=None),
    )
    return SimpleNamespace(
        recipe=recipe,
        accelerator=acc,
        models=SimpleNamespace(engine=engine, actor=object()),
        hooks=SimpleNamespace(audit=audit, evaluate=evaluate),
        state=SimpleNamespace(
            kl_ctl=SimpleNamespace(value=0.1, raise_by=lambda step: seen.setdefault("raised", step))
        ),
        logs=SimpleNamespace(warn=lambda message: seen.setdefault("warned", message)),
    )


@pytest.mark.parametrize("hook", ["audit", "evaluate"])
def test_live_audit_and_heldout_eval_sample_under_autocast(hook: str) -> None:
    seen: dict[str, bool] = {}
    run = fake_run(seen)
    metrics = live_audit(run, 2)[0] if hook == "audit" else heldout_eval(run, 4)
    assert metrics and seen == {hook: True}


@pytest.mark.parametrize(
    ("flags", "raised"),
    [(["brevity"], False), (["verbosity"], True), (["repetition", "brevity"], True)],
)
def test_only_the_guides_flags_raise_beta(flags: list[str], raised: bool) -> None:
    """A length collapse is flagged and logged, but a larger β would shorten answers further."""
    seen: dict[str, Any] = {}
    report = {**REPORT, "flags": flags, "hacking_detected": True, "length_ratio": 0.25}
    run = fake_run(seen, report)
    metrics, guide_flags = live_audit(run, 2)
    assert metrics["audit/hacking_detected"] == 1.0 and metrics["audit/length_ratio"] == 0.25
    assert seen.pop("warned") == f"iteration 2: the audit flagged {', '.join(flags)}"
    assert react_to_hacking(run, 2, guide_flags) == {}
    assert ("raised" in seen) is raised
    if raised:
        assert seen["warned"] == f"iteration 2: β raised to 0.1000 ({', '.join(guide_flags)})"


def test_a_clean_audit_raises_nothing_and_warns_nothing() -> None:
    seen: dict[str, Any] = {}
    run = fake_run(seen)
    metrics, flags = live_audit(run, 2)
    assert metrics["audit/hacking_detected"] == 0.0 and "audit/length_ratio" not in metrics
    assert flags == [] and react_to_hacking(run, 2, flags) == {}
    assert "raised" not in seen and "warned" not in seen
