"""PPO with the vLLM rollout engine (`ppo.generation.backend: vllm`) on the tiny recipe: it
completes, learns like the HF backend (the bar of test_ppo's learning test), and logs the
engine's log-prob mismatch; truncated importance sampling is on. Runs where vLLM is installed
(`make test-vllm`); skipped elsewhere."""

from __future__ import annotations

import pytest
from rich.console import Console

from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed (make test-vllm runs these)"
)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_ppo_on_the_vllm_engine_learns(ppo_recipe, pipeline, tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    generation = {"top_p": 0.9, "backend": "vllm", "tis_cap": 2.0}
    ppo = {"iterations": 25, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 4,
           "save_freq": 25, "log_every": 5, "generation": generation}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    manifest = run_ppo(recipe, Console(stderr=True, quiet=True))
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and len(rows) == 25
    first = sum(r["env/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["env/reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    mismatch = sorted(r["rollout/logprob_mismatch"] for r in rows)
    assert mismatch[len(mismatch) // 2] < 1e-3 and mismatch[-1] < 5e-2, mismatch
