"""Audit a live or saved policy: sample on the audit prompts, run the detectors, and, when a
reward model and the reference are at hand, compare rewards and measure the KL to the reference.
Used by `rlhf audit` and inside `rlhf ppo` (`audit.every`)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.audit.detectors import audit_responses
from rlhf_cli.generation import (
    Generations,
    Generator,
    response_logits,
    response_logprobs,
    row_seed,
    tokenize_prompts,
)
from rlhf_cli.modeling import Reference
from rlhf_cli.recipe import AuditSection, GenerationSection
from rlhf_cli.scoring import RewardScorer


def sample_answers(
    generator: Generator,
    queries: list[list[int]],
    gen: GenerationSection,
    batch_size: int,
    seed: int,
) -> list[Generations]:
    """Answers to `queries` in batches of `batch_size`, each row from its own seed (round 0 of
    `row_seed`): the same draws whatever the engine sampled before."""
    seeds = [row_seed(seed, 0, row) for row in range(len(queries))]
    return [
        generator.generate(
            queries[start : start + batch_size], gen, seeds[start : start + batch_size]
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
) -> dict[str, Any]:
    """The guide's audit report on `cfg.samples` responses per prompt; with the reference, the
    policy's KL to it and its answers' length against the reference's; with a reward model too,
    their mean rewards. `generator` (the recipe's backend, `generation.generator_for`) samples,
    synced to the policy, then to the reference. Each answer samples from its own seed, derived
    from `seed`, so the frozen reference's answers (in each sample's `reference`) are the same
    every audit of a run: passed back as `reference_responses`, they are not sampled again."""
    was_training = model.training
    model.eval()
    asked = [p for p in prompts for _ in range(cfg.samples)]
    queries = tokenize_prompts(tokenizer, asked, chat, max_tokens)
    generator.sync(model)
    batches = sample_answers(generator, queries, cfg.generation, batch_size, seed)
    responses = [text for answers in batches for text in answers.texts]
    ref_responses, measured = None, {}
    if reference is not None:
        measured["kl_to_reference"] = kl_to_reference(model, reference, batches, cfg.generation)
        ref_responses = reference_responses
        if ref_responses is None:
            with reference.model() as ref:
                generator.sync(ref)
                ref_batches = sample_answers(generator, queries, cfg.generation, batch_size, seed)
            ref_responses = [text for answers in ref_batches for text in answers.texts]
    report = audit_responses(responses, cfg, ref_responses)
    if scorer is not None:
        report["reward_policy_mean"] = float(scorer.score(asked, responses)[0].mean())
    report.update(measured)
    if scorer is not None and ref_responses is not None:
        report["reward_reference_mean"] = float(scorer.score(asked, ref_responses)[0].mean())
    report["samples"] = [
        {"prompt": p, "response": r} for p, r in zip(asked, responses, strict=True)
    ]
    if ref_responses is not None:
        for sample, ref_response in zip(report["samples"], ref_responses, strict=True):
            sample["reference"] = ref_response
    model.train(was_training)
    return report


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
    reference_scores: torch.Tensor | None = None,
    batch_size: int = 16,
) -> tuple[dict[str, float], torch.Tensor]:
    """The policy's answers to held-out `prompts` (each row seeded) scored by the reward model
    against the reference's answers to the same prompts from the same seeds: `eval/*` metrics,
    and the reference's scores (pass them back in: the reference does not change)."""
    was_training = model.training
    model.eval()
    generator.sync(model)
    batches = sample_answers(generator, queries, gen, batch_size, seed)
    scores = scorer.score(prompts, [t for b in batches for t in b.texts])[0].float()
    if reference_scores is None:
        with reference.model() as ref:
            generator.sync(ref)
            ref_batches = sample_answers(generator, queries, gen, batch_size, seed)
        ref_texts = [t for b in ref_batches for t in b.texts]
        reference_scores = scorer.score(prompts, ref_texts)[0].float()
    wins = (scores > reference_scores).float() + 0.5 * (scores == reference_scores).float()
    lengths = torch.cat([b.response_mask.sum(1).float() for b in batches])
    metrics = {
        "eval/reward_mean": float(scores.mean()),
        "eval/reward_reference_mean": float(reference_scores.mean()),
        "eval/win_rate": float(wins.mean()),
        "eval/kl": kl_to_reference(model, reference, batches, gen),
        "eval/length_mean": float(lengths.mean()),
    }
    model.train(was_training)
    return metrics, reference_scores
