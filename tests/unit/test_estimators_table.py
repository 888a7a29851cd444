"""The advantage estimators' table: an unknown name never reaches the loop, and each row
computes what its paper says on a hand-sized batch."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.ppo.estimators import ESTIMATORS, Batch, estimator
from rlhf_cli.ppo.loop import advantages_of
from rlhf_cli.recipe import PpoSection


def test_an_unknown_estimator_is_an_error_not_a_default():
    with pytest.raises(ValueError, match="unknown ppo.advantage_estimator 'ppo2'; one of gae"):
        estimator("ppo2")
    cfg = PpoSection().model_copy(update={"advantage_estimator": "ppo2"})  # past validation
    rollout = type("R", (), {})()
    rollout.response_mask = torch.ones(2, 2, dtype=torch.bool)
    rollout.scores = torch.tensor([1.0, 0.0])
    rollout.logprobs = rollout.ref_logprobs = rollout.values = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="unknown ppo.advantage_estimator"):
        advantages_of(rollout, 0.0, cfg)


def test_grouped_rows_put_each_completions_group_advantage_on_its_tokens():
    # two prompts x two completions; summed rewards 1, 3 | 2, 2
    rewards = torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    batch = Batch(rewards, torch.zeros_like(rewards), mask)
    cfg = PpoSection(advantage_estimator="rloo", num_generations=2, batch_size=4, mini_batch_size=2)

    def local(fn, x):
        return fn(x)

    rloo, returns = ESTIMATORS["rloo"].fn(batch, cfg, None, local)
    # leave-one-out: 1 - 3, 3 - 1, 2 - 2, 2 - 2 on every response token, 0 on padding
    expected = torch.tensor([[-2.0, -2.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(rloo, expected)
    assert not returns.any()
    grpo, _ = ESTIMATORS["grpo"].fn(batch, cfg, None, local)
    # standardised in each group (unbiased std of (1, 3) is sqrt(2)); the tied group gets 0
    s = 2**0.5
    torch.testing.assert_close(
        grpo, torch.tensor([[-1 / s] * 2, [1 / s] * 2, [0.0] * 2, [0.0] * 2]), atol=1e-3, rtol=0
    )
