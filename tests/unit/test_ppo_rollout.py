"""PPO's rollout on a tiny model: the actor's left-padded forward, the zero-initialised value
head, and the scores that training uses."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaForCausalLM

from rlhf_cli.generation import left_pad
from rlhf_cli.ppo.models import PolicyAndValue, zero_value_head
from rlhf_cli.scoring import Scores


@pytest.fixture
def tiny_actor(llama_config) -> PolicyAndValue:
    torch.manual_seed(0)
    config = llama_config(vocab_size=50, pad_token_id=0, tie_word_embeddings=False)
    return PolicyAndValue(LlamaForCausalLM(config).eval(), value_head=zero_value_head(32))


def test_left_padded_forward_matches_unpadded(tiny_actor):
    # the reference/value passes must see generation's positions: padding changes nothing
    actor = tiny_actor
    short, long = [5, 6, 7], [8, 9, 10, 11, 12]
    ids, mask = left_pad([short, long], pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():  # the last 2 tokens as the "response": logits predicting them
        batched, _ = actor(ids, mask, 2)
        alone, _ = actor(torch.tensor([short]), torch.ones(1, 3, dtype=torch.long), 2)
    assert batched.shape[:2] == (2, 2)
    assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)


def test_actor_returns_the_logits_and_values_of_the_response_positions(tiny_actor):
    # position p-1+i predicts response token i: compare with a full forward
    actor = tiny_actor
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10, 11, 12]], pad_id=0, device=torch.device("cpu"))
    torch.nn.init.normal_(actor.value_head.weight)
    with torch.no_grad():
        logits, values = actor(ids, mask, 3)
        out = actor.policy(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        full_values = actor.value_head(out.hidden_states[-1]).squeeze(-1)
    assert_close(logits, out.logits[:, 0:3], atol=1e-5, rtol=1e-5)
    assert_close(values, full_values[:, 0:3], atol=1e-5, rtol=1e-5)


def test_the_shared_value_head_keeps_no_layer_but_the_last(tiny_actor):
    """Values come from the LM head's input, not from `output_hidden_states` (which would keep
    every layer's hidden states of the batch alive)."""
    asked = []
    hook = tiny_actor.policy.register_forward_pre_hook(
        lambda module, args, kwargs: asked.append(kwargs.get("output_hidden_states")),
        with_kwargs=True,
    )
    ids, mask = left_pad([[5, 6, 7]], pad_id=0, device=torch.device("cpu"))
    try:
        tiny_actor(ids, mask, 2)
    finally:
        hook.remove()
    assert asked == [None]


def test_value_head_starts_at_zero(tiny_actor):
    actor = tiny_actor
    ids, mask = left_pad([[5, 6, 7]], pad_id=0, device=torch.device("cpu"))
    _, values = actor(ids, mask, 2)
    assert values.shape == (1, 2)
    assert torch.count_nonzero(values) == 0


def tiny_vocab_policy(llama_config) -> tuple[object, LlamaForCausalLM]:
    """The tiny tokenizer and a seeded small Llama over its vocabulary."""
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    torch.manual_seed(0)
    config = llama_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    return tokenizer, LlamaForCausalLM(config)


class _ConstantScorer:
    """Scores every response 1.0, so the penalty is all that changes a score."""

    def scored(self, prompts, responses, keywords=None):
        return Scores(torch.ones(len(prompts)), 0, {})


def _greeting_rollout(actor, policy, tokenizer, cfg, rows: int, reference=None):
    """`rows` answers of `policy` to "hello there friend", each scored 1.0, stopping at EOS;
    the reference is `reference` (a frozen copy), else the policy itself."""
    from rlhf_cli.generation import HFGenerator
    from rlhf_cli.modeling import Reference
    from rlhf_cli.ppo.rollout import rollout_batch

    return rollout_batch(
        actor,
        Reference(policy, frozen_copy=policy if reference is None else reference),
        _ConstantScorer(),
        HFGenerator(policy, tokenizer, [tokenizer.eos_token_id]).generate(
            [tokenizer("hello there friend")["input_ids"]] * rows, cfg.generation
        ),
        ["p"] * rows,
        cfg,
    )


