"""Rollout: generate responses for a batch of prompts, score them, and take the log-probs and
values PPO needs, all under inference mode and once per iteration.

The details that decide whether PPO works (Huang et al. 2023, "The N implementation details"):
- response masks come from generated lengths (first stop token, included), never from
  `== pad_token_id`, so a real EOS survives when pad equals EOS;
- the score goes on the last real response token, never on a pad after it (core.py);
- the policy, value and reference passes see generation's left-padded positions;
- log-probs use the sampling temperature, as the sampler did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlhf_cli.ppo.core import logprobs_from_logits
from rlhf_cli.ppo.models import PolicyAndValue, Reference
from rlhf_cli.recipe import GenerationSection
from rlhf_cli.scoring import RewardScorer


@dataclass
class Rollout:
    """One iteration's experience. b = rollouts on this process, p = query width, r = response
    width (trimmed to the longest response of the batch)."""

    query_ids: Tensor  # (b, p) left-padded
    query_mask: Tensor  # (b, p)
    response_ids: Tensor  # (b, r)
    response_mask: Tensor  # (b, r) bool, True up to and including the first stop token
    ended: Tensor  # (b,) bool: the response has a stop token
    scores: Tensor  # (b,) reward-model scores (after penalties / clipping)
    raw_scores: Tensor  # (b,) as the reward model gave them
    logprobs: Tensor  # (b, r) policy at rollout time (the "old" log-probs)
    ref_logprobs: Tensor  # (b, r)
    values: Tensor  # (b, r)
    prompts: list[str]
    responses: list[str]
    n_truncated: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.query_mask, self.response_mask.long()], dim=1)

    def select(self, index: Tensor) -> dict[str, Tensor]:
        """The tensors a mini-batch update needs, for rollouts `index`."""
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "response_ids": self.response_ids[index],
                "response_mask": self.response_mask[index]}


def response_mask_from(response_ids: Tensor, stop_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask (b, r) True up to and including the first stop token; `ended` (b,).

    Built from positions, not from pad ids: with pad == eos the real EOS stays inside the mask.
    """
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    ended = is_stop.any(dim=1)
    first_stop = torch.where(ended, is_stop.float().argmax(dim=1),
                             torch.full_like(ended, response_ids.shape[1] - 1, dtype=torch.long))
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    return positions.unsqueeze(0) <= first_stop.unsqueeze(1), ended


def left_pad(queries: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(queries), width), dtype=torch.long)
    for row, query in enumerate(queries):
        ids[row, width - len(query):] = torch.tensor(query)
        mask[row, width - len(query):] = 1
    return ids.to(device), mask.to(device)


def response_logprobs(logits: Tensor, response_ids: Tensor, query_width: int,
                      temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probs (b, r) of the response tokens and the logits (b, r, vocab) they come from.

    logits (b, p + r, vocab) of the whole sequence; position p-1+i predicts response token i.
    """
    width = response_ids.shape[1]
    step_logits = logits[:, query_width - 1: query_width - 1 + width].float() / temperature
    return logprobs_from_logits(step_logits, response_ids), step_logits


def generate(model: Any, tokenizer: Any, queries: list[list[int]], gen: GenerationSection,
             stop_ids: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Left-padded batched sampling with the KV cache. Returns query ids and mask (b, p),
    response ids (b, r) trimmed to the longest response with pads after each stop token,
    response mask (b, r) and `ended` (b,)."""
    device = next(model.parameters()).device
    query_ids, query_mask = left_pad(queries, tokenizer.pad_token_id, device)
    output = model.generate(
        input_ids=query_ids, attention_mask=query_mask, max_new_tokens=gen.max_new_tokens,
        do_sample=gen.do_sample, temperature=gen.temperature if gen.do_sample else None,
        top_p=gen.top_p if gen.do_sample else None, top_k=gen.top_k if gen.do_sample else None,
        eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    response_ids = output[:, query_ids.shape[1]:]
    response_mask, ended = response_mask_from(response_ids, stop_ids)
    width = max(int(response_mask.sum(1).max()), 1)
    response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
    response_ids = torch.where(response_mask, response_ids, tokenizer.pad_token_id)
    return query_ids, query_mask, response_ids, response_mask, ended


def decode(tokenizer: Any, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    return [tokenizer.decode(ids[mask], skip_special_tokens=True).strip()
            for ids, mask in zip(response_ids.cpu(), response_mask.cpu(), strict=True)]


def tokenize_prompts(tokenizer: Any, prompts: list[str], chat: bool,
                     max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (chat template with the generation prompt when `chat`),
    truncated from the left to `max_tokens` so the generation prompt survives."""
    if chat and tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompts)["input_ids"]
    return [q[-max_tokens:] for q in ids]


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def score_temperature(gen: GenerationSection) -> float:
    return gen.temperature if gen.do_sample else 1.0


@torch.inference_mode()
def collect_rollout(actor: PolicyAndValue, reference: Reference, scorer: RewardScorer,
                    tokenizer, prompts: list[str], queries: list[list[int]],
                    gen: GenerationSection, stop_ids: list[int],
                    missing_eos_penalty: float | None = None,
                    reward_clip: float | None = None, mini_batch_size: int = 8) -> Rollout:
    """Generate, score and evaluate one batch of prompts (b = len(prompts))."""
    device = next(actor.parameters()).device
    timings: dict[str, float] = {}
    actor.eval()

    # 1. Batched, left-padded generation with the KV cache.
    start = time.perf_counter()
    query_ids, query_mask, response_ids, response_mask, ended = generate(
        actor.policy, tokenizer, queries, gen, stop_ids)
    width = response_ids.shape[1]
    timings["time/rollout_s"] = time.perf_counter() - start

    # 2. Score decoded text with the reward model's own tokenizer, in batches.
    start = time.perf_counter()
    responses = decode(tokenizer, response_ids, response_mask)
    raw_scores, n_truncated = scorer.score(prompts, responses)
    scores = raw_scores.clone()
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~ended.cpu()).float()
    timings["time/score_s"] = time.perf_counter() - start

    # 3. Old log-probs and values (one pass), reference log-probs (adapter off).
    start = time.perf_counter()
    attention_mask = torch.cat([query_mask, response_mask.long()], dim=1)
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    temperature = score_temperature(gen)
    parts: dict[str, list[Tensor]] = {"logprobs": [], "values": [], "ref_logprobs": []}
    p = query_ids.shape[1]
    for s in range(0, len(prompts), mini_batch_size):
        ids, mask = input_ids[s:s + mini_batch_size], attention_mask[s:s + mini_batch_size]
        resp = response_ids[s:s + mini_batch_size]
        logits, values = actor(ids, mask)
        parts["logprobs"].append(response_logprobs(logits, resp, p, temperature)[0])
        parts["values"].append(values[:, p - 1: p - 1 + width].float())
        ref_logits = reference.logits(ids, mask)
        parts["ref_logprobs"].append(response_logprobs(ref_logits, resp, p, temperature)[0])
    timings["time/logprobs_s"] = time.perf_counter() - start
    return Rollout(query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
                   response_mask=response_mask, ended=ended, scores=scores.to(device),
                   raw_scores=raw_scores.to(device),
                   **{k: torch.cat(v) for k, v in parts.items()}, prompts=prompts,
                   responses=responses, n_truncated=n_truncated, timings=timings)
