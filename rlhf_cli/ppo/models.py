"""The actor and critic as one module, and the frozen reference.

`value_model: shared` puts a scalar head on the policy's last hidden state, so one forward pass
gives log-probs and values. `separate` is its own backbone + head, initialised from the policy or
from the reward model (when it shares the policy's tokenizer: an RM-initialised critic starts with
a far lower value loss). Value heads start at zero, so the first values are 0 rather than noise.
The critic-free estimators (rloo, grpo, reinforce_pp) build neither: the actor is the policy alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from rlhf_cli.errors import ModelLoadError, StageError
from rlhf_cli.generation import position_ids_from
from rlhf_cli.modeling import (
    Reference,
    load_backbone,
    load_sft_model,
    make_trainable,
    model_path,
    resolve_model_path,
    set_dropout,
)
from rlhf_cli.recipe import Recipe
from rlhf_cli.scoring import RewardScorer


def zero_value_head(hidden_size: int) -> nn.Linear:
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """A separate critic: a transformer backbone and a per-token scalar head."""

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)


class PolicyAndValue(nn.Module):
    """Actor + critic. `forward` returns, for the last `response_width` tokens of each row, the
    logits that predict them (b, r, vocab) and the values of the states they are taken in (b, r):
    position p-1+i predicts response token i. Only those logits are materialised. Without a
    value head or critic (critic-free estimators) the values are zeros and nothing else runs."""

    def __init__(
        self,
        policy: nn.Module,
        value_head: nn.Linear | None = None,
        critic: ValueModel | None = None,
    ):
        super().__init__()
        if value_head is not None and critic is not None:
            raise ValueError("give at most one of value_head (shared) or critic (separate)")
        self.policy, self.value_head, self.critic = policy, value_head, critic

    @property
    def has_values(self) -> bool:
        return self.value_head is not None or self.critic is not None

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, response_width: int
    ) -> tuple[Tensor, Tensor]:
        position_ids = position_ids_from(attention_mask)
        # the shared head reads the LM head's input (the last hidden state of the kept
        # positions), taken on its way in: `output_hidden_states` would keep every layer's
        seen: list[Tensor] = []
        head = self.policy.get_output_embeddings() if self.value_head is not None else None
        hook = head.register_forward_pre_hook(lambda m, a: seen.append(a[0])) if head else None
        try:
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=response_width + 1,
            )
        finally:
            if hook is not None:
                hook.remove()
        states = slice(-(response_width + 1), -1)
        if seen:
            hidden = seen[-1][:, :-1]
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        elif self.critic is not None:
            values = self.critic(input_ids, attention_mask, position_ids)[:, states]
        else:
            values = out.logits.new_zeros(out.logits.shape[:2])[:, :-1]
        return out.logits[:, :-1], values.float()

    def value_state_dict(self) -> dict[str, Tensor]:
        """What the value side trains: the shared head, or the critic's trained weights (its
        LoRA and head, or all of it): a frozen (4-bit) critic base is never written. Empty
        without a value model."""
        # parameters as the module holds them now (whole inside a gather; state_dict() would
        # give FSDP2's shards), copied (not views of a gather buffer)
        if not self.has_values:
            return {}
        if self.critic is None:
            items = self.value_head.named_parameters()
        else:
            items = ((n, p) for n, p in self.critic.named_parameters() if p.requires_grad)
        return {k: v.detach().cpu().clone() for k, v in items}

    def load_value_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore `value_state_dict`'s weights; a state missing some raises StageError."""
        expected = set(self.value_state_dict())
        if not expected:
            return
        module = self.value_head if self.critic is None else self.critic
        missing = sorted(expected - state.keys())
        if missing:
            raise StageError(
                f"the checkpoint's value weights lack {len(missing)} of this recipe's "
                f"({missing[0]}, ...): it was written with other model settings; run `rlhf ppo` "
                "without --resume"
            )
        module.load_state_dict({n: state[n] for n in expected}, strict=False)


