"""What one process decides for all is agreed before any process acts on it, on two gloo processes
launched as users launch them (#50 items 1 and 9):

- a rollback to the best checkpoint restores the main process's best on every process, even
  where another process's own evaluations would name another (forced_hooks.py: the main
  process's held-out reward is best at iteration 1, the other's at the newest);
- a rollout server lost to one process only (it hangs on that process's rows) ends every
  process's run together, in seconds: a checkpoint of the last whole iteration, one error line
  naming the server, exit 2; before, one process entered the checkpoint's barrier while the
  other waited in the rollout's gather.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml
from fake_vllm import FakeVLLM
from launching import launch, launched

from rlhf_cli.generation import row_seed
from rlhf_cli.modeling import load_tokenizer
from rlhf_cli.recipe import load_recipe
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow


def test_two_processes_roll_back_to_the_main_process_best(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    ppo = {"iterations": 3, "batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1,
           "save_freq": 1, "eval_every": 1, "log_every": 10,
           "generation": {"max_new_tokens": 6}}  # fmt: skip
    audit = {"every": 3, "on_hacking": "rollback", "rollback_to": "best", "max_rollbacks": 1}
    ppo_recipe(pipeline, tmp_path, small_recipe, ppo, audit=audit)
    run = launch("ddp", tmp_path, module="forced_hooks")

    by_rank = [json.loads((tmp_path / f"restored_{r}.json").read_text()) for r in (0, 1)]
    assert [[r["restored"] for r in seen] for seen in by_rank] == [[1.0], [1.0]]
    assert by_rank[0][0]["weights"] == by_rank[1][0]["weights"]  # one policy, not two
    root = run.stage_dir("ppo") / "checkpoints"
    assert json.loads((root / "best.json").read_text())["checkpoint"] == "iter_00001"
    assert (root / "iter_00002" / "undone.json").is_file()
    manifest = run.read_manifest("ppo")
    assert [r["restored"] for r in manifest["rollbacks"]] == [1]


class HangsForOneProcess(FakeVLLM):
    """Answers every completion except those whose seed is in `doomed`, which it leaves
    unanswered for `hang_s` seconds."""

    doomed: set[int] = set()
    hang_s = 15.0

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        if body["seed"] in self.doomed:
            time.sleep(self.hang_s)
        return super().complete(body)


def test_a_server_lost_to_one_process_ends_every_process_together(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    from rlhf_cli.stages.serve import serving_base

    server = {"urls": ["http://127.0.0.1:1"], "retries": 0, "timeout_s": 2}
    generation = {"max_new_tokens": 6, "backend": "vllm_server", "server": server,
                  "async_steps": 1, "tis_cap": 2.0}  # fmt: skip
    ppo = {"iterations": 3, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1,
           "save_freq": 2, "log_every": 10, "generation": generation}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    run = RunDir.for_recipe(recipe)
    model, tokenizer = serving_base(recipe, run)
    fake = HangsForOneProcess(model, load_tokenizer(tokenizer))
    # the second process's rows of iteration 2 (process r holds rows r, r + 2, ...), drafted
    # while iteration 1 trains (`async_steps: 1`)
    fake.doomed = {row_seed(recipe.run.seed, 2, row) for row in range(1, 8, 2)}
    data = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    data["ppo"]["generation"]["server"]["urls"] = [fake.url]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_recipe(tmp_path / "recipe.yaml").ppo.generation.server.urls == [fake.url]
    try:
        start = time.monotonic()
        out = launched("ddp", tmp_path, timeout=240)  # a hang fails here
        took = time.monotonic() - start
    finally:
        fake.stop()

    errors = {line for line in out.stderr.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, out.stderr[-4000:]  # every process says the same, one line
    (line,) = errors
    assert f"the rollout server at {fake.url}" in line
    assert "checkpoint iter_00001 (iteration 1) holds the run" in line and "--resume" in line
    assert "exitcode  : 2" in out.stderr, out.stderr[-4000:]  # torchrun's report of the ranks
    stage = run.stage_dir("ppo")
    assert [f.name for f in checkpoint_folders(stage / "checkpoints", PPO_CHECKPOINT)] == [
        "iter_00001"
    ]
    assert [r["iteration"] for r in read_metrics(stage / "metrics.jsonl")] == [1]
    assert took < 200, took
