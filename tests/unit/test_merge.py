"""The merge's logit checks (`stages/merge.py`): the tolerance of a bf16/fp16 cast, and a cast
that overflows refused, on a small Llama + LoRA built here."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.stages.trained import cast_tolerance, merge_and_cast


def test_cast_tolerance_is_merge_atol_in_float32_and_rounding_steps_in_half() -> None:
    assert cast_tolerance(torch.float32, 30.0, 1e-3) == 1e-3
    assert cast_tolerance(torch.bfloat16, 30.0, 1e-3) == pytest.approx(16 * 2**-7 * 30)  # 3.75
    assert cast_tolerance(torch.float16, 30.0, 1e-3) == pytest.approx(16 * 2**-10 * 30)  # 0.47
    assert cast_tolerance(torch.float16, 0.01, 1e-3) == 1e-3  # never below merge.atol


def lora_lm(llama_config, head_scale: float):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(head_scale)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lora).eval()


@pytest.mark.parametrize(
    ("head_scale", "refused"),
    [(1.0, False), (1e6, True)],  # 1e6: logits past float16's largest number (65504)
)
def test_an_fp16_cast_is_checked_against_the_float32_adapter_model(
    llama_config, head_scale: float, refused: bool
) -> None:
    model = lora_lm(llama_config, head_scale)
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones_like(ids)
    atol = 1e-3 * head_scale  # float32 rounding grows with the logits too
    merged, metrics, problem = merge_and_cast(model, ids, mask, torch.float16, atol)
    assert next(merged.parameters()).dtype == torch.float16
    assert metrics["merge_logit_diff_fp32"] <= atol  # the float32 merge is right
    assert (problem is not None) == refused, problem
    if refused:
        assert not metrics["max_abs_logit_diff"] < float("inf")  # inf or nan
        assert "in torch.float16 differs from the float32 adapter model" in problem


def test_a_merge_with_nan_logits_is_refused(llama_config) -> None:
    """nan compares false with any tolerance: a check written `diff > atol` would pass it."""
    model = lora_lm(llama_config, 1.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "v_proj.lora_B" in name:
                param.fill_(float("nan"))
    ids = torch.randint(0, 64, (2, 8))
    _, metrics, problem = merge_and_cast(model, ids, torch.ones_like(ids), torch.float32, 1e-3)
    assert metrics["max_abs_logit_diff"] != metrics["max_abs_logit_diff"]  # nan
    assert "merge_logit_diff_fp32" not in metrics  # no cast: the one figure is the merge's
    assert problem is not None and problem.startswith("the float32 merge changes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_base_merges_to_the_float32_merge_after_its_cast(llama_config, dtype) -> None:
    """A base loaded in its 16-bit dtype with the float32 adapter: peft adds each layer's
    float32 delta in place, rounding once, so the merge equals the float32 merge cast once
    (the merge without the float32 model: 14 GiB less for a 7B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    def built(base_dtype: torch.dtype):
        torch.manual_seed(0)  # the same weights twice, as a 16-bit checkpoint holds them
        base = LlamaForCausalLM(llama_config(tie_word_embeddings=False)).to(dtype)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(base.to(base_dtype).eval(), lora)

    model, half = built(torch.float32), built(dtype)
    half.load_state_dict(model.state_dict())  # the same adapter (the base casts exactly)
    assert {p.dtype for n, p in half.named_parameters() if "lora_" in n} == {torch.float32}
    expected = model.merge_and_unload().to(dtype).state_dict()
    merged = half.merge_and_unload().state_dict()
    assert expected.keys() == merged.keys()
    for name, weight in expected.items():
        assert merged[name].dtype == dtype
        torch.testing.assert_close(merged[name], weight, atol=0, rtol=0, msg=name)
