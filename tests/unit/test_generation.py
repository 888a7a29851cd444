"""The generation module: masks from stop tokens, generation's positions, left padding, log-probs
at the sampling temperature, and one HF backend whose answers agree with its own tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaForCausalLM

from rlhf_cli.generation import (
    Generations,
    HFGenerator,
    generator_for,
    left_pad,
    position_ids_from,
    response_logits,
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
    logits = torch.randn(2, 3, 11)
    response = torch.randint(0, 11, (2, 3))
    gen = GenerationSection(temperature=0.7, top_p=1.0, top_k=0)
    logprobs = response_logprobs(logits, response, gen)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, response[..., None])[..., 0]
    assert_close(logprobs, expected)


def test_logprobs_follow_top_k_and_top_p_by_hand():
    # one position, vocab 5, T = 1: probs 0.4, 0.3, 0.2, 0.07, 0.03
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = probs.log().view(1, 1, 5)
    token = torch.tensor([[1]])
    # top-p 0.8: the ascending cumulative mass of 0.03, 0.07 (0.10) is <= 0.2 -> both cut; 0.2
    # stays (cumulative 0.30 > 0.2): support {0.4, 0.3, 0.2}, p(token 1) = 0.3 / 0.9
    lp = response_logprobs(logits, token, GenerationSection(temperature=1.0, top_p=0.8))
    assert_close(lp, torch.tensor([[math.log(0.3 / 0.9)]]))
    # top-k 2: support {0.4, 0.3}: p = 0.3 / 0.7
    lp = response_logprobs(logits, token, GenerationSection(temperature=1.0, top_p=1.0,
                                                               top_k=2))  # fmt: skip
    assert_close(lp, torch.tensor([[math.log(0.3 / 0.7)]]))
    # greedy decoding: the plain softmax
    lp = response_logprobs(logits, token, GenerationSection(do_sample=False, top_p=0.5))
    assert_close(lp, torch.tensor([[math.log(0.3)]]))


def test_a_token_the_nucleus_no_longer_holds_keeps_a_finite_logprob():
    # token 4 (p 0.03) is outside top-p 0.8; it is put back into the support, not -inf
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    lp = response_logprobs(probs.log().view(1, 1, 5), torch.tensor([[4]]),
                              GenerationSection(temperature=1.0, top_p=0.8))  # fmt: skip
    assert_close(lp, torch.tensor([[math.log(0.03 / 0.93)]]))


def test_full_support_ignores_top_p_and_keeps_the_temperature_by_hand():
    # probs 0.4, 0.3, 0.2, 0.07, 0.03, token 1, top-p 0.8.
    # T = 1: sampled support {0.4, 0.3, 0.2} -> 0.3 / 0.9; full -> 0.3
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits, token = probs.log().view(1, 1, 5), torch.tensor([[1]])
    gen = GenerationSection(temperature=1.0, top_p=0.8)
    assert_close(response_logprobs(logits, token, gen), torch.tensor([[math.log(0.3 / 0.9)]]))
    assert_close(response_logprobs(logits, token, gen, "full"), torch.tensor([[math.log(0.3)]]))
    # T = 2: softmax(log p / 2) is proportional to sqrt(p): roots 0.63246, 0.54772, 0.44721,
    # 0.26458, 0.17321, sum 2.06518 -> full p(1) = 0.54772 / 2.06518 = 0.26522. Sampled: the
    # tempered probs ascending are 0.08387, 0.12811, ...; cumulative 0.08387 <= 1 - 0.8 is cut,
    # 0.21198 is not: support without token 4, p(1) = 0.54772 / 1.89197 = 0.28950
    gen = GenerationSection(temperature=2.0, top_p=0.8)
    full = response_logprobs(logits, token, gen, "full")
    assert_close(full, torch.tensor([[math.log(0.26522)]]), atol=1e-4, rtol=0)
    sampled = response_logprobs(logits, token, gen)
    assert_close(sampled, torch.tensor([[math.log(0.28950)]]), atol=1e-4, rtol=0)


def test_only_the_full_support_gives_tokens_outside_the_nucleus_a_gradient():
    # d log p(0) / d z_j = 1[j = 0] - p_j. Full: dz_4 = -0.03. Sampled (top-p 0.8 keeps tokens
    # 0, 1, 2): tokens 3 and 4 are outside the softmax, no gradient; dz_1 = -0.3 / 0.9
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    gen = GenerationSection(temperature=1.0, top_p=0.8)
    grads = {}
    for support in ("sampled", "full"):
        logits = probs.log().view(1, 1, 5).requires_grad_()
        response_logprobs(logits, torch.tensor([[0]]), gen, support).sum().backward()
        grads[support] = logits.grad.view(5)
    assert_close(grads["full"], torch.tensor([0.6, -0.3, -0.2, -0.07, -0.03]))
    assert_close(grads["sampled"], torch.tensor([1 - 0.4 / 0.9, -0.3 / 0.9, -0.2 / 0.9, 0, 0]))


@pytest.fixture
def tiny_lm(llama_config):
    """The tiny tokenizer and a 1-layer random Llama over its vocabulary."""
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=len(tokenizer),
        num_hidden_layers=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return tokenizer, LlamaForCausalLM(config).eval()


def test_hf_generator_returns_consistent_ids_masks_and_text(tiny_lm):
    tokenizer, model = tiny_lm
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


def test_greedy_generation_is_the_argmax_of_the_training_forward(tiny_lm):
    from rlhf_cli.generation import forward_logits

    tokenizer, model = tiny_lm
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
    with torch.no_grad():
        kept = response_logits(model, out.input_ids, out.attention_mask, 5)
    assert_close(kept, logits[:, p - 1 : -1])  # logits_to_keep gives the same numbers


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (0.7, 20), (1.0, 0)])
def test_sampler_logprobs_match_the_training_forward(tiny_lm, top_p, top_k, sampler_gap):
    """What the sampler drew each token from == what the loss computes (< 1e-4), even when
    the checkpoint's generation_config asks for a repetition penalty, top-k 7 and bans words."""
    tokenizer, model = tiny_lm
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.top_k = 7
    model.generation_config.bad_words_ids = [[5], [6]]
    queries = tokenize_prompts(
        tokenizer, ["hello there", "a longer prompt for the sampler"], chat=True, max_tokens=64
    )
    gen = GenerationSection(max_new_tokens=12, temperature=0.8, top_p=top_p, top_k=top_k)
    torch.manual_seed(3)
    out = generator_for(model, tokenizer).generate(queries, gen)
    assert sampler_gap(model, out, gen) < 1e-4
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is kept


