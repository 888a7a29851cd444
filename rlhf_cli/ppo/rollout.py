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

When the update is one forward pass and one optimiser step, and nothing before it reads the old
log-probs (`old_logprobs_at_update`), the rollout runs no policy forward: the update's own
forward gives them (`keep_old_logprobs`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch import Tensor

from rlhf_cli.data import reward_keywords
from rlhf_cli.generation import (
    Generations,
    PolicyVersion,
    response_logits,
    response_logprobs,
    row_seed,
)
from rlhf_cli.modeling import Reference
from rlhf_cli.ppo.core import RunningMoments, uniform_groups
from rlhf_cli.ppo.distributed import (
    answered_everywhere,
    any_process,
    global_rows,
    prompt_rows,
)
from rlhf_cli.ppo.experience import Draft, Rollout
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.run import PPORun
from rlhf_cli.recipe import PpoSection
from rlhf_cli.scoring import RewardScorer, completion_ids


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
    update's forward. At β = 0 no reference forward runs: the KL would shape nothing; when the
    update's forward gives the old log-probs (`old_logprobs_at_update`), no policy forward runs.

    With `generation.async_steps` N >= 1 the answers were asked for up to N iterations ago
    (`Draft`); once they are in, the latest weights go to the servers and the rollouts of the
    next N iterations are asked for, answered while this one is scored and trained on. The
    first iteration (and the first after a resume) is generated from the latest weights.

    Generation may fail on one process only (a rollout server lost to it): every process learns
    of it before the first collective of the scoring (`distributed.answered_everywhere`)."""
    cfg, acc, models = run.recipe.ppo, run.accelerator, run.models
    kl_coef = run.state.kl_ctl.value
    with acc.autocast(), models.engine.gathered(models.actor) as actor:
        draft, answers, waited, generating, published = answered_everywhere(
            acc, lambda: answered_draft(run, iteration, actor.policy)
        )
        index, sampled = draft.index, {}
        if cfg.dynamic_sampling:
            start = time.perf_counter()
            index, answers, sampled = refilled(run, iteration, published, index, answers)
            generating += time.perf_counter() - start
        rollout = rollout_batch(
            actor,
            models.reference if kl_coef > 0 else None,
            models.scorer,
            answers,
            [run.prompts[i] for i in index],
            cfg,
            run.state.score_moments,
            lambda x: acc.gather(x.to(acc.device)).cpu(),
            old_logprobs=not old_logprobs_at_update(cfg, kl_coef),
            keywords=keywords_of(run, index, iteration),
        )
    rollout.timings.update(sampled)
    rollout.timings["time/rollout_s"] = waited  # what the loop waited for its answers
    rollout.timings["time/generate_s"] = generating  # what answering them took
    rollout.staleness = iteration - 1 - draft.version
    return rollout


def keywords_of(run: PPORun, index: list[int], iteration: int) -> dict[str, Any]:
    """What the reward functions get beside the texts for prompts `index`: their rows' extra
    columns and the step."""
    return {**reward_keywords([run.columns[i] for i in index]), "step": iteration}


def refilled(
    run: PPORun,
    iteration: int,
    published: PolicyVersion | None,
    index: list[int],
    answers: Generations,
) -> tuple[list[int], Generations, dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): this process's prompts and answers
    with every group whose answers all score the same (no gradient under rloo or grpo)
    replaced, where a later batch has one that does not, and the numbers logged.

    Round n (n = 1, 2, ...) draws a whole fresh batch (its seeds: rows n × batch_size + row of
    `row_seed`) and fills each open slot of the batch with the group at the same slot, when
    that group is not uniform. A slot's rows sit at the same positions of the same processes in
    every round (`prompt_rows`), so each process fills its own rows; whether a group is uniform
    is decided on the global batch (`global_rows`), alike everywhere, and whether another round
    is drawn by a collective every process reaches (`any_process`): every process makes the
    same generate calls. After `dynamic_sampling_max_rounds` batches the slots still open keep
    their first, uniform group: trained on with no gradient from it."""
    cfg, acc, k = run.recipe.ppo, run.accelerator, run.recipe.ppo.num_generations
    rows_of = global_rows(acc)

    def uniform(idx: list[int], batch: Generations) -> torch.Tensor:
        with torch.inference_mode():
            scores = run.models.scorer.scored(
                [run.prompts[i] for i in idx], batch.texts, keywords_of(run, idx, iteration)
            ).rewards
        shaped = shaped_scores(scores, batch.ended, cfg)  # what the advantages compare
        return rows_of(lambda g: uniform_groups(g, k).float(), shaped).bool()

    index, kept = list(index), [answers]
    pick = torch.zeros(len(index), dtype=torch.long)
    still = uniform(index, answers)
    dropped, rounds = [still.clone()], 1
    while rounds < cfg.dynamic_sampling_max_rounds and any_process(acc, bool(still.any())):
        draft = ask_rollout(run, iteration, published, batch_round=rounds)
        fresh = answered_everywhere(acc, lambda: draft.answers.result()[0])  # noqa: B023
        flat = uniform(draft.index, fresh)
        fill = still & ~flat
        for row in fill.nonzero().flatten().tolist():
            index[row], pick[row] = draft.index[row], rounds
        still &= flat
        dropped.append(flat)
        kept.append(fresh)
        rounds += 1
    counts = torch.tensor(
        [float(torch.cat(dropped).sum()), float(sum(len(d) for d in dropped)), float(still.sum())],
        device=acc.device,
    )
    uniform_rows, all_rows, left = acc.reduce(counts, "sum").tolist()
    metrics = {
        "rollout/dropped_groups_rate": uniform_rows / all_rows,
        "rollout/sampling_rounds": float(rounds),
        "rollout/uniform_groups_kept": left / k,
    }
    return index, merged_rows(kept, pick), metrics


def merged_rows(batches: list[Generations], pick: torch.Tensor) -> Generations:
    """Row i of `batches[pick[i]]`, for every row: queries left-padded and responses
    right-padded to the widest picked (pads masked out, id 0)."""
    if not bool(pick.any()):
        return batches[0]
    rows = [(batches[int(b)], i) for i, b in enumerate(pick.tolist())]
    p = max(int(b.query_ids.shape[1]) for b, _ in rows)
    r = max(int(b.response_ids.shape[1]) for b, _ in rows)

    def left(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (p - t.shape[-1], 0))

    def right(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, r - t.shape[-1]))

    with_logprobs = all(b.sampler_logprobs is not None for b, _ in rows)
    return Generations(
        query_ids=torch.stack([left(b.query_ids[i]) for b, i in rows]),
        query_mask=torch.stack([left(b.query_mask[i]) for b, i in rows]),
        response_ids=torch.stack([right(b.response_ids[i]) for b, i in rows]),
        response_mask=torch.stack([right(b.response_mask[i]) for b, i in rows]),
        ended=torch.stack([b.ended[i] for b, i in rows]),
        texts=[b.texts[i] for b, i in rows],
        sampler_logprobs=(
            torch.stack([right(b.sampler_logprobs[i]) for b, i in rows]) if with_logprobs else None
        ),
    )


