"""A 4-bit base made trainable keeps its other weights in the model's dtype.

peft's `prepare_model_for_kbit_training` upcasts the embeddings, norms and LM head of a 4-bit
model to fp32, and the fp32 embedding output then carries the whole residual stream, the KV
cache and the logits in fp32 (bitsandbytes returns each 4-bit layer's output in its input's
dtype). `make_trainable` freezes the base instead: only the LoRA weights are fp32.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.modeling import load_causal_lm
from rlhf_cli.recipe import ModelSection, QuantizationSection

bnb = pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qlora_bf16() -> torch.nn.Module:
    cfg = ModelSection(
        name_or_path="builtin:tiny-lm",
        dtype="bfloat16",
        quantization=QuantizationSection(load_in_4bit=True, compute_dtype="bfloat16"),
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    return load_causal_lm(cfg.name_or_path, cfg, CPU)


def test_only_the_adapter_is_fp32_and_trainable(qlora_bf16: torch.nn.Module) -> None:
    trainable = {n: p.dtype for n, p in qlora_bf16.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(trainable.values()) == {torch.float32}
    frozen_float = {
        n: p.dtype
        for n, p in qlora_bf16.named_parameters()
        if not p.requires_grad and type(p).__name__ != "Params4bit"
    }
    # embeddings, norms and the LM head: none upcast
    assert any("embed_tokens" in n for n in frozen_float)
    assert any("norm" in n for n in frozen_float)
    assert set(frozen_float.values()) == {torch.bfloat16}


def test_kv_cache_and_logits_stay_in_the_model_dtype(qlora_bf16: torch.nn.Module) -> None:
    ids = torch.randint(5, 100, (2, 6))
    with torch.no_grad():
        out = qlora_bf16(input_ids=ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    assert out.past_key_values.layers[0].keys.dtype == torch.bfloat16


def test_the_adapter_still_learns(qlora_bf16: torch.nn.Module) -> None:
    ids = torch.randint(5, 100, (2, 6))
    qlora_bf16.train()
    qlora_bf16.zero_grad()
    qlora_bf16(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in qlora_bf16.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
