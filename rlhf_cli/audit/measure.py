"""Audit a live or saved policy: sample on the audit prompts, run the detectors, and, when a
reward model and the reference are at hand, compare rewards and measure the KL to the reference;
with a judge (`audit.judge`), its rewards beside the proxy's. Used by `rlhf audit` and inside
`rlhf ppo` (`audit.every`, and the held-out evaluation)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from rlhf_cli.audit.detectors import audit_responses, judge_agreement
from rlhf_cli.generation import (
    Generations,
    Generator,
    PolicyVersion,
    response_logits,
    response_logprobs,
    row_seed,
    tokenize_prompts,
)
from rlhf_cli.modeling import Reference
from rlhf_cli.recipe import AuditSection, GenerationSection
from rlhf_cli.scoring import RewardScorer, completion_ids


def sample_answers(
    generator: Generator,
    queries: list[list[int]],
    gen: GenerationSection,
    batch_size: int,
    seed: int,
    policy: PolicyVersion,
) -> list[Generations]:
    """Answers by `policy` to `queries` in batches of `batch_size`, each row from its own seed
    (round 0 of `row_seed`): the same draws whatever the engine sampled before."""
    seeds = [row_seed(seed, 0, row) for row in range(len(queries))]
    return [
        generator.generate(
            queries[start : start + batch_size], gen, seeds[start : start + batch_size], policy
        )
        for start in range(0, len(queries), batch_size)
    ]


@torch.inference_mode()
def kl_to_reference(
    model: Any, reference: Reference, batches: list[Generations], gen: GenerationSection
) -> float:
    """Mean over responses of Σ_t (log π − log π_ref) on the policy's own samples, both under
    the distribution the sampler draws from (`gen`)."""
    totals = []
    for answers in batches:
        ids, mask, width = answers.input_ids, answers.attention_mask, answers.response_ids.shape[1]
        logits = response_logits(model, ids, mask, width)
        logp = response_logprobs(logits, answers.response_ids, gen)
        with reference.model() as ref:
            ref_logits = response_logits(ref, ids, mask, width)
        ref_logp = response_logprobs(ref_logits, answers.response_ids, gen)
        totals.append(((logp - ref_logp) * answers.response_mask).sum(1))
    return float(torch.cat(totals).mean())


def audit_policy(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: AuditSection,
    *,
    chat: bool,
    max_tokens: int,
    seed: int,
    reference: Reference | None = None,
    scorer: RewardScorer | None = None,
    generator: Generator,
    reference_responses: list[str] | None = None,
    batch_size: int = 16,
    judge: RewardScorer | None = None,
    keywords: dict[str, list[Any]] | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """The guide's audit report on `cfg.samples` responses per prompt; with the reference, the
    policy's KL to it and its answers' length against the reference's; with a reward model too,
    their mean rewards, and with a judge (`audit.judge`) its rewards and agreement
    (`score_answers`). `generator` (the recipe's backend, `generation.generator_for`) samples,
    synced to the policy, then to the reference. Each answer samples from its own seed, derived
    from `seed`, so the frozen reference's answers (in each sample's `reference`) are the same
    every audit of a run: passed back as `reference_responses`, they are not sampled again.
    The reward functions get `keywords` (each prompt's extra columns, repeated for its
    samples), `step` when given, and each answer's `completion_ids`."""
    was_training = model.training
    model.eval()
    asked = [p for p in prompts for _ in range(cfg.samples)]
    queries = tokenize_prompts(tokenizer, asked, chat, max_tokens)
    policy = generator.sync(model)
    batches = sample_answers(generator, queries, cfg.generation, batch_size, seed, policy)
    responses = [text for answers in batches for text in answers.texts]
    ref_responses, ref_ids, measured = None, None, {}
    if reference is not None:
        measured["kl_to_reference"] = kl_to_reference(model, reference, batches, cfg.generation)
        ref_responses = reference_responses
        if ref_responses is None:
            with reference.model() as ref:
                ref_policy = generator.sync(ref)
                ref_batches = sample_answers(
                    generator, queries, cfg.generation, batch_size, seed, ref_policy
                )
            ref_responses = [text for answers in ref_batches for text in answers.texts]
            ref_ids = [ids for answers in ref_batches for ids in completion_ids(answers)]
        if ref_ids is None:  # kept from an earlier audit as text
            ref_ids = tokenizer(ref_responses, add_special_tokens=False)["input_ids"]
    report = audit_responses(responses, cfg, ref_responses)
    report.update(measured)
    rows = {
        k: [v for v in values for _ in range(cfg.samples)] for k, values in (keywords or {}).items()
    }
    rows = {**rows, **({} if step is None else {"step": step})}
    given = (
        {**rows, "completion_ids": [ids for a in batches for ids in completion_ids(a)]},
        None if ref_ids is None else {**rows, "completion_ids": ref_ids},
    )
    per_sample = score_answers(report, asked, (responses, ref_responses), scorer, judge, given)
    report["samples"] = [
        {"prompt": p, "response": r} for p, r in zip(asked, responses, strict=True)
    ]
    if ref_responses is not None:
        for sample, ref_response in zip(report["samples"], ref_responses, strict=True):
            sample["reference"] = ref_response
    for key, values in per_sample.items():
        for sample, value in zip(report["samples"], values, strict=True):
            sample[key] = value
    model.train(was_training)
    return report


