"""PPO's models as `build_actor` makes them from a checkpoint saved in bf16 (as most hub models
are): what trains keeps fp32 master weights (so AdamW's small steps are not rounded away), the
separate critic follows the recipe's 4-bit / LoRA settings, the recipe's weight decay reaches
AdamW, half-precision compute is autocast on CUDA only, and gradient checkpointing recomputes
the policy and the critic with unchanged gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf_cli.ppo.models import PpoSources, build_actor
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.stages.ppo import optimizer_factory

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
QLORA = {"quantization": {"load_in_4bit": True, "compute_dtype": "float32"}}


@pytest.fixture(scope="module")
def bf16_lm(tmp_path_factory: pytest.TempPathFactory, llama_config) -> Path:
    from transformers import LlamaForCausalLM

    config = llama_config()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bf16_lm")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def recipe_for(
    folder: Path, tmp_path: Path, model: dict[str, Any] | None = None, **ppo: Any
) -> Recipe:
    """The tiny recipe on `folder`, at the guide's learning rate, with the dtype `auto` picks
    on CUDA (bfloat16)."""
    data = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    data["model"].update({"name_or_path": str(folder), "dtype": "bfloat16"})
    data["model"]["lora"].update(LORA)
    for key, value in (model or {}).items():  # sections: `lora`, `quantization`
        data["model"][key] = {**data["model"].get(key, {}), **value}
    data["ppo"].update({"learning_rate": 1.4e-5, **ppo})
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


def actor_for(recipe: Recipe, folder: Path):
    sources = PpoSources(str(folder), None, str(folder), str(folder), str(folder))
    return build_actor(recipe, sources, CPU, scorer=None, tokenizer=None)[0]


def trained(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "ppo"),
    [
        ({"lora": {"enabled": False}}, {}),
        ({"lora": {"enabled": False}}, {"value_model": "separate"}),
        ({}, {"value_model": "separate"}),
        (QLORA, {"value_model": "separate"}),
    ],
    ids=["full-policy", "full-policy-and-critic", "lora-critic", "qlora-critic"],
)
def test_ten_adamw_steps_at_the_guide_lr_move_every_trained_weight(
    bf16_lm: Path, tmp_path: Path, model: dict[str, Any], ppo: dict[str, Any]
) -> None:
    """In bf16, a 1.4e-5 step is below half an ulp of most weights and rounds away; fp32
    master weights keep it. The loss's gradient is 1 for every trained weight."""
    recipe = recipe_for(bf16_lm, tmp_path, model, **ppo)
    actor = actor_for(recipe, bf16_lm)
    params = trained(actor)
    assert {p.dtype for p in params.values()} == {torch.float32}
    optimizer = optimizer_factory(recipe.ppo)(actor)
    before = {n: p.detach().clone() for n, p in params.items()}
    for _ in range(10):
        sum(p.float().sum() for p in params.values()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in params.items())
    assert moved / sum(p.numel() for p in params.values()) > 0.99
    ids = torch.randint(0, 64, (2, 8))
    _, values = actor(ids, torch.ones_like(ids), 3)  # still runs: bf16 base, fp32 adapter / head
    assert values.shape == (2, 3) and torch.isfinite(values).all()


@pytest.mark.parametrize("model", [{}, QLORA], ids=["lora", "qlora"])
def test_a_lora_critic_trains_only_its_adapter_and_fp32_head(
    bf16_lm: Path, tmp_path: Path, model: dict[str, Any]
) -> None:
    import bitsandbytes as bnb

    recipe = recipe_for(bf16_lm, tmp_path, model, value_model="separate")
    critic = actor_for(recipe, bf16_lm).critic
    names = trained(critic)
    assert names and all("lora_" in n or n.startswith("head.") for n in names)
    assert {"head.weight", "head.bias"} <= names.keys()
    assert {p.dtype for p in names.values()} == {torch.float32}
    assert not critic.backbone.get_input_embeddings().weight.requires_grad  # the base is frozen
    quantised = any(isinstance(m, bnb.nn.Linear4bit) for m in critic.modules())
    assert quantised is bool(model)
    assert all(m.p == 0.0 for m in critic.modules() if isinstance(m, torch.nn.Dropout))