def test_long_prompts_lose_their_start_inside_the_template():
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    long = " ".join(f"word{i}" for i in range(200)) + " the very end"
    short = tokenize_prompts(tokenizer, ["hi"], chat=True, max_tokens=512)[0]
    empty = tokenize_prompts(tokenizer, [""], chat=True, max_tokens=512)[0]
    ids = tokenize_prompts(tokenizer, [long], chat=True, max_tokens=40)[0]
    assert len(ids) <= 40
    text = tokenizer.decode(ids)
    assert "the very end" in text and "word0 " not in text
    # the chat header and the generation prompt survive: same first and last tokens as any prompt
    assert ids[:2] == empty[:2] == short[:2] and ids[-3:] == empty[-3:] == short[-3:]
    plain = tokenize_prompts(tokenizer, [long], chat=False, max_tokens=40)[0]
    assert len(plain) <= 40 and tokenizer.decode(plain).endswith("the very end")


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_chunked_logprobs_give_the_same_values_and_gradients(monkeypatch, top_p):
    import rlhf_cli.generation.core as generation

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, requires_grad=True)
    ids = torch.randint(0, 17, (3, 5))
    gen = GenerationSection(temperature=0.9, top_p=top_p)
    whole = response_logprobs(logits, ids, gen)
    (grad_whole,) = torch.autograd.grad(whole.sum(), logits)
    monkeypatch.setattr(generation, "LOGPROB_CHUNK_ROWS", 4)  # 15 positions: 4 uneven chunks
    chunked = response_logprobs(logits, ids, gen)
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert_close(chunked, whole)
    assert_close(grad_chunked, grad_whole)
    expected = torch.log_softmax(logits / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    if top_p == 1.0:
        assert_close(whole, expected)
    else:  # the nucleus renormalises: every kept token gains probability
        assert (whole >= expected - 1e-6).all() and (whole > expected).any()


# ── per-row seeded sampling: the same responses whatever the batch or process ──────────────────


def test_hashed_uniforms_are_uniform_and_a_function_of_seed_step_and_token():
    from rlhf_cli.generation.hf import hashed_uniform

    u = hashed_uniform(torch.tensor([0, 1, 2**62, -5]), step=3, vocab=50_000)
    assert u.shape == (4, 50_000) and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # deciles hold a tenth each (a 2e5-draw histogram: ±1% is > 6 standard errors)
    counts = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert (counts - 0.1).abs().max() < 0.01
    again = hashed_uniform(torch.tensor([2**62, 0]), step=3, vocab=50_000)
    assert torch.equal(again, u[[2, 0]])  # a row's numbers do not depend on its neighbours
    assert not torch.equal(hashed_uniform(torch.tensor([0]), 4, 50_000), u[:1])  # nor repeat
    assert (u[0] - u[1]).abs().mean() > 0.2  # neighbouring seeds are unrelated


def test_gumbel_argmax_draws_from_the_softmax():
    """Greedy decoding of the noisy scores samples softmax(scores): frequencies over 20000
    seeded rows match the probabilities within 4 standard errors."""
    from rlhf_cli.generation.hf import SeededGumbel

    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    n = 20_000
    noisy = SeededGumbel(torch.arange(n))(torch.zeros(n, 1), scores.expand(n, -1))
    freq = torch.bincount(noisy.argmax(1), minlength=5).double() / n
    probs = torch.softmax(scores.double(), 0)
    assert freq[4] == 0  # a token the warpers removed is never drawn
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt() + 1e-12).all()