def score_answers(
    report: dict[str, Any],
    asked: list[str],
    answers: tuple[list[str], list[str] | None],
    scorer: RewardScorer | None,
    judge: RewardScorer | None,
    keywords: tuple[dict[str, Any], dict[str, Any] | None] = ({}, None),
) -> dict[str, list[float]]:
    """Into `report`: the mean reward of the policy's answers and of the reference's (when
    `answers` has them) under the proxy (`reward_*_mean`) and the judge (`judge_*_mean`); with
    both scorers and the reference, their agreement on which answer is better
    (`detectors.judge_agreement`), whose flag joins the report's. Returns each sample's scores
    (`reward`, `reward_reference`, `judge`, `judge_reference`) when there is a judge. The
    reward functions get `keywords` (the policy's answers', the reference's)."""
    responses, ref_responses = answers
    scores: dict[str, list[float]] = {}
    for name, scoring in (("reward", scorer), ("judge", judge)):
        if scoring is None:
            continue
        scores[name] = scoring.score(asked, responses, keywords[0])[0].float().tolist()
        report[f"{name}_policy_mean"] = sum(scores[name]) / len(scores[name])
        if ref_responses is not None:
            ref = scoring.score(asked, ref_responses, keywords[1])[0].float().tolist()
            scores[f"{name}_reference"] = ref
            report[f"{name}_reference_mean"] = sum(ref) / len(ref)
    if judge is None:
        return {}
    if len(scores) == 4:  # both scorers, both answers
        gains = {
            name: [p - r for p, r in zip(scores[name], scores[f"{name}_reference"], strict=True)]
            for name in ("reward", "judge")
        }
        agreement = judge_agreement(gains["reward"], gains["judge"])
        report["flags"] += agreement.pop("flags")
        report["hacking_detected"] = bool(report["flags"])
        report.update(agreement)
    return scores


class ReferenceScores(NamedTuple):
    """The reference's held-out answers' scores (n,), fixed for a run: the proxy's, and the
    judge's when there is one."""

    proxy: torch.Tensor
    judge: torch.Tensor | None = None


def win_rate(scores: torch.Tensor, reference_scores: torch.Tensor) -> float:
    """Share of rows (n,) where `scores` beat `reference_scores`, a tie counting ½."""
    wins = (scores > reference_scores).float() + 0.5 * (scores == reference_scores).float()
    return float(wins.mean())


def gain(scores: torch.Tensor, reference_scores: torch.Tensor) -> float:
    """The policy's mean score (n,) minus the reference's (n,), in units of the std of the
    reference's scores (1 when they are all alike, or a single one): a scale both the proxy and
    the judge share, fixed for a run."""
    unit = float(reference_scores.std()) if len(reference_scores) > 1 else 0.0
    return float(scores.mean() - reference_scores.mean()) / (unit if unit > 0 else 1.0)


def gain_se(scores: torch.Tensor, reference_scores: torch.Tensor) -> float:
    """The standard error of `gain` from the policy's side (the reference's scores are fixed
    for a run): the spread of `scores` over the root of their number, in `gain`'s units."""
    if len(scores) < 2:
        return 0.0
    unit = float(reference_scores.std()) if len(reference_scores) > 1 else 0.0
    return float(scores.std()) / len(scores) ** 0.5 / (unit if unit > 0 else 1.0)