def answered_draft(
    run: PPORun, iteration: int, policy: Any
) -> tuple[Draft, Generations, float, float, PolicyVersion | None]:
    """Iteration `iteration`'s draft, answered (by `policy`, the latest weights, unless it was
    asked for ahead), with its answers, the seconds waited for them, the seconds answering
    took and the policy handle it was asked of when that was now (None: asked for ahead); with
    `async_steps` the later iterations' drafts are asked for, from `policy`. Generation alone:
    no collective."""
    cfg, generator, drafts = run.recipe.ppo, run.models.generator, run.drafts
    start = time.perf_counter()
    draft = drafts.pending.pop(iteration, None)
    synced, published = draft is None, None
    if draft is None:
        published = generator.sync(policy)  # a separate engine gets the latest weights
        draft = ask_rollout(run, iteration, published)
    answers, generating = draft.answers.result()
    waited = time.perf_counter() - start
    if cfg.generation.async_steps:
        if not synced:
            published = generator.sync(policy)
        last = min(iteration + cfg.generation.async_steps, cfg.iterations)
        for later in range(iteration + 1, last + 1):
            if later not in drafts.pending:
                drafts.pending[later] = ask_rollout(run, later, published, iteration - 1)
    return draft, answers, waited, generating, published if synced else None


def ask_rollout(
    run: PPORun,
    iteration: int,
    published: PolicyVersion,
    version: int | None = None,
    batch_round: int = 0,
) -> Draft:
    """Ask the rollout engine for iteration `iteration`'s answers: this process's prompts drawn
    now, each row from its seed; answered (in the drafts' thread) by the policy `published`
    names (`version`: the PPO updates it has seen, iteration - 1 when it is the latest).
    `batch_round` n > 0: dynamic sampling's n-th extra batch, seeded apart (`refilled`)."""
    cfg, acc, generator = run.recipe.ppo, run.accelerator, run.models.generator
    index = prompt_rows(
        acc, len(run.prompts), cfg.batch_size, cfg.num_generations, run.state.sampler
    )
    rows = range(acc.process_index, cfg.batch_size, acc.num_processes)  # global batch rows
    offset = batch_round * cfg.batch_size
    seeds = [row_seed(run.recipe.run.seed, iteration, offset + row) for row in rows]
    queries = [run.queries[i] for i in index]
    version = iteration - 1 if version is None else version

    def timed(generate: Callable[..., Generations]) -> tuple[Generations, float]:
        start = time.perf_counter()
        return generate(queries, cfg.generation, seeds), time.perf_counter() - start

    if not cfg.generation.async_steps:  # answered here and now, in this thread's precision
        answers: Future[tuple[Generations, float]] = Future()
        answers.set_result(timed(partial(generator.generate, policy=published)))
        return Draft(index, version, answers, lambda: None)
    pinned = generator.pinned(published)  # only the servers' client overlaps (the recipe checks)
    return Draft(index, version, run.drafts.pool.submit(timed, pinned), pinned.release)


