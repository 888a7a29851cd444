"""Benchmarks through the colocated vLLM engine (`eval.generation.backend: vllm`) against the HF
backend, on the tiny run's PPO policy (a LoRA adapter, merged in memory) and the shipped offline
tasks: the same scores on a generate_until task (tiny_arith) and a log-likelihood one
(tiny_polite), and the engine holds the merged policy's weights, not its base's. Runs where vLLM
and lm-eval are installed (`make test-vllm`'s .venv-vllm); skipped elsewhere.

Tolerance of the log-probs: both sides compute in float32 on the same weights, so they differ by
summation order only (1e-4, as tests/stages/test_vllm_engine.py); the adapter moves them by far
more."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages import eval as eval_stage

pytest.importorskip("vllm.sampling_params", reason="vLLM is not installed (make test-vllm)")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'rlhf-cli[eval]')")
pytestmark = pytest.mark.vllm
TASKS = Path(__file__).resolve().parents[2] / "data" / "eval" / "tasks"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def recipe_path(one_process_run: RunDir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny PPO run, copied; its recipe with both offline tasks as the only suite."""
    folder = tmp_path_factory.mktemp("vllm_bench")
    shutil.copytree(one_process_run.output_dir, folder / "runs")
    text = one_process_run.recipe_path().read_text()
    path = folder / "eval.yaml"
    path.write_text(text.replace(str(one_process_run.output_dir), str(folder / "runs")))
    return path


def recipe_for(path: Path, backend: str) -> Recipe:
    return load_recipe(
        path,
        [
            f"run.output_dir={path.parent / 'runs'}", "eval.judge=null", "eval.checks=null",
            "eval.benchmarks.tasks=[tiny_arith, tiny_polite]",
            f"eval.benchmarks.include_path={TASKS}", f"eval.generation.backend={backend}",
        ],
    )  # fmt: skip


def benchmarked(path: Path, backend: str) -> dict[str, Any]:
    """`benchmark` on the PPO policy: its scores, the merge check, the engine it built (if
    any) and the merged model it served."""
    import rlhf_cli.generation as generation

    built: list[Any] = []
    real = generation.generator_for

    def recorded(*args: Any, **kwargs: Any) -> Any:
        built.append(real(*args, **kwargs))
        return built[-1]

    recipe = recipe_for(path, backend)
    target = eval_stage.resolve_target(recipe, RunDir.for_recipe(recipe), "ppo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation, "generator_for", recorded)
        scores, check = eval_stage.benchmark(recipe, target, CPU)
    model, tokenizer = target.loaded
    sft = eval_stage.resolve_target(recipe, RunDir.for_recipe(recipe), "sft")
    return {"scores": scores, "check": check, "engines": built, "model": model,
            "tokenizer": tokenizer, "sft": sft}  # fmt: skip


@torch.no_grad()
def summed_logprobs(model: Any, sequences: list[list[int]], start: int) -> torch.Tensor:
    """Each sequence's log-prob of its tokens from `start` on, by an HF forward."""
    out = []
    for ids in sequences:
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].log_softmax(-1)
        out.append(logits.gather(1, torch.tensor(ids[start:])[:, None]).sum())
    return torch.stack(out)


def test_vllm_benchmarks_score_as_hf_on_the_merged_policy(recipe_path) -> None:
    hf = benchmarked(recipe_path, "hf")
    ours = benchmarked(recipe_path, "vllm")
    assert hf["engines"] == [] and len(ours["engines"]) == 1
    for task, n in (("tiny_arith", 30), ("tiny_polite", 20)):
        assert (hf["scores"][task]["backend"], ours["scores"][task]["backend"]) == ("hf", "vllm")
        assert ours["scores"][task]["n"] == hf["scores"][task]["n"] == n
        assert ours["scores"][task]["score"] == hf["scores"][task]["score"], task
    assert ours["check"]["max_abs_logit_diff"] <= ours["check"]["tolerance"]  # merged, checked

    # the engine serves the merged policy: its prompt log-probs are the policy's, not the base's
    from vllm import SamplingParams

    texts = ["Question: What is 2 + 3?\nAnswer: 5", "How can I keep cut flowers fresh? Trim them."]
    sequences = [ours["tokenizer"](text)["input_ids"] for text in texts]
    start = 3
    outputs = ours["engines"][0].llm.generate(
        [{"prompt_token_ids": ids} for ids in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    served = torch.tensor(
        [
            sum(
                step[token].logprob
                for token, step in zip(ids[start:], out.prompt_logprobs[start:], strict=True)
            )
            for ids, out in zip(sequences, outputs, strict=True)
        ]
    )
    torch.testing.assert_close(
        served, summed_logprobs(ours["model"], sequences, start), atol=1e-4, rtol=0
    )
    base, _ = ours["sft"].load(CPU)  # the weights the PPO adapter was trained on
    assert (served - summed_logprobs(base, sequences, start)).abs().max() > 1e-2
