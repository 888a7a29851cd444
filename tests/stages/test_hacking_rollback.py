"""`audit.on_hacking: rollback | stop` and the best checkpoint, on the tiny run: an in-training
audit that flags (every answer of 2+ words counts as verbose) at iteration 3 restores the exact
state of the checkpoint written before it (iteration 2: trained weights, optimiser moments, the
sampler's RNG) with the recipe's correction (β at the flag × 2, learning rate × 0.5), and the run
goes on; the next flag, past `max_rollbacks`, stops it with exit 1 naming the best checkpoint, which
`rlhf merge --checkpoint best` then merges."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from rlhf_cli.errors import HackingDetected
from rlhf_cli.modeling import trainable_state
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)


def test_rollback_restores_the_checkpoint_corrects_and_then_stops_at_the_best(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    import rlhf_cli.ppo.run as run_module
    from rlhf_cli.stages.merge import run_merge
    from rlhf_cli.stages.ppo import run_ppo

    ppo = {"iterations": 6, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1,
           "save_freq": 1, "log_every": 10, "eval_every": 1, "learning_rate": 1e-3,
           "generation": {"max_new_tokens": 12}}  # fmt: skip
    audit = {"every": 3, "samples": 1, "verbosity_threshold": 0.0, "verbosity_words": 1,
             "on_hacking": "rollback", "max_rollbacks": 1,
             "generation": {"max_new_tokens": 8}}  # fmt: skip
    recipe = ppo_recipe(
        pipeline, tmp_path, small_recipe, ppo, audit=audit,
        data={"prompts": {"eval_fraction": 0.2}},
    )  # fmt: skip
    seen: dict[str, Any] = {}
    real = run_module.roll_back

    def spy(run, iteration, names):
        seen["kl_at_flag"] = run.state.kl_ctl.value
        out = real(run, iteration, names)
        actor = run.accelerator.unwrap_model(run.models.actor)
        first = next(iter(run.state.optimizer.state.values()))
        seen.update(
            iteration=iteration, weights=trainable_state(actor.policy),
            moment=first["exp_avg"].clone(), lr=run.state.optimizer.param_groups[0]["lr"],
            kl=run.state.kl_ctl.value, sampler=run.state.sampler.get_state().clone(), out=out,
        )  # fmt: skip
        return out

    monkeypatch.setattr(run_module, "roll_back", spy)
    with pytest.raises(HackingDetected) as stopped:
        run_ppo(recipe, QUIET)

    stage = RunDir.for_recipe(recipe).stage_dir("ppo")
    at_2 = stage / "checkpoints" / "iter_00002"
    assert seen["iteration"] == 3 and seen["out"] == {
        "audit/rollback": 1.0, "audit/rolled_back_to": 2.0,
    }  # fmt: skip
    saved = load_file(at_2 / "policy.safetensors")
    assert saved.keys() == seen["weights"].keys()
    assert all(torch.equal(saved[k], seen["weights"][k]) for k in saved)
    moments = torch.load(at_2 / "optimizer.pt", weights_only=False)["state"]
    assert torch.equal(next(iter(moments.values()))["exp_avg"], seen["moment"])
    assert torch.equal(
        torch.load(at_2 / "rng_0.pt", weights_only=False)["sampler"], seen["sampler"]
    )
    assert seen["kl"] == pytest.approx(2.0 * seen["kl_at_flag"])  # β in force at the flag, × 2
    assert seen["lr"] == pytest.approx(0.5 * 1e-3)

    # the flag at iteration 6 is past max_rollbacks: stop, exit 1, naming the best checkpoint
    rows = read_metrics(stage / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.get("audit/rollback", 0.0) for r in rows] == [0, 0, 1, 0, 0, 0]
    best = json.loads((stage / "checkpoints" / "best.json").read_text())
    evals = {r["iteration"]: r["eval/reward_mean"] for r in rows if r["iteration"] not in (3, 6)}
    assert best["iteration"] == max(evals, key=evals.get) and best["metric"] == "eval/reward_mean"
    assert stopped.value.exit_code == 1
    message = str(stopped.value)
    assert "iteration 6: the audit flagged verbosity after 1 rollback(s)" in message
    assert f"the best checkpoint is {best['checkpoint']} (iteration {best['iteration']}" in message
    manifest = RunDir.for_recipe(recipe).read_manifest("ppo")
    assert manifest["best"] == best and len(manifest["rollbacks"]) == 1
    assert manifest["rollbacks"][0]["restored"] == 2

    merged = run_merge(recipe, QUIET, checkpoint="best")
    assert merged["status"] == "completed" and merged["merged_from"]["checkpoint"] == "best"
