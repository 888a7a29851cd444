"""stages/trained.py: where a run's reward model comes from, for audit and compare."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages.trained import generation_engine, load_scorer


def test_no_reward_stage_means_no_scores_but_a_damaged_one_is_an_error(make_recipe):
    recipe = load_recipe(make_recipe())
    run, cpu = RunDir.for_recipe(recipe), torch.device("cpu")
    assert load_scorer(recipe, run, cpu, needed_by="rlhf audit") is None  # nothing to score with
    run.stage_dir("rm").mkdir(parents=True)
    run.manifest_path("rm").write_text('{"stage": "rm", "status": "compl')  # cut short
    with pytest.raises(StageError, match=r"rm/manifest.json is unreadable.*rlhf train-rm"):
        load_scorer(recipe, run, cpu, needed_by="rlhf audit")
    run.manifest_path("rm").write_text('{"stage": "rm", "status": "failed", "outputs": {}}')
    with pytest.raises(StageError, match="^rlhf compare needs the rm stage.*status is 'failed'"):
        load_scorer(recipe, run, cpu, needed_by="rlhf compare")


@pytest.mark.parametrize(("native_bf16", "dtype"), [(False, torch.float32), (True, torch.bfloat16)])
def test_the_vllm_engine_is_built_in_the_policy_dtype(make_recipe, monkeypatch, native_bf16, dtype):
    from types import SimpleNamespace

    from rlhf_cli.generation import vllm as vllm_engine

    recipe = load_recipe(make_recipe({"model": {"dtype": "auto"}}))
    gen = recipe.ppo.generation.model_copy(update={"backend": "vllm"})
    monkeypatch.setattr(  # a T4 or V100 emulates bf16; an Ampere GPU computes it
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: native_bf16 or including_emulation,
    )
    built = {}
    monkeypatch.setattr(vllm_engine, "vllm_generator", lambda *args: built.update(args=args))
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    policy = SimpleNamespace(parameters=lambda: iter([on_cuda]))
    generation_engine(gen, policy, None, recipe, recipe.run.output_dir)
    assert built["args"][-1] == dtype
