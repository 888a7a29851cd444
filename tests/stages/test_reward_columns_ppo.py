"""A prompt dataset's extra column (`solution`) reaches a reward function with each response, as
TRL passes it (a list, one value per response), with the iteration as `step`: in the policy's
rollouts, the held-out evaluation and the live audit of a tiny PPO run (no SFT, no reward
model: the recording function is the whole reward), and in `rlhf audit` on its final policy
(the run's last iteration as `step`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from rlhf_cli.recipe import load_recipe

QUIET = Console(stderr=True, quiet=True)
TINY = Path(__file__).resolve().parents[2] / "data" / "tiny"

RECORDER = """
import json

def record(prompts, responses, solution, step):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "solution": solution, "step": step}}) + "\\n")
    return [float(len(r) % 3) for r in responses]
"""


@pytest.mark.slow
def test_the_solution_column_reaches_rollouts_evaluation_and_audit(tmp_path, small_recipe):
    from rlhf_cli.stages.audit import run_audit
    from rlhf_cli.stages.ppo import run_ppo

    lines = (TINY / "prompts.jsonl").read_text().splitlines()[:24]
    rows = [{**json.loads(line), "gold": f"answer {n}"} for n, line in enumerate(lines)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    solution_of = {r["prompt"]: r["gold"] for r in rows}
    audited = [rows[0]["prompt"], "A prompt that is not in the data at all."]
    (tmp_path / "audit.txt").write_text("\n".join(audited) + "\n")
    log = tmp_path / "calls.jsonl"
    (tmp_path / "recorder.py").write_text(RECORDER.format(log=str(log)))
    prompts = {"path": str(tmp_path / "prompts.jsonl"), "columns": {"solution": "gold"},
               "eval_fraction": 0.25}  # fmt: skip
    ppo = {"iterations": 2, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1,
           "save_freq": 2, "log_every": 1, "eval_every": 2, "advantage_estimator": "grpo",
           "num_generations": 2, "generation": {"max_new_tokens": 8}}  # fmt: skip
    recipe = load_recipe(
        small_recipe(
            tmp_path,
            {
                "data": {"prompts": prompts},
                "sft": {"enabled": False},
                "reward": {"base_model": None, "functions": [{"function": "recorder.py:record"}]},
                "audit": {"prompts_file": str(tmp_path / "audit.txt"), "every": 2},
                "ppo": ppo,
            },
        )
    )
    assert run_ppo(recipe, QUIET)["status"] == "completed"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for call in calls:  # every response's own row, whatever path scored it
        assert call["solution"] == [solution_of.get(p) for p in call["prompts"]]
    audits = [c for c in calls if set(c["prompts"]) == set(audited)]  # each prompt `samples` times
    assert audits and all(c["step"] == 2 for c in audits)
    assert {s for c in audits for s in c["solution"]} == {"answer 0", None}  # None: not in the data
    rollouts = [c for c in calls if len(c["prompts"]) == 8 and c not in audits]
    assert {c["step"] for c in rollouts} == {1, 2}  # each iteration's rollout
    heldout = [c for c in calls if len(c["prompts"]) == 6]  # 24 rows, a quarter held out
    assert heldout and all(c["step"] == 2 for c in heldout)
    assert {p for c in heldout for p in c["prompts"]}.isdisjoint(
        {p for c in rollouts for p in c["prompts"]}
    )
    log.write_text("")
    run_audit(recipe, QUIET)  # standalone: the audit prompts' rows read from data.prompts
    standalone = [json.loads(line) for line in log.read_text().splitlines()]
    assert standalone and all(set(c["prompts"]) == set(audited) for c in standalone)
    assert all(c["step"] == 2 for c in standalone)
    for call in standalone:
        assert call["solution"] == [solution_of.get(p) for p in call["prompts"]]
