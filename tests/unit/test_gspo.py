"""GSPO's sequence-level importance ratio (`ppo.importance_ratio: sequence`) against values
computed by hand on a fixed batch, and TRL's form of it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_cli.ppo.core import log_ratio, ppo_policy_loss

# two answers, three token slots; the second answer's last slot is padding
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
DIFF = torch.tensor([[0.3, -0.1, 0.1], [0.05, 0.15, 5.0]])  # log π − log π_old
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([[1.0] * 3, [-2.0] * 3])


def test_the_sequence_ratio_is_exp_of_the_mean_token_log_ratio():
    # answer 1: (0.3 - 0.1 + 0.1) / 3 = 0.1; answer 2: (0.05 + 0.15) / 2 = 0.1 (pad left out)
    ratio = torch.exp(log_ratio(OLD + DIFF, OLD, MASK, "sequence"))
    assert ratio.shape == (2, 1)
    assert_close(ratio, torch.tensor([[math.exp(0.1)], [math.exp(0.1)]]))


def test_the_sequence_loss_by_hand():
    # s = e^0.1 = 1.10517 for both; eps 0.05: clip to [0.95, 1.05]
    # answer 1 (A = +1): max(-s, -1.05) = -1.05, clipped; answer 2 (A = -2): max(2s, 2.1) = 2.2103
    loss, clipfrac = ppo_policy_loss(
        OLD + DIFF, OLD, ADV, MASK, 0.05, aggregation="seq_mean_token_mean", level="sequence"
    )
    s = math.exp(0.1)
    assert loss.item() == pytest.approx((-1.05 + 2 * s) / 2, rel=1e-6)
    assert clipfrac.item() == pytest.approx(3 / 5)  # answer 1's three tokens of five


def test_the_gradient_is_gspo_s_and_trl_s():
    # d/dθ of -A·s with s = exp(mean Δ): -A·s/|y| on each token's log-prob (unclipped: eps 1)
    logprobs = (OLD + DIFF).clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(
        logprobs, OLD, ADV, MASK, 1.0, aggregation="seq_mean_token_mean", level="sequence"
    )
    loss.backward()
    s = math.exp(0.1)
    expected = torch.tensor([[-s / 3 / 2] * 3, [2 * s / 2 / 2] * 2 + [0.0]])
    assert_close(logprobs.grad, expected)


def test_equal_to_token_level_when_every_token_moves_alike():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.0]])
    new = old + 0.08
    mask = torch.ones(2, 3, dtype=torch.bool)
    for agg in ("token_mean", "seq_mean_token_mean"):
        token = ppo_policy_loss(new, old, ADV, mask, 0.05, aggregation=agg, level="token")
        seq = ppo_policy_loss(new, old, ADV, mask, 0.05, aggregation=agg, level="sequence")
        assert_close(token[0], seq[0])
        assert_close(token[1], seq[1])


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="token or sequence"):
        log_ratio(OLD, OLD, MASK, "word")
