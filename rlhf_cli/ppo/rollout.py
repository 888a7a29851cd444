"""Rollout: PPO's experience for one iteration. Answers come from the generation module; here
they are scored by the reward model (penalised when unended, optionally normalised, clipped) and
evaluated once by the policy, value head and reference, all under inference mode.

The details that decide whether PPO works (Huang et al. 2023, "The N implementation details"):
- the score goes on the last real response token, never on a pad after it (core.py);
- the policy, value and reference passes see generation's left-padded positions and score
  tokens under the distribution the sampler drew them from: temperature, top-k and top-p as
  the recipe sets them (generation.py), or with `ppo.logprob_support: full` under the
  temperature-only one; `logprob_mismatch` measures how well the training forward reproduces
  the sampler, in the sampler's distribution whichever the loss uses.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf_cli.generation import Generations, Generator, response_logits, response_logprobs
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo.core import RunningMoments
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.recipe import PpoSection
from rlhf_cli.scoring import RewardScorer


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


def shaped_scores(
    raw_scores: Tensor,
    ended: Tensor,
    cfg: PpoSection,
    moments: RunningMoments | None = None,
    gather: Callable[[Tensor], Tensor] = lambda x: x,
) -> Tensor:
    """Scores (b,) used for training, in this order: `missing_eos_penalty` subtracted from
    responses that never stopped (ended (b,) False), then the running normalisation
    (`score_norm`: `moments` updated with every process's scores, through `gather`), then the
    clip to ±`reward_clip`, so a clipped score stays within the clip."""
    scores = raw_scores.clone()
    if cfg.missing_eos_penalty is not None:
        scores = scores - cfg.missing_eos_penalty * (~ended.cpu()).float()
    if moments is not None:
        moments.update(gather(scores))
        scores = moments.normalize(scores).float()
    if cfg.reward_clip is not None:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    return scores


@torch.inference_mode()
def collect_rollout(
    actor: PolicyAndValue,
    reference: Reference | None,
    scorer: RewardScorer,
    generator: Generator,
    prompts: list[str],
    queries: list[list[int]],
    cfg: PpoSection,
    moments: RunningMoments | None = None,
    gather: Callable[[Tensor], Tensor] = lambda x: x,
    seeds: list[int] | None = None,
) -> Rollout:
    """Generate (each row from its seed in `seeds`, when given), score and evaluate one batch
    of prompts (b = len(prompts)). Without `reference` (β = 0: the KL would shape nothing) no
    reference forward runs and `ref_logprobs` is None."""
    device = next(actor.parameters()).device
    timings: dict[str, float] = {}
    actor.eval()

    # 1. Batched generation (the generation module's backend).
    start = time.perf_counter()
    answers = generator.generate(queries, cfg.generation, seeds)
    timings["time/rollout_s"] = time.perf_counter() - start

    # 2. Score decoded text with the reward model's own tokenizer, in batches.
    start = time.perf_counter()
    raw_scores, n_truncated = scorer.score(prompts, answers.texts)
    scores = shaped_scores(raw_scores, answers.ended, cfg, moments, gather)
    timings["time/score_s"] = time.perf_counter() - start

    # 3. Old log-probs and values (one pass), reference log-probs (adapter off), each under
    #    `logprob_support`; the old ones also under the sampler's distribution, which is what the
    #    sampler's own log-probs are checked against.
    start = time.perf_counter()
    input_ids, attention_mask = answers.input_ids, answers.attention_mask
    support = cfg.logprob_support
    parts: dict[str, list[Tensor]] = defaultdict(list)
    width, step = answers.response_ids.shape[1], cfg.mini_batch_size
    for s in range(0, len(prompts), step):
        ids, mask = input_ids[s : s + step], attention_mask[s : s + step]
        resp = answers.response_ids[s : s + step]
        logits, values = actor(ids, mask, width)
        parts["logprobs"].append(response_logprobs(logits, resp, cfg.generation, support))
        parts["warped_logprobs"].append(
            parts["logprobs"][-1]
            if support == "sampled"
            else response_logprobs(logits, resp, cfg.generation)
        )
        parts["values"].append(values)
        if reference is not None:
            with reference.model() as ref:
                ref_logits = response_logits(ref, ids, mask, width)
            parts["ref_logprobs"].append(
                response_logprobs(ref_logits, resp, cfg.generation, support)
            )
            del ref_logits
        del logits
    timings["time/logprobs_s"] = time.perf_counter() - start
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    return Rollout(
        **vars(answers),
        scores=scores.to(device),
        raw_scores=raw_scores.to(device),
        ref_logprobs=tensors.pop("ref_logprobs", None),
        **tensors,
        prompts=prompts,
        n_truncated=n_truncated,
        timings=timings,
    )


def logprob_mismatch(rollout: Rollout) -> float:
    """Largest |log-prob as the sampler drew the token - log-prob of the training forward under
    the same distribution| over the batch's response tokens (0 when the backend records
    none)."""
    if rollout.sampler_logprobs is None or not rollout.response_mask.any():
        return 0.0
    old = rollout.warped_logprobs
    diff = (rollout.sampler_logprobs.to(old.device) - old).abs()
    return float(diff[rollout.response_mask].max())
