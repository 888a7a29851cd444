"""`rlhf ppo` with GRPO as its users run it on checkable answers: dynamic sampling (DAPO) and
sequence-level ratios (GSPO) on a tiny run whose rule reward scores 1 for every answer of half
the prompts (`kind: same`): the drop rate logged is the share of uniform groups among those the
rounds generated, counted from the reward function's own calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from rlhf_cli.recipe import load_recipe

QUIET = Console(stderr=True, quiet=True)
TINY = Path(__file__).resolve().parents[2] / "data" / "tiny"

RULE = """
import json

def rule(prompts, responses, kind, step):
    rewards = [1.0 if k == "same" else float(len(r) % 2) for k, r in zip(kind, responses)]
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"step": step, "rewards": rewards}}) + "\\n")
    return rewards
"""


@pytest.mark.slow
def test_dynamic_sampling_and_sequence_ratios_in_a_tiny_run(tmp_path, small_recipe):
    from rlhf_cli.rundir import RunDir
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    lines = (TINY / "prompts.jsonl").read_text().splitlines()[:16]
    rows = [{**json.loads(line), "kind": "same" if n % 2 else "varied"} for n, line in
            enumerate(lines)]  # fmt: skip
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "calls.jsonl"
    (tmp_path / "rule.py").write_text(RULE.format(log=str(log)))
    ppo = {"iterations": 2, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1,
           "save_freq": 2, "log_every": 1, "advantage_estimator": "grpo",
           "num_generations": 2, "dynamic_sampling": True, "dynamic_sampling_max_rounds": 3,
           "importance_ratio": "sequence", "generation": {"max_new_tokens": 8}}  # fmt: skip
    recipe = load_recipe(
        small_recipe(
            tmp_path,
            {
                "data": {
                    "prompts": {"path": str(tmp_path / "prompts.jsonl"), "eval_fraction": 0.25}
                },
                "sft": {"enabled": False},
                "reward": {"base_model": None, "functions": [{"function": "rule.py:rule"}]},
                "ppo": ppo,
            },
        )
    )
    assert run_ppo(recipe, QUIET)["status"] == "completed"
    metrics = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for row in metrics:
        mine = [
            c["rewards"] for c in calls if c["step"] == row["iteration"] and len(c["rewards"]) == 8
        ]
        rounds = int(row["rollout/sampling_rounds"])
        assert len(mine) == rounds + 1  # each round's batch, then the batch trained on
        groups = [r[g : g + 2] for r in mine[:rounds] for g in range(0, 8, 2)]
        uniform = sum(1 for g in groups if g[0] == g[1])
        assert row["rollout/dropped_groups_rate"] == pytest.approx(uniform / len(groups))
        trained = [mine[-1][g : g + 2] for g in range(0, 8, 2)]
        kept = sum(1 for g in trained if g[0] == g[1])
        assert row["rollout/uniform_groups_kept"] == kept
        assert kept == 0 or rounds == 3  # uniform groups are trained on only when rounds ran out
    assert any(row["rollout/dropped_groups_rate"] > 0 for row in metrics)