def hidden_size_of(model: Any) -> int:
    config = model.config
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


class PpoSources(NamedTuple):
    """Where PPO's models come from (the run's manifests or the recipe)."""

    base: str  # policy base weights
    sft_adapter: Path | None  # SFT adapter, if any: merged into the base, kept on a 4-bit one
    tokenizer: str
    reward: str | None  # the frozen reward model (None: `reward.functions` alone)
    reward_tokenizer: str | None


def build_actor(
    recipe: Recipe,
    sources: PpoSources,
    device: torch.device,
    scorer: RewardScorer,
    tokenizer: Any,
) -> tuple[PolicyAndValue, Reference]:
    """Policy (+ fresh LoRA), value head or critic (`gae` only), and the reference, dropout off.
    What trains
    keeps fp32 master weights (`make_trainable`); frozen weights keep the recipe's dtype. A
    critic from the reward model (`value_init: reward_model`) needs the policy's `tokenizer`."""
    cfg = recipe.ppo
    policy, reference = build_policy(recipe, sources, device)
    if not cfg.needs_critic:  # no value model at all
        actor = PolicyAndValue(policy)
    elif cfg.value_model == "shared":
        actor = PolicyAndValue(policy, value_head=zero_value_head(hidden_size_of(policy)))
    else:
        from_reward = cfg.value_init == "reward_model"
        if from_reward and (
            scorer.tokenizer is None or scorer.tokenizer.get_vocab() != tokenizer.get_vocab()
        ):
            raise ModelLoadError(
                "ppo.value_init: reward_model needs a reward model that shares "
                "the policy's tokenizer (reward.functions alone have none); use "
                "value_init: policy"
            )
        source = (
            resolve_model_path(sources.reward)
            if from_reward
            else model_path(sources.base, recipe.model)
        )
        # The critic follows the policy's settings: 4-bit base + LoRA, LoRA, or fp32 weights.
        backbone = load_backbone(source, recipe.model, device)
        head = zero_value_head(hidden_size_of(backbone))  # fp32, trained in full
        if from_reward:
            head.load_state_dict(_reward_head(scorer.model, sources.reward))
        set_dropout(backbone, 0.0)
        actor = PolicyAndValue(policy, critic=ValueModel(backbone, head))
    return actor.to(device), reference


def build_policy(
    recipe: Recipe, sources: PpoSources, device: torch.device
) -> tuple[Any, Reference]:
    """The SFT model made trainable (a fresh LoRA adapter, on 4-bit weights when asked, stacked
    over the frozen SFT adapter there; or all weights in fp32) with dropout off, and its frozen
    reference: the policy with its PPO adapter off, or a frozen copy in the recipe's dtype."""
    model_cfg, base, adapter = recipe.model, sources.base, sources.sft_adapter
    full = not model_cfg.lora.enabled  # every weight trains: loaded in fp32
    sft = load_sft_model(
        model_cfg.variant(dtype="float32") if full else model_cfg, base, adapter, device
    )
    policy = make_trainable(sft, model_cfg, "CAUSAL_LM", no_dropout=True)
    frozen = load_sft_model(model_cfg, base, adapter, device) if full else None
    reference = Reference(policy, frozen_copy=frozen)
    set_dropout(policy, 0.0)
    return policy, reference


def _reward_head(reward_model: Any, reward_path: str) -> dict[str, torch.Tensor]:
    """The reward model's scalar head, to start a per-token critic from it."""
    head = getattr(reward_model, "score", None) or getattr(reward_model, "classifier", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ModelLoadError(
            f"reward model '{reward_path}' has no linear 1-logit head to "
            "initialise the critic from; use ppo.value_init: policy"
        )
    return {
        "weight": head.weight.detach().float(),
        "bias": head.bias.detach().float() if head.bias is not None else torch.zeros(1),
    }
