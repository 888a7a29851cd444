"""The plan's parts against hand-computed numbers, its suggestions against the recipe schema,
and `rlhf plan`'s exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.plan import (
    GIB,
    Configs,
    ModelShape,
    Target,
    activation_bytes,
    candidate_sets,
    find_gpu,
    kv_cache_bytes,
    load_config,
    model_shape,
    nf4_bytes,
    optimizer_parts,
    parse_bytes,
    plan_recipe,
    suggest,
    weight_parts,
)
from rlhf_cli.recipe import LoraSection, ModelSection, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
MISTRAL = REPO / "examples" / "configs" / "mistral-7b-v0.1" / "config.json"
DEBERTA = REPO / "examples" / "configs" / "deberta-v3-large" / "config.json"
MISTRAL_RECIPE = REPO / "recipes" / "mistral7b.yaml"
SHAPE = ModelShape(
    params=1000, linear_params=800, lora_params=40, hidden=8, layers=2, intermediate=16,
    kv_dim=4, vocab=100,
)  # fmt: skip


def test_nf4_scales_per_64_weights():
    assert nf4_bytes(64 * 256, double_quant=False) == 64 * 128 + 4 * 256
    # 8-bit absmax per block, one fp32 constant per 256 blocks
    assert nf4_bytes(64 * 256, double_quant=True) == 64 * 128 + 256 + 4


def test_weights_4bit_the_rest_in_its_dtype_trained_or_not():
    model = ModelSection(name_or_path="x", dtype="bfloat16")
    model.quantization.load_in_4bit = True
    model.quantization.double_quant = False
    parts = weight_parts(SHAPE, model, Target(), trains=True)
    assert parts == {"weights 4-bit + scales": 400 + 50, "weights not quantised": 200 * 2}
    assert weight_parts(SHAPE, model, Target(), trains=False) == parts


def test_weights_by_dtype_and_full_training():
    model = ModelSection(name_or_path="x", dtype="auto")
    assert weight_parts(SHAPE, model, Target(), trains=True) == {"weights 16-bit": 2000}
    assert weight_parts(SHAPE, model, Target(cuda=False), trains=False) == {"weights fp32": 4000}
    full = model.variant(lora=False)
    assert weight_parts(SHAPE, full, Target(), trains=True) == {"weights fp32 (trained)": 4000}


def test_optimizer_divided_under_zero():
    assert optimizer_parts(100, Target()) == {"gradients fp32": 400, "AdamW m+v fp32": 800}
    zero2 = Target(processes=4, sharding="zero2")
    assert optimizer_parts(100, zero2) == {"gradients fp32": 100, "AdamW m+v fp32": 200}


def test_activations_with_and_without_checkpointing():
    per_layer = 8 * 8 + 4 * 4 + 4 * 16  # 144 elements a token
    assert activation_bytes(SHAPE, 10, 2, checkpointing=False) == 10 * 2 * 2 * per_layer
    assert activation_bytes(SHAPE, 10, 2, checkpointing=True) == 10 * 2 * (2 * 8 + per_layer)


def test_kv_cache():
    assert kv_cache_bytes(SHAPE, 10, 2) == 10 * 2 * 2 * 2 * 4


def test_mistral_shape_from_its_config():
    lora = LoraSection(r=16, target_modules=["q_proj", "v_proj"])
    shape = model_shape(load_config(str(MISTRAL)), True, lora)
    assert shape.params == 7_241_732_096  # Mistral-7B-v0.1's published count
    assert shape.kv_dim == 1024 and shape.vocab == 32000
    assert shape.lora_params == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    assert shape.linear_params == shape.params - 2 * 32000 * 4096 - (2 * 32 + 1) * 4096


def test_memory_sizes_and_gpus():
    assert parse_bytes("24GiB") == parse_bytes("24G") == 24 * GIB
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert find_gpu("a100 40gb").memory_bytes == 40 * GIB
    assert find_gpu("4090") == find_gpu("RTX-4090")
    with pytest.raises(Exception, match="unknown GPU"):
        find_gpu("V100")


@pytest.fixture(scope="module")
def mistral():
    recipe = load_recipe(MISTRAL_RECIPE)
    return recipe, Configs(load_config(str(MISTRAL)), load_config(str(DEBERTA)))


def test_reference_is_free_with_lora_and_a_copy_without(mistral):
    recipe, configs = mistral
    ppo = plan_recipe(recipe, configs, Target()).stages["ppo"]
    assert not any("reference" in part for part in ppo.parts)
    full = parse_recipe(recipe.to_yaml(), overrides=[
        "model.lora.enabled=false", "model.quantization.load_in_4bit=false"
    ])  # fmt: skip
    assert any("reference" in p for p in plan_recipe(full, configs, Target()).stages["ppo"].parts)


def test_every_suggested_key_is_a_recipe_field(mistral):
    recipe, _ = mistral
    recipe = parse_recipe(recipe.to_yaml(), overrides=[
        "model.gradient_checkpointing=false", "model.quantization.load_in_4bit=false",
        "ppo.generation.backend=vllm",
    ])  # fmt: skip
    for sets in candidate_sets(recipe):
        parse_recipe(recipe.to_yaml(), overrides=sets)  # raises RecipeError on an unknown key


def test_suggestions_fit_when_applied(mistral):
    recipe, configs = mistral
    target = Target(memory_bytes=int(7.0 * GIB))
    found = suggest(recipe, configs, target)
    # the 16-bit merge (14.5 GiB) cannot fit 7 GiB: every suggestion moves it to the CPU, the
    # first alone (PPO's 7.4 GiB still over), the others with one more change that fits
    assert all(s.sets[0] == "merge.device=cpu" for s in found)
    assert found[0].sets == ["merge.device=cpu"] and not found[0].fits
    plain = [s for s in found[1:] if s.launch is None]
    assert plain and all(s.fits and s.peak_bytes <= target.memory_bytes for s in plain)
    for s in plain:
        applied = plan_recipe(parse_recipe(recipe.to_yaml(), overrides=s.sets), configs, target)
        assert applied.fits and applied.stages["merge"].on_host


def _plan(*args: str):
    return CliRunner().invoke(app, [
        "plan", "--recipe", str(MISTRAL_RECIPE), "--config", str(MISTRAL),
        "--reward-config", str(DEBERTA), *args,
    ])  # fmt: skip


def test_cli_json_on_a100_fits():
    result = _plan("--gpu", "A100-40GB", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["fits"] is True and out["memory_bytes"] == 40 * GIB
    assert out["stages"]["ppo"]["iteration_s"] > 0
    assert {"peak_bytes", "parts"} <= set(out["stages"]["ppo"])


def test_cli_exit_2_with_one_line_and_suggestions():
    result = _plan("--memory", "12GiB")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "GiB over" in errors[0]
    assert "--set merge.device=cpu  → 7.41 GiB" in result.stdout
    # the suggestion applied: the merge plans on the host, outside the 12 GiB, and it fits
    applied = _plan("--memory", "12GiB", "--set", "merge.device=cpu", "--json")
    assert applied.exit_code == 0, applied.output
    assert json.loads(applied.stdout)["stages"]["merge"]["device"] == "cpu"
    # on the CPU `auto` is fp32: the merge needs 27 GiB of its memory, not 12
    assert _plan("--memory", "30GiB", "--set", "run.device=cpu").exit_code == 0


def test_cli_plans_only_the_stages_asked_for():
    """A 12 GiB card runs the mistral7b recipe's PPO (its merge, 14.5 GiB in bf16, elsewhere)."""
    result = _plan("--memory", "12GiB", "--stage", "ppo", "--stage", "audit", "--json")
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["stages"]) == {"ppo", "audit"}
    wrong = _plan("--stage", "rm")
    assert wrong.exit_code == 2
    assert "--stage rm: this recipe runs" in wrong.stderr


