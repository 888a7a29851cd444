"""Unit tests for rlhf_cli.ppo.core: hand-computed values and a loop-free GAE reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_cli.generation import logprobs_from_logits
from rlhf_cli.ppo.core import (
    ENTROPY_CHUNK_ROWS,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    aggregation_units,
    approx_kl,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    group_normalized_advantages,
    kl_estimate,
    kl_penalized_rewards,
    leave_one_out_advantages,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    reinforce_pp_advantages,
    tis_weights,
)

BIG = 1e6


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# --------------------------------------------------------------------------- masked statistics

X = t([1.0, 2.0, 3.0, BIG], [4.0, BIG, BIG, BIG], [BIG, BIG, BIG, BIG])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


def test_masked_mean_ignores_huge_masked_values() -> None:
    # valid elements: 1, 2, 3, 4 -> mean 10 / 4 = 2.5
    assert_close(masked_mean(X, M), scalar(2.5))
    # per row: [1,2,3] -> 2; [4] -> 4; all-masked row -> 0 (not NaN)
    assert_close(masked_mean(X, M, dim=1), t([2.0, 4.0, 0.0])[0])


def test_masked_mean_accepts_01_mask_and_all_masked_is_zero() -> None:
    assert_close(masked_mean(X, M.long()), scalar(2.5))
    assert_close(masked_mean(X, M.float()), scalar(2.5))
    out = masked_mean(X, torch.zeros_like(M))
    assert not torch.isnan(out)
    assert_close(out, scalar(0.0))


def test_masked_var_unbiased_and_biased() -> None:
    # deviations from 2.5: -1.5, -0.5, 0.5, 1.5 -> squares sum 2.25+0.25+0.25+2.25 = 5
    assert_close(masked_var(X, M), scalar(5.0 / 3.0))  # / (n - 1) = 3
    assert_close(masked_var(X, M, unbiased=False), scalar(5.0 / 4.0))  # / n = 4


def test_masked_whiten_hand_example() -> None:
    # (x - 2.5) * rsqrt(5/3 + 1e-8) at valid positions, 0 elsewhere
    s = 1.0 / math.sqrt(5.0 / 3.0 + 1e-8)
    expected = t(
        [-1.5 * s, -0.5 * s, 0.5 * s, 0.0],
        [1.5 * s, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    )
    out = masked_whiten(X, M)
    assert_close(out, expected)
    # whitened valid elements: mean 0, unbiased variance 1 (up to the 1e-8 eps)
    assert_close(masked_mean(out, M), scalar(0.0))
    assert_close(masked_var(out, M), scalar(1.0))


def test_masked_whiten_keep_mean() -> None:
    # shift_mean=False: (x - 2.5) * s + 2.5; masked positions still 0
    s = 1.0 / math.sqrt(5.0 / 3.0 + 1e-8)
    out = masked_whiten(X, M, shift_mean=False)
    expected = t(
        [-1.5 * s + 2.5, -0.5 * s + 2.5, 0.5 * s + 2.5, 0.0],
        [1.5 * s + 2.5, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    )
    assert_close(out, expected)
    assert_close(masked_mean(out, M), scalar(2.5))
    assert_close(masked_var(out, M), scalar(1.0))


# --------------------------------------------------------------------------- GAE


def gae_reference(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop-free GAE for right-padded (prefix) masks.

    A_i = sum_{j >= i} (gamma * lam)^(j - i) * delta_j, with deltas zeroed past the end.
    """
    m = mask.to(values.dtype)
    v = values * m
    r = rewards * m
    zero = torch.zeros_like(v[:, :1])
    v_next = torch.cat([v[:, 1:], zero], dim=1)
    m_next = torch.cat([m[:, 1:], zero], dim=1)
    deltas = (r + gamma * v_next * m_next - v) * m
    n = values.shape[1]
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    exponent = (j - i).clamp(min=0).to(values.dtype)
    discount = torch.where(j >= i, (gamma * lam) ** exponent, torch.zeros_like(exponent))
    adv = (deltas @ discount.T) * m
    return adv, (adv + v) * m