def test_the_recipes_weight_decay_reaches_adamw(bf16_lm: Path, tmp_path: Path) -> None:
    for decay in (0.0, 0.05):
        recipe = recipe_for(bf16_lm, tmp_path, weight_decay=decay)
        optimizer = optimizer_factory(recipe.ppo)(actor_for(recipe, bf16_lm))
        assert [g["weight_decay"] for g in optimizer.param_groups] == [decay]


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [("cuda", "bfloat16", "bf16"), ("cuda", "float16", "fp16"), ("cpu", "bfloat16", "no")],
)
def test_run_ppo_autocasts_half_precision_on_cuda_only(
    bf16_lm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device, dtype, expected
) -> None:
    import accelerate

    from rlhf_cli.stages import ppo

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_accelerator(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(accelerate, "Accelerator", fake_accelerator)
    monkeypatch.setattr(ppo, "pick_device", lambda name: torch.device(device))
    monkeypatch.setattr(ppo, "warn_over_plan", lambda recipe, console: None)  # asks real CUDA
    recipe = recipe_for(bf16_lm, tmp_path)
    recipe = recipe.model_copy(update={"model": recipe.model.variant(dtype=dtype)})
    with pytest.raises(Stop):
        ppo.run_ppo(recipe, console=None)
    assert {k: seen[k] for k in ("cpu", "mixed_precision")} == {
        "cpu": device == "cpu",
        "mixed_precision": expected,
    }
    assert seen["gradient_accumulation_steps"] == recipe.ppo.gradient_accumulation_steps


# ── gradient checkpointing ─────────────────────────────────────────────────────────────────


def _count_calls(module: torch.nn.Module, calls: list[str], name: str) -> None:
    """Count `module`'s forward runs (module hooks do not run in a checkpoint's recompute)."""
    forward = module.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return forward(*args, **kwargs)

    module.forward = counted


@pytest.mark.parametrize(
    "model",
    [{}, QLORA, {"lora": {"enabled": False}}],
    ids=["lora", "qlora", "full"],
)
def test_gradient_checkpointing_recomputes_policy_and_critic_with_the_same_gradients(
    bf16_lm: Path, tmp_path: Path, model: dict[str, Any]
) -> None:
    from rlhf_cli.modeling import is_checkpointing

    ids = torch.randint(0, 64, (2, 8))
    results = []
    for checkpointing in (False, True):
        recipe = recipe_for(bf16_lm, tmp_path, model, value_model="separate")
        recipe = recipe.model_copy(
            update={
                "model": recipe.model.model_copy(
                    update={"gradient_checkpointing": checkpointing, "dtype": "float32"}
                )
            }
        )
        torch.manual_seed(0)
        actor = actor_for(recipe, bf16_lm)
        generator = torch.Generator().manual_seed(1)
        for name, param in trained(actor).items():  # LoRA B and the head start at 0
            if "lora_B" in name or "head" in name:
                torch.nn.init.normal_(param, std=0.05, generator=generator)
        assert is_checkpointing(actor.policy) is checkpointing
        assert is_checkpointing(actor.critic.backbone) is checkpointing
        calls: list[str] = []
        for part, root in (("policy", actor.policy), ("critic", actor.critic.backbone)):
            mlp = next(m for n, m in root.named_modules() if n.endswith("layers.0.mlp"))
            _count_calls(mlp, calls, part)
        actor.train()  # PPO's update runs in train mode: checkpointing acts only there
        logits, values = actor(ids, torch.ones_like(ids), 4)
        (logits.float().square().mean() + values.square().mean()).backward()
        results.append(({n: p.grad for n, p in trained(actor).items()}, sorted(calls)))
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results
    assert plain_calls == ["critic", "policy"]
    assert checkpointed_calls == ["critic", "critic", "policy", "policy"]
    assert all(g is not None for g in plain.values())
    torch.testing.assert_close(checkpointed, plain)


def test_a_4bit_lora_critic_resumes_from_its_checkpointed_state(
    bf16_lm: Path, tmp_path: Path
) -> None:
    """Only the critic's trained weights (LoRA + head) are saved, never its 4-bit base, and they
    load back into a freshly built critic."""
    from safetensors.torch import load_file, save_file

    recipe = recipe_for(bf16_lm, tmp_path, QLORA, value_model="separate")
    saved = actor_for(recipe, bf16_lm)
    for param in trained(saved).values():
        torch.nn.init.normal_(param, std=0.05)
    state = saved.value_state_dict()
    assert set(state) == set(trained(saved.critic))  # no frozen or quantised base weights
    save_file(state, tmp_path / "value.safetensors")
    fresh = actor_for(recipe, bf16_lm)
    fresh.load_value_state_dict(load_file(tmp_path / "value.safetensors"))
    torch.testing.assert_close(
        {n: p.detach() for n, p in trained(fresh.critic).items()},
        {n: p.detach() for n, p in trained(saved.critic).items()},
    )