def test_ppo_warns_before_loading_when_the_plan_is_over_free_memory(monkeypatch, make_recipe):
    import torch
    from rich.console import Console

    from rlhf_cli.stages import ppo

    recipe = load_recipe(make_recipe())
    console = Console(record=True, width=200)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**20, 2**30))
    ppo.warn_over_plan(recipe, console)
    assert "the plan estimates" in console.export_text()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**40, 2**40))
    ppo.warn_over_plan(recipe, Console(record=True))  # plenty free: silent


def test_trl_fused_head_tiles_are_the_installed_trls():
    """SFT's logits buffer is sized by TRL's tile constants: a TRL that changes them changes
    the plan."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    from rlhf_cli.plan import TRL_TOKEN_TILE, TRL_VOCAB_TILE

    assert TRL_TOKEN_TILE == chunked_logprob.TOKEN_CHUNK_SIZE
    assert TRL_VOCAB_TILE == utils._CHUNKED_LOGPROB_CHUNK_SIZE


def test_a_training_step_peaks_in_its_pass_or_in_its_optimizer_step():
    from rlhf_cli.plan import training_phases

    held, working = {"weights": 100}, {"activations": 50}
    once = training_phases(held, 10, Target(), working, accumulates=False)
    assert once["forward + backward"] == {"weights": 100, "AdamW m+v fp32": 80, "activations": 50}
    assert once["optimizer step"] == {"weights": 100, "gradients fp32": 40, "AdamW m+v fp32": 80}
    accumulated = training_phases(held, 10, Target(), working, accumulates=True)
    assert accumulated["forward + backward"]["gradients fp32"] == 40
