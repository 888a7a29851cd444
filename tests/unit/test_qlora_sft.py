"""4-bit PPO on an SFT adapter: the adapter stays an adapter on the NF4 base.

Merging an SFT adapter into NF4 weights re-quantises them, and a delta of a few percent of the
weight scale mostly falls below NF4's steps: most of SFT is lost. So on a 4-bit base the SFT
adapter is kept, frozen, under the PPO adapter; the reference activates it alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_cli.modeling import (
    SFT_ADAPTER,
    load_causal_lm,
    load_sft_model,
    save_trained,
    with_trained_adapter,
)
from rlhf_cli.ppo.models import PpoSources, build_policy
from rlhf_cli.recipe import load_recipe

bnb = pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")
QLORA = {
    "dtype": "float32",
    "quantization": {"load_in_4bit": True, "compute_dtype": "float32"},
    "lora": {"r": 4, "alpha": 8},
}
IDS = torch.randint(10, 200, (2, 12), generator=torch.Generator().manual_seed(0))


def dequantised(layer: torch.nn.Module) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


@pytest.fixture
def recipe(make_recipe):
    return load_recipe(make_recipe({"model": QLORA}))


@pytest.fixture
def sft_adapter(recipe, tmp_path: Path) -> Path:
    """An SFT adapter whose delta is 4% of each layer's weight scale (std)."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(0)
    model = load_causal_lm("builtin:tiny-lm", recipe.model, CPU)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                lora_b = module.lora_B["default"].weight.normal_()
                scale = dequantised(module.base_layer).std()
                lora_b.mul_(0.04 * scale / module.get_delta_weight("default").std())
    model.save_pretrained(tmp_path / "sft")
    return tmp_path / "sft"


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def sft_policy(recipe, adapter: Path) -> torch.nn.Module:
    """What SFT trained: the 4-bit base with its adapter, unmerged."""
    from peft import PeftModel

    base = load_causal_lm("builtin:tiny-lm", recipe.model.variant(lora=False), CPU, trainable=False)
    return PeftModel.from_pretrained(base, str(adapter))


def ppo_policy(recipe, adapter: Path):
    sources = PpoSources("builtin:tiny-lm", adapter, "builtin:tiny-lm", None, None)
    return build_policy(recipe, sources, CPU)


def test_the_ppo_start_policy_and_its_reference_are_the_sft_policy(recipe, sft_adapter) -> None:
    sft = logits(sft_policy(recipe, sft_adapter))
    base = logits(load_causal_lm("builtin:tiny-lm", recipe.model, CPU, trainable=False))
    assert (sft - base).abs().max() > 0.05  # the SFT adapter matters
    policy, reference = ppo_policy(recipe, sft_adapter)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())
    torch.testing.assert_close(logits(policy), sft, atol=1e-5, rtol=0)
    torch.testing.assert_close(reference.logits(IDS, torch.ones_like(IDS)), sft, atol=1e-5, rtol=0)


def test_only_the_ppo_adapter_trains_and_the_reference_stays_the_sft_policy(
    recipe, sft_adapter
) -> None:
    policy, reference = ppo_policy(recipe, sft_adapter)
    sft_weights = {n: p for n, p in policy.named_parameters() if f".{SFT_ADAPTER}." in n}
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert sft_weights and not any(p.requires_grad for p in sft_weights.values())
    assert trainable and all("lora_" in n and ".default." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    sft = reference.logits(IDS, torch.ones_like(IDS))
    # the reference's forward leaves what trains as it was
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == set(trainable)

    policy.train()
    optimiser = torch.optim.AdamW(trainable.values(), lr=1e-2)
    for _ in range(2):  # lora_B moves first, then lora_A gets a gradient
        optimiser.zero_grad()
        policy(input_ids=IDS, labels=IDS).loss.backward()
        optimiser.step()
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved == set(trainable)
    assert all(p.grad is None for p in sft_weights.values())
    torch.testing.assert_close(reference.logits(IDS, torch.ones_like(IDS)), sft)
    assert (logits(policy) - sft).abs().max() > 1e-3  # the PPO adapter acts on the policy


def test_a_saved_ppo_adapter_reloads_to_the_same_policy(recipe, sft_adapter, tmp_path) -> None:
    from safetensors.torch import load_file

    policy, _ = ppo_policy(recipe, sft_adapter)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad and "lora_B" in name:
                param.normal_(0, 0.02)
    trained = logits(policy)
    save_trained(policy, tmp_path / "adapter")  # what `rlhf ppo` writes

    saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert saved == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    trained_names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert len(weights) == len(trained_names)
    assert all("lora_" in k and SFT_ADAPTER not in k.split(".") for k in weights)

    # as audit and compare load it: the SFT model, then the adapter
    sft_model = load_sft_model(recipe.model, "builtin:tiny-lm", sft_adapter, CPU)
    reloaded = with_trained_adapter(sft_model, tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded), trained, atol=1e-5, rtol=0)
