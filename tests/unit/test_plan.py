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


# a Llama small enough to count by hand: hidden 64, 4 heads of 16 (2 of them for keys and
# values: kv width 32), MLP 128, 2 layers, vocabulary 128, untied head
LLAMA = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False,
)  # fmt: skip
LLAMA_PARAMS = 2 * 128 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
SERVER = ["ppo.generation.backend=vllm_server", "ppo.generation.server.urls=[http://s:8000]"]


def _tiny_llama_ppo(target: Target, *sets: str):
    """The tiny recipe's PPO plan on a GPU target (bf16 weights, no reward model), the Llama
    above as its policy; tiny's batch of 32 rows of 64 prompt + 32 response tokens unless set."""
    from transformers import LlamaConfig

    base = ["run.device=auto", "model.dtype=bfloat16", *sets]
    recipe = parse_recipe(load_recipe(REPO / "recipes" / "tiny.yaml").to_yaml(), overrides=base)
    return plan_recipe(recipe, Configs(LlamaConfig(**LLAMA), None), target, ["ppo"]).stages["ppo"]


def test_a_vllm_server_leaves_the_training_processes_no_engine_and_no_kv_cache():
    target = Target(memory_bytes=8 * GIB)
    hf, server = _tiny_llama_ppo(target), _tiny_llama_ppo(target, *SERVER)
    colocated = _tiny_llama_ppo(target, "ppo.generation.backend=vllm")
    # the colocated engine's share (gpu_memory_utilization's default 0.3) is held in every
    # phase: the same peak without it, which is also hf's (its update outweighs its generation)
    assert colocated.parts.pop("vLLM share") == int(0.3 * 8 * GIB)
    assert server.phase == colocated.phase == hf.phase == "forward + backward"
    assert server.parts == colocated.parts == hf.parts
    assert "server" not in hf.to_json() and "server" not in colocated.to_json()
    # mini-batches of 2 with checkpointing: hf peaks generating tiny's batch of 32 rows with a
    # 96-token cache (2 bytes × K and V × 2 layers × kv width 32) and 3 fp32 logits rows each;
    # the server backend samples nothing here, so its peak is another phase, below that
    small = ["ppo.mini_batch_size=2", "model.gradient_checkpointing=true"]
    hf, server = _tiny_llama_ppo(target, *small), _tiny_llama_ppo(target, *small, *SERVER)
    assert hf.phase == "generation"
    assert hf.parts["KV cache"] == 32 * 96 * 2 * 2 * 32 * 2
    assert hf.parts["sampling logits fp32"] == 3 * 32 * 128 * 4
    held = {k: v for k, v in hf.parts.items() if k not in ("KV cache", "sampling logits fp32")}
    assert server.phase != "generation" and held.items() <= server.parts.items()
    assert server.peak_bytes < hf.peak_bytes
    assert not {"KV cache", "sampling logits fp32", "vLLM share"} & set(server.parts)


def test_a_vllm_server_holds_the_weights_and_the_kv_cache_of_the_whole_batch():
    """2 bytes a bf16 element: K and V of 2 layers × 2 heads × 16 dims for every token of the
    whole batch (every process's rows), 40 prompt + 24 response tokens, whatever the processes."""
    sets = [*SERVER, "ppo.batch_size=16", "data.prompts.max_tokens=40"]
    sets += ["ppo.generation.max_new_tokens=24"]
    kv = 16 * (40 + 24) * 2 * 2 * 2 * 16 * 2
    for processes in (1, 2):
        server = _tiny_llama_ppo(Target(processes=processes), *sets).to_json()["server"]
        parts = {"weights 16-bit": LLAMA_PARAMS * 2, "KV cache of a batch": kv}
        assert server == {"peak_bytes": LLAMA_PARAMS * 2 + kv, "parts": parts}
    two = _tiny_llama_ppo(Target(), *sets, "ppo.generation.async_steps=2").to_json()["server"]
    assert two["parts"]["KV cache of 2 batches (async)"] == 2 * kv
    # the training processes' fit leaves the server out: the plan's peak is theirs alone
    plan = _tiny_llama_ppo(Target(), *sets)
    assert plan.peak_bytes == sum(plan.parts.values())


def test_suggestions_for_a_vllm_server_size_the_training_side_alone(mistral):
    recipe, configs = mistral
    recipe = parse_recipe(
        recipe.to_yaml(), overrides=["model.quantization.load_in_4bit=false", *SERVER]
    )
    target = Target(memory_bytes=16 * GIB)
    assert not plan_recipe(recipe, configs, target, ["ppo"]).fits
    found = suggest(recipe, configs, target, stages=["ppo"])
    assert found and not any("load_in_4bit" in arg for s in found for arg in s.sets)
    fitting = [s for s in found if s.fits and s.launch is None]
    assert fitting and all(s.peak_bytes <= target.memory_bytes for s in fitting)


def test_cli_shows_the_vllm_server_apart_from_the_fit():
    server = ["--set", "model.quantization.load_in_4bit=false", "--stage", "ppo"]
    server += [arg for s in SERVER for arg in ("--set", s)]
    table = _plan("--gpu", "A100-40GB", *server)
    assert table.exit_code == 0, table.output
    assert "ppo's vLLM server (each of server.urls): 15.27 GiB" in table.stdout
    assert "vLLM server: KV cache of a batch" in table.stdout
    out = json.loads(_plan("--gpu", "A100-40GB", "--json", *server).stdout)
    ppo = out["stages"]["ppo"]
    assert out["peak_bytes"] == ppo["peak_bytes"] == sum(ppo["parts"].values())
    assert set(ppo["server"]["parts"]) == {"weights 16-bit", "KV cache of a batch"}