@pytest.mark.parametrize("stop_on_anything", [True, False])
def test_missing_eos_penalty_hits_only_responses_that_never_end(stop_on_anything, llama_config):
    from rlhf_cli.generation import HFGenerator
    from rlhf_cli.modeling import Reference, load_tokenizer
    from rlhf_cli.ppo.rollout import rollout_batch
    from rlhf_cli.recipe import GenerationSection, PpoSection

    tokenizer = load_tokenizer("builtin:tiny-lm")
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=len(tokenizer),
        num_hidden_layers=1,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    policy = LlamaForCausalLM(config).eval()
    actor = PolicyAndValue(policy, value_head=zero_value_head(32))
    stops = list(range(len(tokenizer))) if stop_on_anything else [tokenizer.eos_token_id]
    queries = [tokenizer("hello there friend")["input_ids"]] * 4
    cfg = PpoSection(
        batch_size=4,
        mini_batch_size=2,
        gradient_accumulation_steps=1,
        missing_eos_penalty=0.5,
        generation=GenerationSection(max_new_tokens=3, temperature=1.0, top_p=1.0),
    )
    rollout = rollout_batch(
        actor,
        Reference(policy, frozen_copy=policy),
        _ConstantScorer(),
        HFGenerator(policy, tokenizer, stops).generate(queries, cfg.generation),
        ["p"] * 4,
        cfg,
    )
    assert rollout.ended.all() == stop_on_anything
    assert_close(rollout.scores, 1.0 - 0.5 * (~rollout.ended).float())
    assert_close(rollout.raw_scores, torch.ones(4))


@pytest.mark.parametrize("support", ["sampled", "full"])
def test_the_mismatch_check_keeps_the_samplers_distribution_whatever_the_support(
    llama_config, support
):
    """With `logprob_support: full` the old and reference log-probs are the temperature-only
    softmax's, below the nucleus's renormalised ones by log(1 / nucleus mass); the mismatch
    still compares the sampler with the training forward under the sampler's distribution,
    so it stays float noise with either support."""
    from rlhf_cli.ppo.rollout import logprob_mismatch
    from rlhf_cli.recipe import GenerationSection, PpoSection

    tokenizer, policy = tiny_vocab_policy(llama_config)
    policy.eval()
    cfg = PpoSection(
        batch_size=4,
        mini_batch_size=2,
        gradient_accumulation_steps=1,
        logprob_support=support,
        generation=GenerationSection(max_new_tokens=6, temperature=1.0, top_p=0.8),
    )
    actor = PolicyAndValue(policy, value_head=zero_value_head(32))
    rollout = _greeting_rollout(actor, policy, tokenizer, cfg, 4)
    mask = rollout.response_mask
    assert logprob_mismatch(rollout) < 1e-4
    gap = (rollout.warped_logprobs - rollout.logprobs)[mask]
    if support == "sampled":
        assert torch.equal(gap, torch.zeros_like(gap))
    else:  # top-p 0.8 cuts up to a fifth of the mass: gaps in [0, log 1.25 = 0.22]
        assert (gap >= -1e-6).all() and (gap <= 0.2232).all() and gap.max() > 0.05
    assert_close(rollout.ref_logprobs, rollout.logprobs)  # the same weights, the same support


def test_scores_are_penalised_then_normalised_then_clipped():
    from rlhf_cli.ppo.core import RunningMoments
    from rlhf_cli.ppo.rollout import shaped_scores
    from rlhf_cli.recipe import PpoSection

    cfg = PpoSection(missing_eos_penalty=1.0, reward_clip=1.0)
    raw, ended = torch.tensor([2.0, -0.5, 0.3]), torch.tensor([True, False, True])
    # penalty first: -0.5 - 1 = -1.5, then the clip: the clipped scores stay within ±1
    assert_close(shaped_scores(raw, ended, cfg), torch.tensor([1.0, -1.0, 0.3]))
    normed = PpoSection(missing_eos_penalty=1.0, score_norm=True)
    moments = RunningMoments()
    out = shaped_scores(raw, ended, normed, moments)
    penalised = torch.tensor([2.0, -1.5, 0.3])
    assert_close(out, (penalised - penalised.mean()) / (penalised.std() + 1e-8))
    assert moments.count == 3
    # the gather hook sees every process's scores: here a second "process" adds two more
    moments = RunningMoments()
    shaped_scores(raw, ended, normed, moments, gather=lambda x: torch.cat([x, x[:2]]))
    assert moments.count == 5


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_entropy_enters_the_graph_only_when_it_is_in_the_loss(llama_config, entropy_coef):
    """At entropy_coef 0 the entropy is measured without autograd: a (b, r, vocab) softmax is
    not kept for a backward pass that would multiply it by 0."""
    from rlhf_cli.ppo.loop import minibatch_loss
    from rlhf_cli.recipe import GenerationSection, PpoSection

    tokenizer, policy = tiny_vocab_policy(llama_config)
    actor = PolicyAndValue(policy, value_head=zero_value_head(32))
    cfg = PpoSection(
        batch_size=2,
        mini_batch_size=2,
        gradient_accumulation_steps=1,
        entropy_coef=entropy_coef,
        generation=GenerationSection(max_new_tokens=4, temperature=1.0, top_p=0.9),
    )
    rollout = _greeting_rollout(actor, policy, tokenizer, cfg, 2)
    actor.train()
    ones = torch.ones_like(rollout.values)
    loss, parts = minibatch_loss(cfg, actor, rollout, torch.arange(2), ones, ones)
    assert parts["ppo/policy/entropy"].requires_grad == (entropy_coef > 0)
    assert loss.requires_grad and torch.isfinite(loss)
    # at the rollout's own weights the ratio is 1: the policy loss is -mean(advantages) = -1
    assert_close(parts["ppo/loss/policy"], torch.tensor(-1.0), atol=1e-5, rtol=0)


