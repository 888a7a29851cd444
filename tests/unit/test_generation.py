"""The generation module: masks from stop tokens, generation's positions, left padding, log-probs
at the sampling temperature, and one HF backend whose answers agree with its own tensors."""

from __future__ import annotations

import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_cli.generation import (
    Generations,
    HFGenerator,
    generator_for,
    left_pad,
    position_ids_from,
    response_logprobs,
    response_mask_from,
    stop_token_ids,
    tokenize_prompts,
)
from rlhf_cli.recipe import GenerationSection

EOS = 2


def test_mask_keeps_a_real_eos_when_pad_equals_eos():
    # generate() pads finished rows with pad == eos; the first EOS is real and stays in the mask
    response = torch.tensor([[5, 7, EOS, EOS, EOS], [5, 6, 7, 8, 9]])
    mask, ended = response_mask_from(response, [EOS])
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5]
    assert ended.tolist() == [True, False]


def test_mask_stops_at_any_stop_token_and_at_position_zero():
    response = torch.tensor([[9, EOS, 4], [7, 3, 3]])
    mask, ended = response_mask_from(response, [EOS, 7])
    assert mask.tolist() == [[True, True, False], [True, False, False]]
    assert ended.tolist() == [True, True]


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_left_pad():
    ids, mask = left_pad([[4, 5], [6, 7, 8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[0, 4, 5], [6, 7, 8]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_logprobs_use_the_sampling_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    response = torch.randint(0, 11, (2, 3))
    logprobs, _ = response_logprobs(logits, response, query_width=2, temperature=0.7)
    expected = torch.log_softmax(logits[:, 1:4] / 0.7, -1).gather(-1, response[..., None])[..., 0]
    assert_close(logprobs, expected)


def _tiny_lm(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def test_hf_generator_returns_consistent_ids_masks_and_text():
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    model = _tiny_lm(tokenizer)
    generator = generator_for(model, tokenizer)
    assert isinstance(generator, HFGenerator)
    assert generator.stop_ids == stop_token_ids(tokenizer, model)
    queries = tokenize_prompts(
        tokenizer, ["hello there", "how do I keep flowers fresh"], chat=True, max_tokens=64
    )
    gen = GenerationSection(max_new_tokens=6, temperature=1.0, top_p=1.0)
    torch.manual_seed(1)
    out = generator.generate(queries, gen)
    assert isinstance(out, Generations)
    b, p = out.query_ids.shape
    assert (b, p) == (2, max(len(q) for q in queries))
    assert out.response_ids.shape[1] == int(out.response_mask.sum(1).max()) <= 6
    assert out.input_ids.shape == out.attention_mask.shape == (2, p + out.response_ids.shape[1])
    # pads after each response, the text is the decoded valid tokens
    assert (out.response_ids[~out.response_mask] == tokenizer.pad_token_id).all()
    for row in range(2):
        ids = out.response_ids[row][out.response_mask[row]]
        assert out.texts[row] == tokenizer.decode(ids, skip_special_tokens=True).strip()
    torch.manual_seed(1)
    again = generator.generate(queries, gen)
    assert torch.equal(again.response_ids, out.response_ids)  # seeded sampling repeats


def test_greedy_generation_is_the_argmax_of_the_training_forward():
    from rlhf_cli.generation import forward_logits
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    model = _tiny_lm(tokenizer)
    queries = tokenize_prompts(
        tokenizer, ["a short one", "a somewhat longer prompt here"], chat=False, max_tokens=64
    )
    out = HFGenerator(model, tokenizer, [-1]).generate(
        queries, GenerationSection(max_new_tokens=5, do_sample=False)
    )
    with torch.no_grad():
        logits = forward_logits(model, out.input_ids, out.attention_mask)
    p = out.query_ids.shape[1]
    assert torch.equal(logits[:, p - 1 : -1].argmax(-1), out.response_ids)
