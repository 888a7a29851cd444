"""Rollout: PPO's experience for one iteration. `collect_rollout` takes this process's rows of the
iteration's batch and runs `rollout_batch` on the actor's whole weights: answers come from the
generation module (asked for ahead with `generation.async_steps`); here they are scored by the
reward model (penalised when unended, optionally normalised, clipped) and evaluated once by the
policy, value head and reference, all under inference mode.

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
from concurrent.futures import Future

import torch
from torch import Tensor

from rlhf_cli.generation import (
    Generations,
    response_logits,
    response_logprobs,
    row_seed,
)
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo.core import RunningMoments
from rlhf_cli.ppo.distributed import prompt_rows
from rlhf_cli.ppo.experience import Draft, Rollout
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.run import PPORun
from rlhf_cli.recipe import PpoSection
from rlhf_cli.scoring import RewardScorer


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


def collect_rollout(run: PPORun, iteration: int) -> Rollout:
    """Iteration `iteration`'s rollout on this process (torchtune's `generate_trajectory_batched`):
    its rows of the global batch, drawn by the run's prompt sampler (alike on every process),
    each answered from its own seed (`generation.row_seed`); generated, scored and evaluated
    (`rollout_batch`) on the actor's whole weights, gathered once, in the precision of the
    update's forward. At β = 0 no reference forward runs: the KL would shape nothing.

    With `generation.async_steps` N >= 1 the answers were asked for up to N iterations ago
    (`Draft`); once they are in, the latest weights go to the servers and the rollouts of the
    next N iterations are asked for, answered while this one is scored and trained on. The
    first iteration (and the first after a resume) is generated from the latest weights."""
    cfg, acc, models, drafts = run.recipe.ppo, run.accelerator, run.models, run.drafts
    ahead = cfg.generation.async_steps
    with acc.autocast(), models.engine.gathered(models.actor) as actor:
        start = time.perf_counter()
        draft = drafts.pending.pop(iteration, None)
        synced = draft is None
        if draft is None:
            models.generator.sync(actor.policy)  # a separate engine gets the latest weights
            draft = ask_rollout(run, iteration)
        answers, generating = draft.answers.result()
        waited = time.perf_counter() - start
        if ahead:
            if not synced:
                models.generator.sync(actor.policy)
            for later in range(iteration + 1, min(iteration + ahead, cfg.iterations) + 1):
                if later not in drafts.pending:
                    drafts.pending[later] = ask_rollout(run, later, version=iteration - 1)
        rollout = rollout_batch(
            actor,
            models.reference if run.state.kl_ctl.value > 0 else None,
            models.scorer,
            answers,
            [run.prompts[i] for i in draft.index],
            cfg,
            run.state.score_moments,
            lambda x: acc.gather(x.to(acc.device)).cpu(),
        )
    rollout.timings["time/rollout_s"] = waited  # what the loop waited for its answers
    rollout.timings["time/generate_s"] = generating  # what answering them took
    rollout.staleness = iteration - 1 - draft.version
    return rollout


def ask_rollout(run: PPORun, iteration: int, version: int | None = None) -> Draft:
    """Ask the rollout engine for iteration `iteration`'s answers: this process's prompts drawn
    now, each row from its seed; answered in the drafts' thread by the weights the engine holds
    now (`version`: the PPO updates they have seen, iteration - 1 when they are the latest)."""
    cfg, acc, generator = run.recipe.ppo, run.accelerator, run.models.generator
    index = prompt_rows(
        acc, len(run.prompts), cfg.batch_size, cfg.num_generations, run.state.sampler
    )
    rows = range(acc.process_index, cfg.batch_size, acc.num_processes)  # global batch rows
    seeds = [row_seed(run.recipe.run.seed, iteration, row) for row in rows]
    queries = [run.queries[i] for i in index]
    version = iteration - 1 if version is None else version

    def timed(generate: Callable[..., Generations]) -> tuple[Generations, float]:
        start = time.perf_counter()
        return generate(queries, cfg.generation, seeds), time.perf_counter() - start

    if not cfg.generation.async_steps:  # answered here and now, in this thread's precision
        answers: Future[tuple[Generations, float]] = Future()
        answers.set_result(timed(generator.generate))
        return Draft(index, version, answers, lambda: None)
    pinned = generator.pinned()  # only the servers' client overlaps (the recipe checks)
    return Draft(index, version, run.drafts.pool.submit(timed, pinned), pinned.release)


@torch.inference_mode()
def rollout_batch(
    actor: PolicyAndValue,
    reference: Reference | None,
    scorer: RewardScorer,
    answers: Generations,
    prompts: list[str],
    cfg: PpoSection,
    moments: RunningMoments | None = None,
    gather: Callable[[Tensor], Tensor] = lambda x: x,
) -> Rollout:
    """Score and evaluate one batch of answers to `prompts` (b = len(prompts)). Without
    `reference` (β = 0: the KL would shape nothing) no reference forward runs and
    `ref_logprobs` is None."""
    device = next(actor.parameters()).device
    timings: dict[str, float] = {}
    actor.eval()

    # 1. Score decoded text with the reward model's own tokenizer, in batches.
    start = time.perf_counter()
    raw_scores, n_truncated = scorer.score(prompts, answers.texts)
    scores = shaped_scores(raw_scores, answers.ended, cfg, moments, gather)
    timings["time/score_s"] = time.perf_counter() - start

    # 2. Old log-probs and values (one pass), reference log-probs (adapter off), each under
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
