"""The old log-probs left to the update (rollout.old_logprobs_at_update): with one epoch of one
mini-batch, no critic and no KL in the rewards, one PPO iteration (loop.run_iteration, on a tiny
Llama, one process) runs no policy forward at rollout and gives the loss, gradients and metrics
of the iteration that does; any other setting still runs it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from torch.testing import assert_close
from transformers import LlamaForCausalLM, get_constant_schedule

from rlhf_cli.generation import HFGenerator
from rlhf_cli.modeling import Reference, load_tokenizer
from rlhf_cli.ppo import rollout as rollout_module
from rlhf_cli.ppo.checkpoint import TrainState
from rlhf_cli.ppo.core import FixedKLController
from rlhf_cli.ppo.experience import Drafts
from rlhf_cli.ppo.loop import run_iteration
from rlhf_cli.ppo.models import PolicyAndValue, zero_value_head
from rlhf_cli.ppo.run import Models
from rlhf_cli.ppo.sharding import Engine
from rlhf_cli.recipe import GenerationSection, PpoSection
from rlhf_cli.scoring import Scores

PROMPTS = ["hello there friend", "how are you today"]
QUALIFIES = {  # one epoch of one mini-batch, critic-free, the KL in the loss
    "batch_size": 4,
    "mini_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "ppo_epochs": 1,
    "advantage_estimator": "grpo",
    "num_generations": 2,
    "kl_in": "loss",
    "kl_estimator": "k3",
    "learning_rate": 1e-3,
}


class LengthScorer:
    """Longer answers score higher: the completions of a prompt differ, so grpo's advantages
    are not all 0."""

    def scored(self, prompts: list[str], responses: list[str], keywords: Any = None) -> Scores:
        return Scores(torch.tensor([len(r) / 10 for r in responses]), 0, {})


def tiny_run(llama_config: Callable[..., Any], cfg: PpoSection, kl_coef: float = 0.1) -> Any:
    """What `run_iteration` reads of a `PPORun`, built alike on every call: a seeded tiny Llama
    (a value head with a critic), a perturbed frozen copy as the reference, AdamW."""
    tokenizer = load_tokenizer("builtin:tiny-lm")
    torch.manual_seed(0)
    config = llama_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    policy = LlamaForCausalLM(config)
    reference = copy.deepcopy(policy).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    actor = PolicyAndValue(policy, zero_value_head(32) if cfg.needs_critic else None)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate)
    generator = HFGenerator(policy, tokenizer, [tokenizer.eos_token_id])
    acc = Accelerator(cpu=True)
    models = Models(
        Engine(acc), actor, Reference(policy, reference), LengthScorer(), generator, tokenizer
    )
    state = TrainState(
        optimizer,
        get_constant_schedule(optimizer),
        FixedKLController(kl_coef),
        sampler=torch.Generator().manual_seed(0),
        score_moments=None,
    )
    return SimpleNamespace(
        recipe=SimpleNamespace(ppo=cfg, run=SimpleNamespace(seed=0)),
        accelerator=acc,
        models=models,
        state=state,
        prompts=PROMPTS,
        queries=[tokenizer(p)["input_ids"] for p in PROMPTS],
        columns=[{} for _ in PROMPTS],
        drafts=Drafts(),
    )


def ppo_section(**changes: Any) -> PpoSection:
    generation = GenerationSection(max_new_tokens=6, top_p=0.9, tis_cap=2.0)
    return PpoSection(**{**QUALIFIES, "generation": generation, **changes})


def one_iteration(run: Any) -> tuple[dict[str, float], Any, list[torch.Tensor], list[str]]:
    """Iteration 1's metrics and rollout, the gradients its optimiser step took, and each
    forward of the actor: "rollout" (under inference mode) or "update"."""
    grads: list[torch.Tensor] = []
    forwards: list[str] = []
    actor = run.models.actor
    params = [p for p in actor.parameters() if p.requires_grad]
    run.state.optimizer.register_step_pre_hook(
        lambda *_: grads.extend(p.grad.clone() for p in params)
    )
    actor.register_forward_hook(
        lambda *_: forwards.append("rollout" if torch.is_inference_mode_enabled() else "update")
    )
    metrics, rollout, _ = run_iteration(run, 1)
    return metrics, rollout, grads, forwards


@pytest.mark.parametrize("support", ["sampled", "full"])
def test_leaving_the_old_logprobs_to_the_update_changes_no_number(
    llama_config, monkeypatch, support
):
    cfg = ppo_section(logprob_support=support)
    skipped, rollout, grads, forwards = one_iteration(tiny_run(llama_config, cfg))
    assert forwards == ["update"]
    with monkeypatch.context() as patch:  # the same iteration with the rollout's forward
        patch.setattr(rollout_module, "old_logprobs_at_update", lambda cfg, kl_coef: False)
        full, full_rollout, full_grads, full_forwards = one_iteration(tiny_run(llama_config, cfg))
    assert full_forwards == ["rollout", "update"]

    assert skipped["ppo/policy/approxkl"] == 0.0  # π_old is this forward's, exactly
    assert skipped["objective/kl"] > 0 and skipped["ppo/loss/kl"] > 0
    assert skipped["rollout/logprob_mismatch"] < 1e-4
    numbers = [k for k in full if not k.startswith(("time/", "tokens/"))]
    assert set(skipped) == set(full)
    assert_close({k: skipped[k] for k in numbers}, {k: full[k] for k in numbers}, atol=1e-6, rtol=0)
    assert len(grads) == len(full_grads) > 0
    assert any(g.abs().max() > 1e-4 for g in grads)
    for grad, full_grad in zip(grads, full_grads, strict=True):
        assert_close(grad, full_grad, atol=1e-6, rtol=1e-5)
    for name in ("logprobs", "warped_logprobs", "values", "ref_logprobs"):
        assert_close(getattr(rollout, name), getattr(full_rollout, name), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("changes", "kl_coef", "rollout_forwards"),
    [
        ({}, 0.1, 0),
        ({"kl_in": "reward"}, 0.0, 0),  # β = 0: no KL to shape the rewards with
        ({"ppo_epochs": 2}, 0.1, 1),  # the second epoch's π has moved
        ({"mini_batch_size": 2}, 0.1, 2),  # two steps: the second mini-batch's π has moved
        ({"advantage_estimator": "gae", "num_generations": 1}, 0.1, 1),  # values before
        ({"kl_in": "reward"}, 0.1, 1),  # the KL-shaped rewards read the old log-probs
    ],
)
def test_the_rollouts_policy_forward_runs_unless_the_update_can_give_them(
    llama_config, changes, kl_coef, rollout_forwards
):
    run = tiny_run(llama_config, ppo_section(**changes), kl_coef)
    metrics, rollout, _, forwards = one_iteration(run)
    assert forwards.count("rollout") == rollout_forwards
    assert rollout.logprobs is not None and rollout.logprobs.shape == rollout.response_mask.shape
    assert ("objective/kl" in metrics) == (kl_coef > 0)