def old_logprobs_at_update(cfg: PpoSection, kl_coef: float) -> bool:
    """Whether the rollout leaves the old log-probs to the update's forward and runs no policy
    forward of its own (TRL skips that pass in the same case): one forward pass less per
    iteration.

    Valid when the update is a single forward/backward and optimiser step, and nothing reads
    the old log-probs or values before it: `ppo_epochs` 1 with `mini_batch_size` = `batch_size`
    (one mini-batch on every process, however many: `distributed.minibatch_rows`; the recipe
    then has `gradient_accumulation_steps` 1), no critic (GAE needs the rollout's values before
    the update), and no KL in the rewards (`kl_in: loss`, or β = `kl_coef` = 0). That forward
    sees the rollout's weights, so its log-probs, detached, are π_old: the ratio is exactly 1,
    where a separate pass gives 1 up to float noise."""
    return (
        cfg.ppo_epochs == 1
        and cfg.mini_batch_size == cfg.batch_size
        and not cfg.needs_critic
        and (cfg.kl_in == "loss" or kl_coef == 0)
    )


def warped_logprobs(
    logits: Tensor, response_ids: Tensor, logprobs: Tensor, cfg: PpoSection
) -> Tensor:
    """The response's log-probs under the sampler's distribution, from the `logits` that gave
    `logprobs` (in `logprob_support`): those, detached, when the support is the sampler's, else
    computed again over the warped logits (no forward pass, no gradient)."""
    if cfg.logprob_support == "sampled":
        return logprobs.detach()
    with torch.no_grad():
        return response_logprobs(logits, response_ids, cfg.generation)


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
    old_logprobs: bool = True,
    keywords: dict[str, Any] | None = None,
) -> Rollout:
    """Score and evaluate one batch of answers to `prompts` (b = len(prompts)), the reward
    functions given `keywords` (the rows' columns, `step`) and the answers' `completion_ids`.
    Without
    `reference` (β = 0: the KL would shape nothing) no reference forward runs and
    `ref_logprobs` is None. Without `old_logprobs` (`old_logprobs_at_update`) no policy
    forward runs: `logprobs` and `warped_logprobs` are None until the update gives them, and
    the values are zeros, as a critic-free actor gives them."""
    device = next(actor.parameters()).device
    timings: dict[str, float] = {}
    actor.eval()

    # 1. Score decoded text with the reward model's own tokenizer, in batches.
    start = time.perf_counter()
    scored = scorer.scored(
        prompts, answers.texts, {**(keywords or {}), "completion_ids": completion_ids(answers)}
    )
    raw_scores, n_truncated = scored.rewards, scored.n_truncated
    scores = shaped_scores(raw_scores, answers.ended, cfg, moments, gather)
    timings["time/score_s"] = time.perf_counter() - start

    # 2. Old log-probs and values (one pass, unless left to the update), reference log-probs
    #    (adapter off), each under `logprob_support`; the old ones also under the sampler's
    #    distribution, which is what the sampler's own log-probs are checked against.
    start = time.perf_counter()
    input_ids, attention_mask = answers.input_ids, answers.attention_mask
    support = cfg.logprob_support
    parts: dict[str, list[Tensor]] = defaultdict(list)
    width, step = answers.response_ids.shape[1], cfg.mini_batch_size
    for s in range(0, len(prompts), step):
        ids, mask = input_ids[s : s + step], attention_mask[s : s + step]
        resp = answers.response_ids[s : s + step]
        if old_logprobs:
            logits, values = actor(ids, mask, width)
            parts["logprobs"].append(response_logprobs(logits, resp, cfg.generation, support))
            parts["warped_logprobs"].append(
                warped_logprobs(logits, resp, parts["logprobs"][-1], cfg)
            )
            parts["values"].append(values)
            del logits
        if reference is not None:
            with reference.model() as ref:
                ref_logits = response_logits(ref, ids, mask, width)
            parts["ref_logprobs"].append(
                response_logprobs(ref_logits, resp, cfg.generation, support)
            )
            del ref_logits
    timings["time/logprobs_s"] = time.perf_counter() - start
    if not old_logprobs:  # critic-free: the values a forward would give
        parts["values"].append(torch.zeros(answers.response_ids.shape, device=device))
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    return Rollout(
        **vars(answers),
        scores=scores.to(device),
        raw_scores=raw_scores.to(device),
        logprobs=tensors.get("logprobs"),
        warped_logprobs=tensors.get("warped_logprobs"),
        ref_logprobs=tensors.get("ref_logprobs"),
        values=tensors["values"],
        prompts=prompts,
        n_truncated=n_truncated,
        reward_metrics=scored.metrics,
        timings=timings,
    )