def judge_metrics(
    policy: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, float]:
    """The judge's `eval/*` numbers from the (proxy, judge) scores, each (n,), of the policy's
    held-out answers and of the reference's."""
    (proxy, judge), (proxy_ref, judge_ref) = policy, reference
    reward_gain, judge_gain = gain(proxy, proxy_ref), gain(judge, judge_ref)
    return {
        "eval/judge_reward_gain_se": gain_se(judge, judge_ref),
        "eval/judge_reward_mean": float(judge.mean()),
        "eval/judge_reward_reference_mean": float(judge_ref.mean()),
        "eval/judge_win_rate": win_rate(judge, judge_ref),
        "eval/reward_gain": reward_gain,
        "eval/judge_reward_gain": judge_gain,
        "eval/proxy_judge_gap": reward_gain - judge_gain,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n answers to a prompt, c of them right (Chen et al.
    2021, eq. 1): 1 − C(n−c, k)/C(n, k), the chance that k of the n drawn without replacement
    hold a right one; never the best of k answers, which is biased low."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_metrics(scores: torch.Tensor, n: int, threshold: float) -> dict[str, float]:
    """`eval/*` numbers of n answers a prompt, scores (prompts × n,) with each prompt's answers
    consecutive: the mean reward over a prompt's n (`mean_at_k`), and the unbiased pass@1 and
    pass@n of answers scoring at least `threshold`, each a mean over the prompts."""
    right = (scores.view(-1, n) >= threshold).sum(1).tolist()
    metrics = {"eval/mean_at_k": float(scores.mean())}
    for k in sorted({1, n}):
        metrics[f"eval/pass_at_{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(right)
    return metrics


def repeated(rows: list[Any], n: int) -> list[Any]:
    """Each row n times, consecutively."""
    return [row for row in rows for _ in range(n)]


def heldout_eval(
    model: Any,
    prompts: list[str],
    queries: list[list[int]],
    gen: GenerationSection,
    *,
    seed: int,
    reference: Reference,
    scorer: RewardScorer,
    generator: Generator,
    judge: RewardScorer | None = None,
    reference_scores: ReferenceScores | None = None,
    batch_size: int = 16,
    keywords: dict[str, list[Any]] | None = None,
    step: int | None = None,
    samples_per_prompt: int = 1,
    pass_threshold: float = 1.0,
) -> tuple[dict[str, float], ReferenceScores]:
    """The policy's answers to held-out `prompts` (each row seeded) scored by the reward model
    (and the judge) against the reference's answers to the same prompts from the same seeds:
    `eval/*` metrics, and the reference's scores (pass them back in: the reference does not
    change). The reward functions get `keywords` (each prompt's extra columns), `step` when
    given and the answers' `completion_ids`; what they count is `eval/<name>` (e.g.
    `eval/no_answer_rate`). With `samples_per_prompt` n > 1 every prompt is answered n times
    (the policy and the reference alike), every number is over all the answers, and
    `sampled_metrics` adds mean@k and the unbiased pass@1 and pass@n (`pass_threshold`)."""
    n = samples_per_prompt
    if n > 1:
        prompts, queries = repeated(prompts, n), repeated(queries, n)
        keywords = {key: repeated(values, n) for key, values in (keywords or {}).items()}
    was_training = model.training
    model.eval()
    policy = generator.sync(model)
    batches = sample_answers(generator, queries, gen, batch_size, seed, policy)
    texts = [t for b in batches for t in b.texts]
    rows = {**(keywords or {}), **({} if step is None else {"step": step})}
    given = {**rows, "completion_ids": [ids for b in batches for ids in completion_ids(b)]}
    scored = scorer.scored(prompts, texts, given)
    scores = scored.rewards.float()
    if reference_scores is None:
        with reference.model() as ref:
            ref_policy = generator.sync(ref)
            ref_batches = sample_answers(generator, queries, gen, batch_size, seed, ref_policy)
        ref_texts = [t for b in ref_batches for t in b.texts]
        ref_given = {**rows, "completion_ids": [i for b in ref_batches for i in completion_ids(b)]}
        reference_scores = ReferenceScores(
            scorer.score(prompts, ref_texts, ref_given)[0].float(),
            None if judge is None else judge.score(prompts, ref_texts, ref_given)[0].float(),
        )
    lengths = torch.cat([b.response_mask.sum(1).float() for b in batches])
    metrics = {
        "eval/reward_mean": float(scores.mean()),
        "eval/reward_reference_mean": float(reference_scores.proxy.mean()),
        "eval/win_rate": win_rate(scores, reference_scores.proxy),
        "eval/kl": kl_to_reference(model, reference, batches, gen),
        "eval/length_mean": float(lengths.mean()),
        **{f"eval/{key.partition('/')[2]}": value for key, value in scored.metrics.items()},
    }
    if n > 1:
        metrics.update(sampled_metrics(scores, n, pass_threshold))
    if judge is not None and reference_scores.judge is not None:
        judged = judge.score(prompts, texts, given)[0].float()
        reference_pair = (reference_scores.proxy, reference_scores.judge)
        metrics.update(judge_metrics((scores, judged), reference_pair))
    model.train(was_training)
    return metrics, reference_scores
