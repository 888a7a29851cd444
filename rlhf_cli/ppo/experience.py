"""`Rollout`, one iteration's experience as the loop, the update and the logs read it (built by
ppo/rollout.py, which also needs the run: kept apart so the logs need not import the run)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from torch import Tensor

from rlhf_cli.generation import Generations


@dataclass
class Rollout(Generations):
    """One iteration's experience: the answers (b = rollouts on this process) with their
    scores and the rollout-time log-probs and values, each (b, r) unless noted."""

    scores: Tensor  # (b,) reward-model scores (after penalties / clipping)
    raw_scores: Tensor  # (b,) as the reward model gave them
    # the policy at rollout time (the "old" log-probs), in `ppo.logprob_support`; None until the
    # update's forward gives them when the rollout leaves them to it (old_logprobs_at_update)
    logprobs: Tensor | None
    warped_logprobs: Tensor | None  # the same under the sampler's distribution (top-k, top-p)
    ref_logprobs: Tensor | None  # None: no reference forward ran (β = 0)
    values: Tensor
    prompts: list[str]
    n_truncated: int = 0
    reward_metrics: dict[str, float] = field(default_factory=dict)  # `reward/no_answer_rate`, ...
    timings: dict[str, float] = field(default_factory=dict)
    staleness: int = 0  # PPO updates made since the answering weights (`async_steps`)

    def select(self, index: Tensor) -> dict[str, Tensor]:
        """The tensors a mini-batch update needs, for rollouts `index`."""
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "response_ids": self.response_ids[index],
            "response_mask": self.response_mask[index],
        }


@dataclass
class Draft:
    """A rollout's answers, asked for before its iteration (`generation.async_steps`)."""

    index: list[int]  # this process's prompt indices
    version: int  # the PPO updates the answering weights had seen
    answers: Future[tuple[Generations, float]]  # and the seconds answering took
    release: Callable[[], None]  # lets the engine move on when the draft is never answered


@dataclass
class Drafts:
    """The rollouts in flight, by iteration, answered one after another in a thread of their
    own while the update runs; at most `generation.async_steps` of them."""

    pending: dict[int, Draft] = field(default_factory=dict)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rollout")
    )

    def drop(self) -> None:
        """Forget every draft (a stop, a failure): their answers are never trained on."""
        for draft in self.pending.values():
            draft.answers.cancel()
            draft.release()  # not started: unpinned; being answered: abandoned at once
        self.pending.clear()
