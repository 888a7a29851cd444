"""PPO with `generation.backend: vllm_server` against the stand-in server (tests/fake_vllm.py),
serving what `rlhf serve` would serve (`serving_base`): the run completes from the servers'
answers; with `async_steps: 1` every batch after the first is one update stale; a server that
dies mid-run ends the run with exit 2, a checkpoint of the last whole iteration and the
`--resume` line, and `--resume` against a new server completes the run. The real vLLM server:
tests/stages/test_vllm_server.py (`make test-vllm`)."""

from __future__ import annotations

import pytest
from fake_vllm import FakeVLLM
from rich.console import Console

from rlhf_cli.errors import GenerationServerLost
from rlhf_cli.modeling import load_tokenizer
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)


def _served(recipe):
    from rlhf_cli.stages.serve import serving_base

    model, tokenizer = serving_base(recipe, RunDir.for_recipe(recipe))
    return FakeVLLM(model, load_tokenizer(tokenizer))


def _ppo(iterations: int, url: str, **generation) -> dict:
    server = {"urls": [url], "retries": 1, "timeout_s": 30}
    generation = {"max_new_tokens": 12, "backend": "vllm_server", "server": server, **generation}
    return {"iterations": iterations, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1,
            "save_freq": 1, "log_every": 10, "generation": generation}  # fmt: skip


def _with_url(recipe, url: str):
    gen = recipe.ppo.generation
    server = gen.server.model_copy(update={"urls": [url]})
    ppo = recipe.ppo.model_copy(update={"generation": gen.model_copy(update={"server": server})})
    return recipe.model_copy(update={"ppo": ppo})


@pytest.mark.parametrize("ahead", [0, 1])
def test_ppo_rolls_out_on_the_server_and_overlaps_when_asked(
    ahead, ppo_recipe, pipeline, tmp_path, small_recipe
):
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, _ppo(3, "http://127.0.0.1:1"))
    fake = _served(recipe)
    try:
        recipe = _with_url(recipe, fake.url)
        if ahead:
            gen = recipe.ppo.generation.model_copy(update={"async_steps": 1, "tis_cap": 2.0})
            recipe = recipe.model_copy(
                update={"ppo": recipe.ppo.model_copy(update={"generation": gen})}
            )
        manifest = run_ppo(recipe, QUIET)
    finally:
        fake.stop()
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and len(rows) == 3
    assert [r["rollout/staleness"] for r in rows] == [0.0, ahead, ahead]
    completions = [b for p, b in fake.requests if p == "/v1/completions"]
    assert len(completions) >= 3 * 8  # every rollout row came from the server
    if not ahead:  # the answering weights are the trained ones: the engine's numerics alone
        assert max(r["rollout/logprob_mismatch"] for r in rows) < 1e-3


def test_a_server_lost_mid_run_checkpoints_exits_2_and_resume_completes(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    from rlhf_cli.stages.ppo import run_ppo

    monkeypatch.setattr("rlhf_cli.generation.server.time.sleep", lambda s: None)
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, _ppo(4, "http://127.0.0.1:1"))
    fake = _served(recipe)
    fake.die_after = 8 * 2 + 1  # the probe, two whole rollouts, then nothing
    try:
        with pytest.raises(GenerationServerLost) as lost:
            run_ppo(_with_url(recipe, fake.url), QUIET)
    finally:
        fake.stop()
    assert lost.value.exit_code == 2
    assert f"the rollout server at {fake.url} failed /v1/completions 2 time(s)" in str(lost.value)
    assert "checkpoint iter_00002 (iteration 2) holds the run" in str(lost.value)
    assert "rlhf ppo --resume" in str(lost.value)
    stage = RunDir.for_recipe(recipe).stage_dir("ppo")
    assert [f.name for f in checkpoint_folders(stage / "checkpoints", PPO_CHECKPOINT)][-1] == (
        "iter_00002"
    )
    assert len(read_metrics(stage / "metrics.jsonl")) == 2

    again = _served(recipe)  # restarted, elsewhere
    try:
        manifest = run_ppo(_with_url(recipe, again.url), QUIET, resume=True)
    finally:
        again.stop()
    rows = read_metrics(stage / "metrics.jsonl")
    assert manifest["status"] == "completed" and [r["iteration"] for r in rows] == [1, 2, 3, 4]