def keep_old_logprobs(
    rollout: Rollout, idx: Tensor, logits: Tensor, logprobs: Tensor, cfg: PpoSection
) -> None:
    """Give `rollout` the old log-probs it left to the update (`old_logprobs_at_update`), from
    the update's forward over rows `idx`, every row of this process's (one mini-batch):
    `logprobs` (in `logprob_support`) detached, and the sampler's-distribution ones from the
    same `logits`."""
    rows = len(rollout.prompts)
    if sorted(idx.tolist()) != list(range(rows)):
        raise RuntimeError(
            f"the old log-probs were left to a forward over {len(idx)} of {rows} rows"
        )
    order = torch.argsort(idx)  # row i was the forward's order[i]-th
    warped = warped_logprobs(logits, rollout.response_ids[idx], logprobs, cfg)
    rollout.logprobs, rollout.warped_logprobs = logprobs.detach()[order], warped[order]


def logprob_mismatch(rollout: Rollout) -> float:
    """Largest |log-prob as the sampler drew the token - log-prob of the training forward under
    the same distribution| over the batch's response tokens (0 when the backend records
    none)."""
    if rollout.sampler_logprobs is None or not rollout.response_mask.any():
        return 0.0
    old = rollout.warped_logprobs
    diff = (rollout.sampler_logprobs.to(old.device) - old).abs()
    return float(diff[rollout.response_mask].max())
