"""Answers to prompts, for every caller: PPO rollouts, the audit, the merge check and compare.

One interface: a `Generator` takes tokenised prompts and a `GenerationSection` and returns a
`Generations` record (token ids, masks, `ended`, decoded text). `generator_for` picks the
backend; `HFGenerator` (transformers `generate`, KV cache, left padding) is the one today, and a
second backend (vLLM) implements the same `generate` without its callers changing.

The facts that make sampled tokens and their log-probs agree live here too, so that every
forward pass scores a token under the distribution it was drawn from:
- positions count real tokens only, exactly as `generate()` numbers left-padded rows;
- log-probs divide the logits by the sampling temperature, as the sampler did;
- response masks come from generated lengths (first stop token, included), never from
  `== pad_token_id`, so a real EOS survives when pad equals EOS (Huang et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rlhf_cli.recipe import GenerationSection


@dataclass
class Generations:
    """Answers to one batch of prompts. b = prompts, p = query width, r = response width
    (trimmed to the longest response of the batch)."""

    query_ids: Tensor  # (b, p) left-padded
    query_mask: Tensor  # (b, p)
    response_ids: Tensor  # (b, r), pad after each response's stop token
    response_mask: Tensor  # (b, r) bool, True up to and including the first stop token
    ended: Tensor  # (b,) bool: the response has a stop token
    texts: list[str]  # decoded responses, special tokens dropped, stripped

    @property
    def input_ids(self) -> Tensor:
        """(b, p + r) query and response, as one forward pass sees them."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(b, p + r)."""
        return torch.cat([self.query_mask, self.response_mask.long()], dim=1)


class Generator(Protocol):
    """What every generation backend offers its callers."""

    stop_ids: list[int]

    def generate(self, queries: list[list[int]], gen: GenerationSection) -> Generations:
        """Answers to `queries` (token ids of each prompt) sampled with `gen`."""
        ...


# ── prompts in, token tensors out ───────────────────────────────────────────────────────────────


def tokenize_prompts(
    tokenizer: Any, prompts: list[str], chat: bool, max_tokens: int
) -> list[list[int]]:
    """Token ids of each prompt (chat template with the generation prompt when `chat`),
    truncated from the left to `max_tokens` so the generation prompt survives."""
    if chat and tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompts)["input_ids"]
    return [q[-max_tokens:] for q in ids]


def left_pad(queries: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Ids and attention mask (b, p), each query right-aligned."""
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(queries), width), dtype=torch.long)
    for row, query in enumerate(queries):
        ids[row, width - len(query) :] = torch.tensor(query)
        mask[row, width - len(query) :] = 1
    return ids.to(device), mask.to(device)


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's EOS and every EOS the model's generation config names."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def response_mask_from(response_ids: Tensor, stop_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask (b, r) True up to and including the first stop token; `ended` (b,).

    Built from positions, not from pad ids: with pad == eos the real EOS stays inside the mask.
    """
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    ended = is_stop.any(dim=1)
    first_stop = torch.where(
        ended,
        is_stop.float().argmax(dim=1),
        torch.full_like(ended, response_ids.shape[1] - 1, dtype=torch.long),
    )
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    return positions.unsqueeze(0) <= first_stop.unsqueeze(1), ended


def decode(tokenizer: Any, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """Text of each response's valid tokens, special tokens dropped."""
    return [
        tokenizer.decode(ids[mask], skip_special_tokens=True).strip()
        for ids, mask in zip(response_ids.cpu(), response_mask.cpu(), strict=True)
    ]


# ── the distribution the tokens were drawn from ─────────────────────────────────────────────────


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only: left-padded rows start at 0 on their first token,
    exactly as `generate()` numbers them, so every forward pass sees generation's positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Logits (b, t, vocab) of a causal LM at generation's positions, without a KV cache."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        use_cache=False,
    ).logits


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability (b, t) of ``labels`` (b, t) under ``log_softmax(logits)`` (b, t, vocab).
    [TRL ``logprobs_from_logits``]"""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def score_temperature(gen: GenerationSection) -> float:
    """The temperature the sampler divided the logits by (1 for greedy decoding)."""
    return gen.temperature if gen.do_sample else 1.0


def response_logprobs(
    logits: Tensor, response_ids: Tensor, query_width: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """Log-probs (b, r) of the response tokens and the scaled logits (b, r, vocab) they come from.

    logits (b, p + r, vocab) of the whole sequence; position p-1+i predicts response token i.
    """
    width = response_ids.shape[1]
    step_logits = logits[:, query_width - 1 : query_width - 1 + width].float() / temperature
    return logprobs_from_logits(step_logits, response_ids), step_logits


# ── backends ────────────────────────────────────────────────────────────────────────────────────


@dataclass
class HFGenerator:
    """transformers `generate`: left-padded batches with the KV cache."""

    model: Any
    tokenizer: Any
    stop_ids: list[int]

    @torch.inference_mode()
    def generate(self, queries: list[list[int]], gen: GenerationSection) -> Generations:
        """Answers to `queries`; responses trimmed to the longest, pads after each stop."""
        pad_id = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        query_ids, query_mask = left_pad(queries, pad_id, device)
        sample = gen.do_sample
        output = self.model.generate(
            input_ids=query_ids,
            attention_mask=query_mask,
            max_new_tokens=gen.max_new_tokens,
            do_sample=sample,
            temperature=gen.temperature if sample else None,
            top_p=gen.top_p if sample else None,
            top_k=gen.top_k if sample else None,
            eos_token_id=self.stop_ids,
            pad_token_id=pad_id,
            use_cache=True,
        )
        response_ids = output[:, query_ids.shape[1] :]
        response_mask, ended = response_mask_from(response_ids, self.stop_ids)
        width = max(int(response_mask.sum(1).max()), 1)
        response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
        response_ids = torch.where(response_mask, response_ids, pad_id)
        return Generations(
            query_ids,
            query_mask,
            response_ids,
            response_mask,
            ended,
            decode(self.tokenizer, response_ids, response_mask),
        )


def generator_for(model: Any, tokenizer: Any) -> Generator:
    """The generation backend for `model` (transformers `generate` today)."""
    return HFGenerator(model, tokenizer, stop_token_ids(tokenizer, model))
