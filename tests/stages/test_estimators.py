"""`ppo.advantage_estimator` on the tiny recipe: each critic-free estimator completes, builds
and saves no value model, and learns (the issue's bar: the last fifth's mean training reward
above the first iteration's by half that iteration's reward std). GRPO runs with its own
placement of the KL: k3 in the loss, weighted by π/π_old (`kl_importance_weight`, the default).

Each run also learns with one of the loss options the field pairs with it, so they cost no run
of their own: GRPO with its paper's per-response token mean; RLOO as DAPO trains (token mean,
clip-higher, no KL: β = 0, so no reference forward at all); REINFORCE++ with Dr. GRPO's
constant length normalisation and TRL's temperature-only log-prob support."""

from __future__ import annotations

import pytest
from rich.console import Console

from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
RUNS = {
    "rloo": {"num_generations": 4, "eval_every": 5, "cliprange_high": 0.28,
             "init_kl_coef": 0.0, "adaptive_kl": False},
    # bench/learn.json's best grpo point (lr 1e-3, beta 0.02): on today's tiny data, where the
    # reward model scores tone alone, the recipe's 7e-4 and 0.05 gain +0.21 in 15 iterations,
    # short of half the first batch's spread (0.23)
    "grpo": {"num_generations": 4, "kl_in": "loss", "kl_estimator": "k3",
             "loss_aggregation": "seq_mean_token_mean", "learning_rate": 1.0e-3,
             "init_kl_coef": 0.02},
    "reinforce_pp": {"kl_estimator": "k2", "loss_aggregation": "seq_mean_token_sum_norm",
                     "logprob_support": "full"},
}  # fmt: skip


def _count_reference_forwards_in_rollouts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts every use of the reference model inside the rollouts (the held-out evaluation's
    own reference answers are not counted)."""
    from rlhf_cli.modeling import Reference
    from rlhf_cli.ppo import loop

    count, inside = {"forwards": 0}, []
    real_collect, real_model = loop.collect_rollout, Reference.model

    def collect(*args, **kwargs):
        inside.append(True)
        try:
            return real_collect(*args, **kwargs)
        finally:
            inside.pop()

    def model(self):
        count["forwards"] += bool(inside)
        return real_model(self)

    monkeypatch.setattr(loop, "collect_rollout", collect)
    monkeypatch.setattr(Reference, "model", model)
    return count


@pytest.mark.parametrize("estimator", list(RUNS))
def test_each_critic_free_estimator_learns(
    estimator, ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    from rlhf_cli.stages.ppo import run_ppo

    ppo = {"iterations": 15, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 2,
           "save_freq": 15, "log_every": 5, "generation": {"top_p": 0.9},
           "advantage_estimator": estimator, **RUNS[estimator]}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    reference = _count_reference_forwards_in_rollouts(monkeypatch)
    manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and len(rows) == 15
    last = sum(r["env/reward_mean"] for r in rows[-3:]) / 3
    first, spread = rows[0]["env/reward_mean"], rows[0]["env/reward_std"]
    assert last > first + spread / 2, (first, spread, [r["env/reward_mean"] for r in rows])
    assert "value_head" not in manifest["outputs"]
    assert not any(k.startswith("ppo/val/") or k == "ppo/loss/value" for k in rows[0])
    assert ("ppo/loss/kl" in rows[0]) == (estimator == "grpo")
    # no KL (β = 0): no reference forward in any rollout and no objective/kl; the held-out
    # evaluation still measures the drift (eval/kl). Otherwise one per rollout mini-batch.
    no_kl = RUNS[estimator].get("init_kl_coef") == 0
    assert reference["forwards"] == (0 if no_kl else 15 * 32 // 8)
    assert all(("objective/kl" in r) != no_kl for r in rows)
    assert ("kl_final" in manifest["metrics"]) != no_kl
    # with the temperature-only support the mismatch check still compares like with like
    assert max(r["rollout/logprob_mismatch"] for r in rows) < 5e-2
    # the held-out evaluation (tiny recipe: 20% of the prompts) every eval_every and at the end
    every = RUNS[estimator].get("eval_every", 10)
    evaluated = [r["iteration"] for r in rows if "eval/win_rate" in r]
    assert evaluated == sorted({*range(every, 16, every), 15})
    assert all("eval/kl" in r for r in rows if "eval/win_rate" in r)
    assert manifest["prompts"] == {"train": 160, "heldout": 40}
    final = {k: v for k, v in rows[-1].items() if k.startswith("eval/")}
    assert final and all(manifest["metrics"][k] == v for k, v in final.items())
    assert 0.0 <= final["eval/win_rate"] <= 1.0 and final["eval/length_mean"] > 0


def test_a_critic_free_run_resumes_to_the_uninterrupted_numbers(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    """No value weights are written or expected, and the groups are drawn alike after resume."""
    import shutil

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo

    ppo = {"iterations": 4, "batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 1,
           "save_freq": 2, "log_every": 5, "advantage_estimator": "grpo",
           "num_generations": 4, "eval_every": None}  # fmt: skip
    whole = ppo_recipe(pipeline, tmp_path / "whole", small_recipe, ppo)
    run_ppo(whole, QUIET)
    done = read_metrics(RunDir.for_recipe(whole).stage_dir("ppo") / "metrics.jsonl")
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    text = (tmp_path / "cut" / "recipe.yaml").read_text()
    (tmp_path / "cut" / "recipe.yaml").write_text(text.replace("whole", "cut"))
    cut = load_recipe(tmp_path / "cut" / "recipe.yaml")
    stage = RunDir.for_recipe(cut).stage_dir("ppo")
    shutil.rmtree(stage / "checkpoints" / "iter_00004")
    assert not (stage / "value_head.safetensors").exists()
    run_ppo(cut, QUIET, resume=True)
    again = read_metrics(stage / "metrics.jsonl")
    assert [r["iteration"] for r in again] == [1, 2, 3, 4]
    for mine, theirs in zip(again[2:], done[2:], strict=True):
        for key in ("env/reward_mean", "objective/kl", "ppo/loss/policy", "ppo/loss/total"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