def test_the_kl_loss_is_importance_weighted_unless_switched_off(llama_config):
    """`kl_importance_weight` reaches the loss: at the rollout's own weights ρ = 1, so the KL
    loss has the same value either way, and only its gradient differs (by k3's own term)."""
    import copy

    from rlhf_cli.ppo.loop import minibatch_loss
    from rlhf_cli.recipe import GenerationSection, PpoSection

    tokenizer, policy = tiny_vocab_policy(llama_config)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    actor = PolicyAndValue(policy, value_head=zero_value_head(32))
    out = {}
    for weighted in (True, False):
        cfg = PpoSection(
            batch_size=2, mini_batch_size=2, gradient_accumulation_steps=1, kl_in="loss",
            kl_estimator="k3", kl_importance_weight=weighted, advantage_estimator="grpo",
            num_generations=2, generation=GenerationSection(max_new_tokens=4, top_p=0.9),
        )  # fmt: skip
        torch.manual_seed(0)
        rollout = _greeting_rollout(actor, policy, tokenizer, cfg, 2, reference)
        actor.train()
        actor.zero_grad()
        zeros = torch.zeros_like(rollout.values)  # no policy-gradient term: the KL loss alone
        loss, parts = minibatch_loss(cfg, actor, rollout, torch.arange(2), zeros, zeros, 1.0)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        out[weighted] = parts["ppo/loss/kl"].detach(), grad
    assert out[True][0] > 0
    assert_close(out[True][0], out[False][0])
    assert not torch.allclose(out[True][1], out[False][1], atol=1e-6)


# ── the update's mini-batches: the same global split for one process or N ─────────────────────


@pytest.mark.parametrize("batch, mini", [(32, 8), (16, 4), (8, 8), (12, 4)])
def test_minibatches_are_the_same_global_rows_for_any_number_of_processes(batch, mini):
    from rlhf_cli.ppo.distributed import minibatch_rows

    def global_rows(world: int) -> list[list[int]]:
        shares = [
            minibatch_rows(batch, mini, world, rank, torch.Generator().manual_seed(5))
            for rank in range(world)
        ]  # the generator draws alike on every process
        return [
            sorted(int(i) * world + rank for rank in range(world) for i in shares[rank][k])
            for k in range(batch // mini)
        ]

    one = global_rows(1)
    assert sorted(r for rows in one for r in rows) == list(range(batch))  # a partition
    assert all(len(rows) == mini for rows in one)
    for world in (2, 4):
        if mini % world == 0:
            assert global_rows(world) == one
            shares = minibatch_rows(batch, mini, world, 1, torch.Generator().manual_seed(5))
            assert all(len(s) == mini // world for s in shares)  # an even split
    other = minibatch_rows(batch, mini, 1, 0, torch.Generator().manual_seed(6))
    if batch // mini > 1:
        assert [sorted(s.tolist()) for s in other] != one  # reshuffled by the generator


def test_row_seeds_differ_by_row_and_iteration_and_fit_int64():
    from rlhf_cli.generation import row_seed

    seeds = {row_seed(42, it, row) for it in range(1, 50) for row in range(64)}
    assert len(seeds) == 49 * 64
    assert 0 <= row_seed(2**40, 10**6, 10**4) < 2**63


def test_group_advantages_see_every_member_whichever_process_holds_it():
    """Rows are dealt to processes in turn (rank, rank + world, ...), so a group of 2 lies on
    both processes; `global_rows` hands the statistic the global batch in order."""
    from types import SimpleNamespace

    from rlhf_cli.ppo.core import leave_one_out_advantages
    from rlhf_cli.ppo.distributed import global_rows

    scores = torch.tensor([1.0, 2.0, 3.0, 6.0])  # groups (1, 2) and (3, 6)
    mine, theirs = scores[1::2], scores[0::2]  # rank 1 holds rows 1 and 3
    acc = SimpleNamespace(
        num_processes=2,
        process_index=1,
        device=torch.device("cpu"),
        gather=lambda local: torch.cat([theirs, local]),  # what accelerate's gather returns
    )
    got = global_rows(acc)(lambda r: leave_one_out_advantages(r, 2), mine)
    assert got.tolist() == [1.0, 3.0]  # rows 1 and 3 of [-1, 1, -3, 3]
