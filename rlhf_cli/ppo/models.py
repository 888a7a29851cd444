"""The actor and critic as one module, and the frozen reference.

`value_model: shared` puts a scalar head on the policy's last hidden state, so one forward pass
gives log-probs and values. `separate` is its own backbone + head, initialised from the policy or
from the reward model (when it shares the policy's tokenizer: an RM-initialised critic starts with
a far lower value loss). Value heads start at zero, so the first values are 0 rather than noise.
The critic-free estimators (rloo, grpo, reinforce_pp) build neither: the actor is the policy alone.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from rlhf_cli.errors import StageError
from rlhf_cli.generation import position_ids_from


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
        shared = self.value_head is not None
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=shared,
            use_cache=False,
            logits_to_keep=response_width + 1,
        )
        states = slice(-(response_width + 1), -1)
        if shared:
            hidden = out.hidden_states[-1][:, states]
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
