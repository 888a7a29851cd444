"""`Rollout`, one iteration's experience as the loop, the update and the logs read it (built by
ppo/rollout.py, which also needs the run: kept apart so the logs need not import the run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from rlhf_cli.generation import Generations


@dataclass
class Rollout(Generations):
    """One iteration's experience: the answers (b = rollouts on this process) with their
    scores and the rollout-time log-probs and values, each (b, r) unless noted."""

    scores: Tensor  # (b,) reward-model scores (after penalties / clipping)
    raw_scores: Tensor  # (b,) as the reward model gave them
    logprobs: Tensor  # policy at rollout time (the "old" log-probs), in `ppo.logprob_support`
    warped_logprobs: Tensor  # the same under the sampler's own distribution (top-k, top-p)
    ref_logprobs: Tensor | None  # None: no reference forward ran (β = 0)
    values: Tensor
    prompts: list[str]
    n_truncated: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def select(self, index: Tensor) -> dict[str, Tensor]:
        """The tensors a mini-batch update needs, for rollouts `index`."""
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "response_ids": self.response_ids[index],
            "response_mask": self.response_mask[index],
        }