def prefix_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (1.0, 0.0)])
def test_compute_gae_matches_loop_free_reference(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(0)
    n = 9
    lengths = [9, 5, 1, 0, 3, 7]
    mask = prefix_mask(lengths, n)
    values = torch.randn(len(lengths), n, generator=g, dtype=torch.float64)
    rewards = torch.randn(len(lengths), n, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(values, rewards, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(values, rewards, mask, gamma, lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_compute_gae_hand_example() -> None:
    # gamma = 1, lam = 0.95; V = [0.5, 1.0, 1.5], r = [0.1, -0.2, 1.0], 4th token is padding
    # delta_2 = 1.0 - 1.5 = -0.5                (m_3 = 0, so V_3 = 100 is ignored)
    # delta_1 = -0.2 + 1.5 - 1.0 = 0.3
    # delta_0 = 0.1 + 1.0 - 0.5 = 0.6
    # A_2 = -0.5
    # A_1 = 0.3 + 0.95 * -0.5 = -0.175
    # A_0 = 0.6 + 0.95 * -0.175 = 0.43375
    # returns = A + V = [0.93375, 0.825, 1.0, 0]
    values = t([0.5, 1.0, 1.5, 100.0])
    rewards = t([0.1, -0.2, 1.0, 100.0])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = compute_gae(values, rewards, mask, gamma=1.0, lam=0.95)
    assert_close(adv, t([0.43375, -0.175, -0.5, 0.0]))
    assert_close(ret, t([0.93375, 0.825, 1.0, 0.0]))


def test_compute_gae_length_one_response() -> None:
    # a single token: A = r - V = 2.0 - 0.5 = 1.5; returns = A + V = r = 2.0
    adv, ret = compute_gae(t([0.5]), t([2.0]), torch.tensor([[1]]), gamma=0.99, lam=0.95)
    assert_close(adv, t([1.5]))
    assert_close(ret, t([2.0]))
    # same length-1 response padded to 3 tokens
    adv, ret = compute_gae(
        t([0.5, 7.0, 7.0]), t([2.0, 7.0, 7.0]), torch.tensor([[1, 0, 0]]), gamma=0.99, lam=0.95
    )
    assert_close(adv, t([1.5, 0.0, 0.0]))
    assert_close(ret, t([2.0, 0.0, 0.0]))


def test_compute_gae_all_masked_row_is_zero() -> None:
    values = t([1.0, 2.0, 3.0], [BIG, BIG, BIG])
    rewards = t([1.0, 1.0, 1.0], [BIG, BIG, BIG])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    adv, ret = compute_gae(values, rewards, mask, gamma=1.0, lam=0.95)
    assert not torch.isnan(adv).any() and not torch.isnan(ret).any()
    assert_close(adv[1], torch.zeros(3, dtype=torch.float64))
    assert_close(ret[1], torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("layout", ["prefix", "random"])
def test_compute_gae_no_leakage_from_masked_positions(layout: str) -> None:
    g = torch.Generator().manual_seed(1)
    b, n = 5, 8
    if layout == "prefix":
        mask = prefix_mask([8, 4, 1, 0, 6], n)
    else:
        mask = torch.rand(b, n, generator=g) > 0.4
    values = torch.randn(b, n, generator=g, dtype=torch.float64)
    rewards = torch.randn(b, n, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(values, rewards, mask, gamma=0.99, lam=0.95)
    garbage = torch.full_like(values, BIG)
    adv2, ret2 = compute_gae(
        torch.where(mask, values, garbage), torch.where(mask, rewards, -garbage), mask, 0.99, 0.95
    )
    assert_close(adv2, adv)
    assert_close(ret2, ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


# --------------------------------------------------------------------------- KL-penalized rewards


def test_kl_penalized_rewards_score_on_last_valid_token() -> None:
    # row 0: kl = logp - ref = [0.5, -1.0, 0.0, (masked) 0]
    #        rewards = -0.1 * kl = [-0.05, 0.1, 0.0, 0], + score 2.0 at index 2 (not 3)
    # row 1 (mask with a hole, [1, 0, 1, 0]): kl = [0.2, 0, -0.3, 0]
    #        rewards = [-0.02, 0, 0.03, 0], + score -1.0 at index 2 (max True index)
    logprobs = t([-1.0, -2.0, -0.5, -3.0], [-1.0, -5.0, -1.3, -4.0])
    ref = t([-1.5, -1.0, -0.5, -9.0], [-1.2, -1.0, -1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    scores = t([2.0, -1.0])[0]
    rewards, kl = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    assert_close(kl, t([0.5, -1.0, 0.0, 0.0], [0.2, 0.0, -0.3, 0.0]))
    assert_close(rewards, t([-0.05, 0.1, 2.0, 0.0], [-0.02, 0.0, 0.03 - 1.0, 0.0]))


def test_kl_penalized_rewards_kl_coef_scaling() -> None:
    # kl = [0.5, -1.0]; coef 0 -> rewards = [0, 3.0]; coef 0.4 -> [-0.2, 0.4 + 3.0]
    logprobs = t([-1.0, -2.0])
    ref = t([-1.5, -1.0])
    mask = torch.tensor([[True, True]])
    scores = t([3.0])[0]
    r0, kl0 = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.0)
    r4, kl4 = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.4)
    assert_close(r0, t([0.0, 3.0]))
    assert_close(r4, t([-0.2, 3.4]))
    assert_close(kl0, kl4)
    assert_close(kl4, t([0.5, -1.0]))


def test_kl_penalized_rewards_all_masked_row_gets_nothing() -> None:
    logprobs = t([-1.0, -2.0], [-1.0, -2.0])
    ref = t([-1.5, -1.0], [-9.0, -9.0])
    mask = torch.tensor([[1, 1], [0, 0]])
    rewards, kl = kl_penalized_rewards(t([1.0, 5.0])[0], logprobs, ref, mask, kl_coef=0.1)
    # row 0: kl [0.5, -1.0] -> rewards [-0.05, 0.1 + 1.0]; row 1: all zeros, no score 5.0
    assert_close(rewards, t([-0.05, 1.1], [0.0, 0.0]))
    assert_close(kl, t([0.5, -1.0], [0.0, 0.0]))


def test_without_a_reference_the_rewards_are_the_scores_alone() -> None:
    # a no-KL run (β = 0) computes no reference log-probs: the score on the last valid token
    logprobs = t([-1.0, -2.0, -0.5], [-1.0, -5.0, -1.3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    rewards, kl = kl_penalized_rewards(t([2.0, -1.0])[0], logprobs, None, mask, kl_coef=0.0)
    assert kl is None
    assert_close(rewards, t([0.0, 2.0, 0.0], [0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="reference"):
        kl_penalized_rewards(t([2.0, -1.0])[0], logprobs, None, mask, kl_coef=0.1)


# --------------------------------------------------------------------------- policy loss


def _policy_case(
    ratio: float, adv: float, cliprange: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, clipfrac = ppo_policy_loss(logprobs, old, t([adv]), torch.tensor([[1]]), cliprange)
    loss.backward()
    return loss, clipfrac, logprobs.grad


def test_policy_loss_clipped_positive_advantage_has_zero_grad() -> None:
    # r = 3, A = 2, eps = 0.2: unclipped -A*r = -6, clipped -A*1.2 = -2.4
    # loss = max(-6, -2.4) = -2.4 (objective 2.4); clipped branch is constant -> grad 0
    loss, clipfrac, grad = _policy_case(3.0, 2.0)
    assert_close(loss, scalar(-2.4))
    assert torch.equal(grad, torch.zeros_like(grad))
    assert_close(clipfrac, scalar(1.0))


def test_policy_loss_unclipped_case() -> None:
    # r = 1.1 inside [0.8, 1.2], A = 2: loss = -2 * 1.1 = -2.2
    # d/dlogp (-A * exp(logp - old)) = -A * r = -2.2; both terms equal -> clipfrac 0
    loss, clipfrac, grad = _policy_case(1.1, 2.0)
    assert_close(loss, scalar(-2.2))
    assert_close(grad, t([-2.2]))
    assert_close(clipfrac, scalar(0.0))


def test_policy_loss_clipped_negative_advantage() -> None:
    # r = 0.5, A = -1: unclipped -A*r = 0.5, clipped -A*0.8 = 0.8 -> loss max = 0.8, grad 0
    loss, clipfrac, grad = _policy_case(0.5, -1.0)
    assert_close(loss, scalar(0.8))
    assert torch.equal(grad, torch.zeros_like(grad))
    assert_close(clipfrac, scalar(1.0))


def test_policy_loss_masked_tokens_do_not_contribute() -> None:
    # token 0: r = 1.1, A = 2 -> -2.2 (unclipped); token 1 masked with huge advantage
    # loss = -2.2 (mean over the one valid token); grad [-2.2, 0]; clipfrac 0
    logprobs = torch.tensor([[math.log(1.1), 3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = t([2.0, BIG])
    loss, clipfrac = ppo_policy_loss(logprobs, old, adv, torch.tensor([[True, False]]), 0.2)
    loss.backward()
    assert_close(loss, scalar(-2.2))
    assert_close(logprobs.grad, t([-2.2, 0.0]))
    assert_close(clipfrac, scalar(0.0))


def test_policy_loss_clipfrac_is_share_of_tokens() -> None:
    # tokens (r, A): (3, 2) clipped; (1.1, 2) not; (0.5, -1) clipped; 4th masked -> 2/3
    # loss = mean(-2.4, -2.2, 0.8) = -3.8 / 3
    logprobs = torch.log(t([3.0, 1.1, 0.5, 9.0]))
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = t([2.0, 2.0, -1.0, 5.0])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    assert_close(loss, scalar(-3.8 / 3.0))
    assert_close(clipfrac, scalar(2.0 / 3.0))


def test_clip_higher_widens_only_the_upper_bound() -> None:
    # tokens (r, A): (1.25, +1), (0.7, -1), (1.3, +1); eps_low 0.2
    # symmetric [0.8, 1.2]: max(-1.25, -1.2) = -1.2 clipped; max(0.7, 0.8) = 0.8 clipped;
    #   max(-1.3, -1.2) = -1.2 clipped -> loss (-1.2 + 0.8 - 1.2) / 3 = -1.6 / 3, clipfrac 1
    # clip-higher [0.8, 1.28]: 1.25 inside -> -1.25 unclipped; 0.8 clipped (the low side is
    #   unchanged); max(-1.3, -1.28) = -1.28 clipped -> loss -1.73 / 3, clipfrac 2/3
    logprobs = torch.log(t([1.25, 0.7, 1.3])).requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv, mask = t([1.0, -1.0, 1.0]), torch.ones(1, 3, dtype=torch.bool)
    loss, clipfrac = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    assert_close(loss, scalar(-1.6 / 3.0))
    assert_close(clipfrac, scalar(1.0))
    loss, clipfrac = ppo_policy_loss(logprobs, old, adv, mask, 0.2, cliprange_high=0.28)
    assert_close(loss, scalar(-1.73 / 3.0))
    assert_close(clipfrac, scalar(2.0 / 3.0))
    # only the unclipped token moves the policy: d(-A r)/dlogp = -A r = -1.25, over 3 tokens
    loss.backward()
    assert_close(logprobs.grad, t([-1.25 / 3.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- loss aggregation

# rows: [1, 2, 3] (3 tokens), [4] (1 token), all masked (no sequence)
AGG_X = t([1.0, 2.0, 3.0, BIG], [4.0, BIG, BIG, BIG], [BIG, BIG, BIG, BIG])


@pytest.mark.parametrize(
    "aggregation, expected, units",
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4, 4),  # every token alike
        ("seq_mean_token_mean", (2.0 + 4.0) / 2, 2),  # row means 6/3 and 4/1
        ("seq_mean_token_sum_norm", (6 / 4 + 4 / 4) / 2, 2),  # row sums over norm_len 4
    ],
)
def test_loss_aggregations_by_hand(aggregation: str, expected: float, units: int) -> None:
    assert_close(aggregate_loss(AGG_X, M, aggregation, norm_len=4), scalar(expected))
    assert aggregation_units(M, aggregation).item() == units


def test_loss_aggregation_errors_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="norm_len"):
        aggregate_loss(AGG_X, M, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(AGG_X, M, "seq_sum")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregation_units(M, "seq_sum")
    nothing = torch.zeros_like(M)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert aggregate_loss(AGG_X, nothing, aggregation, norm_len=4).item() == 0.0


def test_the_losses_aggregate_their_per_token_terms() -> None:
    # rows [A 1, 1, 1] and [A 4]; ratio 1 everywhere: per-token policy loss -A
    # token_mean -(1 + 1 + 1 + 4) / 4 = -1.75; seq_mean_token_mean -(1 + 4) / 2 = -2.5;
    # seq_mean_token_sum_norm (norm 4) -(3/4 + 4/4) / 2 = -0.875
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    adv, mask = t([1.0, 1.0, 1.0], [4.0, BIG, BIG]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    # values 0, returns as adv, inside the clip: per-token value loss adv^2, halved
    # token_mean 0.5 (1 + 1 + 1 + 16) / 4 = 2.375; seq_mean 0.5 (1 + 16) / 2 = 4.25;
    # sum_norm 0.5 (3/4 + 16/4) / 2 = 1.1875
    for aggregation, policy, value in [
        ("token_mean", -1.75, 2.375),
        ("seq_mean_token_mean", -2.5, 4.25),
        ("seq_mean_token_sum_norm", -0.875, 1.1875),
    ]:
        how = {"aggregation": aggregation, "norm_len": 4}
        loss, _ = ppo_policy_loss(zeros, zeros, adv, mask, 0.2, **how)
        assert_close(loss, scalar(policy))
        loss, _ = ppo_value_loss(zeros, zeros, adv, mask, 100.0, **how)
        assert_close(loss, scalar(value))


# a global mini-batch of four responses: [1, 2, 3], [5], [4], [0]; norm_len 3
#   token_mean (1 + 2 + 3 + 5 + 4 + 0) / 6 = 2.5
#   seq_mean_token_mean (2 + 5 + 4 + 0) / 4 = 2.75
#   seq_mean_token_sum_norm (6/3 + 5/3 + 4/3 + 0/3) / 4 = 1.25
GLOBAL_X = t([1.0, 2.0, 3.0], [5.0, BIG, BIG], [4.0, BIG, BIG], [0.0, BIG, BIG])
GLOBAL_M = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
GLOBAL = {"token_mean": 2.5, "seq_mean_token_mean": 2.75, "seq_mean_token_sum_norm": 1.25}


@pytest.mark.parametrize("aggregation", list(GLOBAL))
@pytest.mark.parametrize("split", [([0, 1], [2, 3]), ([0], [1, 2, 3]), ([1, 2, 3], [0])])
def test_processes_holding_different_token_counts_give_the_global_loss(aggregation, split):
    """Each process aggregates its rows; weighted by `minibatch_shares` and averaged (as DDP
    averages gradients) the loss and its gradient are the global mini-batch's."""
    from types import SimpleNamespace

    from rlhf_cli.ppo.distributed import minibatch_shares

    x = GLOBAL_X.clone().requires_grad_()
    parts = [(x[rows], GLOBAL_M[rows]) for rows in split]
    # what the all-reduce returns on either process: both processes' units, tokens, non-finite
    total = sum(
        torch.stack([aggregation_units(ms, aggregation), ms.sum().float(), torch.tensor(0.0)])
        for _, ms in parts
    )
    acc = SimpleNamespace(num_processes=2, device="cpu", reduce=lambda tensor, op: total)
    averaged, logged = scalar(0.0), scalar(0.0)
    for xs, ms in parts:
        loss = aggregate_loss(xs, ms, aggregation, norm_len=3)
        share = minibatch_shares(acc, loss, ms, aggregation)
        assert share.all_finite
        averaged = averaged + loss * share.loss / 2  # DDP averages over the 2 processes
        # the token share weighs the logged token means (clip fractions, entropy) alike
        logged = logged + masked_mean(xs, ms) * share.tokens / 2
    assert_close(averaged, scalar(GLOBAL[aggregation]))
    whole_x = GLOBAL_X.clone().requires_grad_()
    whole = aggregate_loss(whole_x, GLOBAL_M, aggregation, norm_len=3)
    assert_close(torch.autograd.grad(averaged, x)[0], torch.autograd.grad(whole, whole_x)[0])
    assert_close(logged, scalar(2.5))


# --------------------------------------------------------------------------- value loss


def test_value_loss_takes_max_of_clipped_and_unclipped() -> None:
    # c = 0.2, V = 2.0, V_old = 1.0 -> V_clipped = 1.2
    # token 0, R = 0: (2-0)^2 = 4 vs (1.2-0)^2 = 1.44 -> unclipped 4 is the max
    # token 1, R = 3: (2-3)^2 = 1 vs (1.2-3)^2 = 3.24 -> clipped 3.24 is the max
    # token 2 masked
    values = t([2.0, 2.0, BIG])
    old_values = t([1.0, 1.0, 0.0])
    returns = t([0.0, 3.0, 0.0])
    c = 0.2

    def loss(mask: list[int]) -> torch.Tensor:
        return ppo_value_loss(values, old_values, returns, torch.tensor([mask]), c)[0]

    assert_close(loss([1, 0, 0]), scalar(2.0))  # unclipped only: 0.5 * 4 = 2.0
    assert_close(loss([0, 1, 0]), scalar(1.62))  # clipped only: 0.5 * 3.24 = 1.62
    assert_close(loss([1, 1, 0]), scalar(1.81))  # both: 0.5 * (4 + 3.24) / 2 = 1.81


def test_value_clipfrac_counts_where_the_clipped_loss_is_taken() -> None:
    # token 0: V moved by 1.0 > c but the clipped loss (1.44) is the smaller one: not counted
    #          (TRL counts only where the clipped term is the larger); |V - V_old| > c would
    #          have counted it
    # token 1: the clipped loss (3.24) is the larger one: counted; token 2 masked
    values = t([2.0, 2.0, BIG])
    _, clipfrac = ppo_value_loss(
        values, t([1.0, 1.0, 0.0]), t([0.0, 3.0, 0.0]), torch.tensor([[1, 1, 0]]), 0.2
    )
    assert_close(clipfrac, scalar(0.5))


def test_value_loss_within_clip_range_is_plain_mse() -> None:
    # V = 1.1, V_old = 1.0, c = 0.2 -> not clipped; R = 2: 0.5 * 0.9^2 = 0.405
    loss, clipfrac = ppo_value_loss(t([1.1]), t([1.0]), t([2.0]), torch.tensor([[1]]), 0.2)
    assert_close(loss, scalar(0.405))
    assert_close(clipfrac, scalar(0.0))


# --------------------------------------------------------------------------- logits and diagnostics


def test_entropy_of_uniform_logits_is_log_vocab() -> None:
    logits = torch.zeros(2, 3, 7, dtype=torch.float64)
    assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(7), dtype=torch.float64))


def test_entropy_matches_manual() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p = torch.softmax(logits, dim=-1)
    assert_close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1))


def test_entropy_in_chunks_matches_the_whole_softmax_and_its_gradient() -> None:
    """More positions than a chunk, at a temperature: the same entropy and the same gradient
    (each chunk recomputed in the backward pass) as the formula on the whole tensor."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 100, 11, generator=g, dtype=torch.float64, requires_grad=True)
    assert logits[..., 0].numel() > 2 * ENTROPY_CHUNK_ROWS
    p = torch.softmax(logits / 0.7, dim=-1)
    expected = -(p * torch.log(p)).sum(-1)
    weights = torch.randn(3, 100, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad((expected * weights).sum(), logits)
    chunked = entropy_from_logits(logits, 0.7)
    assert_close(chunked, expected)
    (got,) = torch.autograd.grad((chunked * weights).sum(), logits)
    assert_close(got, want)
    with torch.no_grad():
        assert_close(entropy_from_logits(logits, 0.7), expected.detach())


def test_logprobs_from_logits_matches_manual() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (2, 4), generator=g)
    out = logprobs_from_logits(logits, labels)
    assert out.shape == (2, 4)
    p = torch.softmax(logits, dim=-1)
    for i in range(2):
        for k in range(4):
            assert_close(out[i, k], torch.log(p[i, k, labels[i, k]]))


def test_explained_variance() -> None:
    returns = t([1.0, 2.0, 3.0, BIG], [4.0, BIG, BIG, BIG])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # perfect predictions: var(0) / var(R) = 0 -> 1
    assert_close(explained_variance(returns, returns, mask), scalar(1.0))
    # constant prediction = mean(R) = 2.5: var(R - 2.5) = var(R) -> 0
    const = torch.full_like(returns, 2.5)
    assert_close(explained_variance(const, returns, mask), scalar(0.0))
    # var(R) == 0 -> documented 0.0, not NaN
    flat = torch.full_like(returns, 3.0)
    assert_close(explained_variance(torch.zeros_like(flat), flat, mask), scalar(0.0))


def test_approx_kl_hand() -> None:
    # diffs [0.2, -0.4], third masked: 0.5 * (0.04 + 0.16) / 2 = 0.05
    out = approx_kl(t([-1.0, -2.4, 50.0]), t([-1.2, -2.0, 0.0]), torch.tensor([[1, 1, 0]]))
    assert_close(out, scalar(0.05))


# --------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_sequence() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    assert ctl.value == 0.2
    # kl = 12: 12/6 - 1 = 1 -> clipped 0.2; mult = 1 + 0.2 * 32 / 10000 = 1.00064
    ctl.update(12.0, 32)
    assert_close(ctl.value, 0.2 * 1.00064)
    assert_close(ctl.value, 0.200128)
    # kl = 3: 3/6 - 1 = -0.5 -> clipped -0.2; mult = 1 - 0.00064 = 0.99936
    ctl.update(3.0, 32)
    assert_close(ctl.value, 0.200128 * 0.99936)
    # kl = 6.6: error 0.1 (inside the clip); mult = 1 + 0.1 * 100 / 10000 = 1.001
    before = ctl.value
    ctl.update(6.6, 100)
    assert_close(ctl.value, before * 1.001)


def test_fixed_kl_controller_unchanged() -> None:
    ctl = FixedKLController(0.05)
    for kl in (0.0, 100.0, -3.0):
        ctl.update(kl, 64)
    assert ctl.value == 0.05


def test_kl_controller_state_dict_round_trip() -> None:
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    ctl.update(12.0, 32)
    fresh = AdaptiveKLController(1.0, 1.0, 1)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value and fresh.state_dict() == ctl.state_dict()
    ctl.update(3.0, 32)
    fresh.update(3.0, 32)
    assert fresh.value == ctl.value

    fixed = FixedKLController(0.1)
    other = FixedKLController(9.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.1


@pytest.mark.parametrize(
    "controller", [AdaptiveKLController(0.2, 6.0, 10000), FixedKLController(0.2)]
)
def test_raise_by_adds_the_audit_step(controller):
    controller.raise_by(0.05)
    assert controller.value == pytest.approx(0.25)
    controller.update(3.0, 32)  # the controllers keep working from the raised value
    assert controller.value <= 0.25


# --------------------------------------------------------------------------- score normalisation


def test_running_moments_match_the_whole_history() -> None:
    from rlhf_cli.ppo.core import RunningMoments

    batches = [t([1.0, 2.0, 3.0])[0], t([10.0])[0], t([-4.0, 0.5])[0]]
    moments = RunningMoments()
    for batch in batches:
        moments.update(batch)
    seen = torch.cat(batches)
    assert moments.count == 6
    assert math.isclose(moments.mean, float(seen.mean()), rel_tol=1e-12)
    assert math.isclose(moments.std, float(seen.std()), rel_tol=1e-12)  # unbiased, like TRL
    assert_close(moments.normalize(t([2.0])), (t([2.0]) - seen.mean()) / (seen.std() + 1e-8))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict()


def test_tis_weights_and_the_weighted_surrogate_by_hand():
    """min(π_old / π_sampler, cap) per token, no gradient; the surrogate's masked mean weights
    each token's clipped term by it."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5]])  # ratios e^0.5 = 1.6487, e^-1 = 0.3679, 1
    w = tis_weights(old, sampled, cap=1.5)
    assert_close(w, torch.tensor([[1.5, math.exp(-1.0), 1.0]]))
    assert not w.requires_grad
    logprobs = old.clone().requires_grad_(True)  # ratio 1: the surrogate is -A per token
    adv = torch.tensor([[1.0, -2.0, 4.0]])
    mask = torch.tensor([[True, True, False]])
    loss, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, weights=w)
    assert_close(loss, torch.tensor((-1.0 * 1.5 + 2.0 * math.exp(-1.0)) / 2))
    plain, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    assert_close(plain, torch.tensor((-1.0 + 2.0) / 2))


# --------------------------------------------------------------------------- estimators


LOGP = t([math.log(0.5), math.log(0.25), 0.0])
REF = t([math.log(0.25), math.log(0.5), 7.0])
MASK3 = torch.tensor([[True, True, False]])


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [math.log(2), -math.log(2), 0.0]),  # log π/π_ref
        ("k2", [0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2, 0.0]),  # ½ (log r)²
        ("k3", [0.5 - 1 + math.log(2), 2 - 1 - math.log(2), 0.0]),  # r - 1 - log r, r = 1/2, 2
    ],
)
def test_kl_estimators_by_hand(estimator: str, expected: list[float]) -> None:
    assert_close(kl_estimate(LOGP, REF, MASK3, estimator), t(expected))


def test_k3_is_unbiased_and_k1_k3_agree_in_expectation() -> None:
    """Sampled from π, E[k1] = E[k3] = KL(π‖π_ref) (Schulman 2020); k2 is the biased one."""
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    kl = float((p * (p.log() - q.double().log())).sum())
    logp, logq = p.log()[None], q.double().log()[None]
    ones = torch.ones(1, 3, dtype=torch.bool)
    for estimator in ("k1", "k3"):
        expectation = float((p * kl_estimate(logp, logq, ones, estimator)[0]).sum())
        assert expectation == pytest.approx(kl, rel=1e-12)
    assert float((p * kl_estimate(logp, logq, ones, "k2")[0]).sum()) != pytest.approx(kl)


def test_importance_weighted_kl_by_hand() -> None:
    """ρ·k with ρ = π/π_old: the value is k·ρ, and at ρ = 1 k3's token gradient gains k3 itself
    (d/dlogπ of ρ·k3 = k3 + 1 − r, against 1 − r plain, r = π_ref/π)."""
    old = LOGP.clone()
    logp = LOGP.clone().requires_grad_(True)
    weighted = kl_estimate(logp, REF, MASK3, "k3", old)
    k3 = [0.5 - 1 + math.log(2), 2 - 1 - math.log(2)]
    assert_close(weighted.detach(), t([k3[0], k3[1], 0.0]))  # ρ = 1 in value
    weighted.sum().backward()
    assert_close(logp.grad, t([k3[0] + 1 - 0.5, k3[1] + 1 - 2.0, 0.0]))
    off = kl_estimate(LOGP, REF, MASK3, "k1", LOGP - t([math.log(2), 0.0, 0.0]))
    assert_close(off, t([2 * math.log(2), -math.log(2), 0.0]))  # ρ = 2, 1


def _expected_kl_gradient(estimator: str, weighted: bool) -> tuple[torch.Tensor, ...]:
    """The exact expectation over x ~ π = softmax(θ) of ∇θ k(x) (of ∇θ ρ(x)·k(x) when
    weighted), with the sampling distribution held fixed, as the loss sees it; and the exact
    ∇θ KL(π‖q), ∇θ KL(q‖π)."""
    theta = torch.tensor([0.3, -0.2, 0.9, 0.0], dtype=torch.float64, requires_grad=True)
    logq = torch.log_softmax(torch.tensor([0.1, 0.4, -0.5, 0.2], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    p, ones = logp.exp().detach(), torch.ones(1, 4, dtype=torch.bool)
    old = logp.detach()[None] if weighted else None
    k = kl_estimate(logp[None], logq[None], ones, estimator, old)[0]
    (surrogate,) = torch.autograd.grad((p * k).sum(), theta, retain_graph=True)
    (forward,) = torch.autograd.grad((logp.exp() * (logp - logq)).sum(), theta, retain_graph=True)
    (reverse,) = torch.autograd.grad((logq.exp() * (logq - logp)).sum(), theta)
    return surrogate, forward, reverse


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_importance_weighted_kl_has_the_gradient_of_kl_to_the_reference(estimator: str) -> None:
    surrogate, forward, _ = _expected_kl_gradient(estimator, weighted=True)
    assert_close(surrogate, forward)
    assert forward.abs().max() > 0.05


def test_plain_k3_in_the_loss_follows_the_reverse_kl_and_plain_k1_nothing() -> None:
    """Why the weighting is the default: unweighted, k3's gradient is that of KL(π_ref‖π), not
    of the KL(π‖π_ref) that is measured, and k1's is 0 in expectation (k2's is right)."""
    k3, forward, reverse = _expected_kl_gradient("k3", weighted=False)
    assert_close(k3, reverse)
    assert (k3 - forward).abs().max() > 0.01
    zero = torch.zeros(4, dtype=torch.float64)
    assert_close(_expected_kl_gradient("k1", weighted=False)[0], zero)
    assert_close(_expected_kl_gradient("k2", weighted=False)[0], forward)


def test_kl_penalty_with_k3_and_objective_kl_stays_k1() -> None:
    scores = t(1.0)[0]
    rewards, kl = kl_penalized_rewards(scores, LOGP, REF, MASK3, 0.5, "k3")
    k3 = [0.5 - 1 + math.log(2), 2 - 1 - math.log(2)]
    assert_close(rewards, t([-0.5 * k3[0], -0.5 * k3[1] + 1.0, 0.0]))
    assert_close(kl, t([math.log(2), -math.log(2), 0.0]))


def test_rloo_leave_one_out_by_hand() -> None:
    assert_close(leave_one_out_advantages(t(1.0, 2.0, 3.0, 6.0), 2), t(-1.0, 1.0, -3.0, 3.0))
    # groups of 3: [1, 2, 6] -> 1 - 8/2, 2 - 7/2, 6 - 3/2
    got = leave_one_out_advantages(t(1.0, 2.0, 6.0), 3)
    assert_close(got, t(-3.0, -1.5, 4.5))


def test_grpo_group_normalisation_by_hand() -> None:
    got = group_normalized_advantages(t(1.0, 2.0, 6.0, 4.0, 4.0, 4.0), 3)
    std = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2)  # unbiased, = sqrt(7)
    expected = [-2 / (std + 1e-4), -1 / (std + 1e-4), 3 / (std + 1e-4), 0.0, 0.0, 0.0]
    assert_close(
        got, torch.tensor(expected, dtype=torch.float64)
    )  # a group of equal rewards teaches nothing


@pytest.mark.parametrize(
    "gamma, returns",
    [(1.0, [[0.9, 0.8, 1.0], [0.5, 0.0, 0.0]]), (0.5, [[0.25, 0.3, 1.0], [0.5, 0.0, 0.0]])],
)
def test_reinforce_pp_whitened_returns_by_hand(gamma: float, returns: list[list[float]]) -> None:
    rewards = t([0.1, -0.2, 1.0], [0.5, 9.0, 9.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    valid = [returns[0][0], returns[0][1], returns[0][2], returns[1][0]]
    mean = sum(valid) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 3)
    expected = [[(v - mean) / std for v in returns[0]], [(returns[1][0] - mean) / std, 0, 0]]
    assert_close(reinforce_pp_advantages(rewards, mask, gamma), t(*expected), atol=1e-6, rtol=0)
