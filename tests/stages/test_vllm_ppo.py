"""PPO with the vLLM rollout engine (`ppo.generation.backend: vllm`) on the tiny recipe: it
completes, learns like the HF backend (the bar of test_ppo's learning test), and logs the
engine's log-prob mismatch; truncated importance sampling is on. `rlhf audit` and `rlhf compare`
with `audit.generation.backend: vllm` then answer, greedily, as the transformers backend does.
Runs where vLLM is installed (`make test-vllm`); skipped elsewhere."""

from __future__ import annotations

import pytest
from launching import SAMPLED, assert_same_numbers, launch, recipe_in, rows
from rich.console import Console

from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed (make test-vllm runs these)"
)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_ppo_on_the_vllm_engine_learns_and_audits(ppo_recipe, pipeline, tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    generation = {"top_p": 0.9, "backend": "vllm", "tis_cap": 2.0}
    ppo = {"iterations": 15, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 2,
           "save_freq": 15, "log_every": 5, "generation": generation}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    manifest = run_ppo(recipe, Console(stderr=True, quiet=True))
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and len(rows) == 15
    first = sum(r["env/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["env/reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last, [r["env/reward_mean"] for r in rows])
    mismatch = sorted(r["rollout/logprob_mismatch"] for r in rows)
    assert mismatch[len(mismatch) // 2] < 1e-3 and mismatch[-1] < 5e-2, mismatch

    # audit and compare sample through vLLM as well; greedy, they answer as transformers does
    from rlhf_cli.stages.audit import run_audit
    from rlhf_cli.stages.compare import run_compare

    def greedy_on(backend: str):
        gen = {"do_sample": False, "max_new_tokens": 24, "backend": backend}
        audit = recipe.audit.model_copy(
            update={"samples": 1, "generation": recipe.audit.generation.model_copy(update=gen)}
        )
        return recipe.model_copy(update={"audit": audit})

    quiet = Console(stderr=True, quiet=True)
    reports = {b: run_audit(greedy_on(b), quiet) for b in ("hf", "vllm")}
    assert reports["vllm"]["samples"] == reports["hf"]["samples"]
    for key in ("reward_policy_mean", "reward_reference_mean", "kl_to_reference"):
        assert abs(reports["vllm"][key] - reports["hf"][key]) < 1e-4, key
    assert reports["vllm"]["reward_policy_mean"] != reports["vllm"]["reward_reference_mean"]
    rows = {b: run_compare(greedy_on(b)) for b in ("hf", "vllm")}
    assert [(r["sft"], r["ppo"]) for r in rows["vllm"]] == [
        (r["sft"], r["ppo"]) for r in rows["hf"]
    ]
    assert any(r["sft"] != r["ppo"] for r in rows["vllm"])


def _on_vllm(tensor_parallel: int) -> dict:
    generation = {**SAMPLED["generation"], "backend": "vllm"}
    return {
        **SAMPLED,
        "generation": {**generation, "vllm": {"tensor_parallel_size": tensor_parallel}},
    }


@pytest.fixture(scope="module")
def one_process(ppo_recipe, pipeline, small_recipe, tmp_path_factory) -> RunDir:
    """The one-process run both layouts are compared with (run once for the module)."""
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo

    folder = tmp_path_factory.mktemp("one")
    alone = load_recipe(recipe_in(folder, ppo_recipe, pipeline, small_recipe, _on_vllm(1)))
    run_ppo(alone, Console(stderr=True, quiet=True))
    return RunDir.for_recipe(alone)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_two_processes_on_vllm_match_one_process(
    tensor_parallel, one_process, ppo_recipe, pipeline, small_recipe, tmp_path
):
    """Under `accelerate launch` every process joins its engine to the launcher's processes; with
    a tensor-parallel size of 2 both share one engine and sample their prompts together. Each
    row samples from its own seed, so the numbers (and the in-training audit's, on iteration 2)
    are the one-process run's (launching.py's tolerance)."""
    recipe_in(tmp_path / "two", ppo_recipe, pipeline, small_recipe, _on_vllm(tensor_parallel))
    run = launch("ddp", tmp_path / "two")
    assert_same_numbers(rows(run), rows(one_process))