def test_seeded_rows_sample_alike_in_any_batch(tiny_lm, sampler_gap):
    """A row's response depends on its seed alone: not on the rows beside it, the padding they
    force, or the torch RNG; its recorded log-probs still match the training forward."""
    tokenizer, model = tiny_lm
    generator = generator_for(model, tokenizer)
    gen = GenerationSection(max_new_tokens=10, temperature=0.9, top_p=0.9)
    prompts = ["hello there", "a much longer prompt that forces left padding on others", "hi"]
    q = tokenize_prompts(tokenizer, prompts, chat=True, max_tokens=64)
    torch.manual_seed(0)
    together = generator.generate(q, gen, seeds=[11, 12, 13])
    torch.manual_seed(99)
    alone = generator.generate([q[0]], gen, seeds=[11])
    swapped = generator.generate([q[2], q[1]], gen, seeds=[13, 12])

    def tokens(out: Generations, row: int) -> list[int]:
        return out.response_ids[row][out.response_mask[row]].tolist()

    assert tokens(alone, 0) == tokens(together, 0)
    assert tokens(swapped, 0) == tokens(together, 2) and tokens(swapped, 1) == tokens(together, 1)
    other = generator.generate([q[0]] * 4, gen, seeds=[1, 2, 3, 4])
    assert len({tuple(tokens(other, r)) for r in range(4)}) > 1  # seeds do change the draw
    assert sampler_gap(model, together, gen) < 1e-4


@pytest.mark.parametrize("seeds", [None, [5, 6]])
def test_generate_raises_no_generation_flag_warning(tiny_lm, caplog, seeds):
    """Seeded rows decode by argmax over Gumbel-perturbed scores: a top-k flag set for that
    greedy call made transformers print 'generation flags are not valid' on every batch."""
    tokenizer, model = tiny_lm
    q = tokenize_prompts(tokenizer, ["hello there", "hi"], chat=True, max_tokens=64)
    with caplog.at_level("WARNING"):
        generator_for(model, tokenizer).generate(q, GenerationSection(max_new_tokens=4), seeds)
    assert not [r for r in caplog.records if "generation flags" in r.getMessage()]
