"""The generation interface every backend implements (`Generator`, returning `Generations`),
and what every backend and caller shares: padding, stop tokens, response
masks, decoding, and the log-probs of what was sampled.

The facts that make sampled tokens and their log-probs agree live here too, so that every
forward pass scores a token under the distribution it was drawn from:
- the sampler is built from the recipe alone (`generation_config` plus `sampling_warpers`):
  nothing in the checkpoint's `generation_config.json` (a `repetition_penalty`, `top_k: 50`, bad
  words) shapes the samples;
- log-probs apply the sampler's own warpers (temperature, top-k, top-p, transformers' classes)
  to the training forward's logits, so the ratio, the KL and the loss see the truncated
  distribution that was sampled; the sampled token is always kept in the support, so a later
  policy whose nucleus moved still gives it a finite log-prob (PPO's `logprob_support: full`
  asks for the temperature-only distribution instead);
- the backend records each sampled token's log-prob under the processed scores it was drawn
  from (`Generations.sampler_logprobs`), so PPO can log the largest disagreement with the
  training forward (`rollout/logprob_mismatch`);
- positions count real tokens only, exactly as `generate()` numbers left-padded rows;
- response masks come from generated lengths (first stop token, included), never from
  `== pad_token_id`, so a real EOS survives when pad equals EOS (Huang et al. 2023).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.utils.checkpoint
from torch import Tensor
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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
    sampler_logprobs: Tensor | None  # (b, r) each token's log-prob as the sampler drew it

    @property
    def input_ids(self) -> Tensor:
        """(b, p + r) query and response, as one forward pass sees them."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(b, p + r)."""
        return torch.cat([self.query_mask, self.response_mask.long()], dim=1)

    def to(self, device: torch.device) -> Generations:
        """The same answers with every tensor on `device`."""
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, Tensor)}
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True)
class PolicyVersion:
    """A handle on one policy an engine was given (`Generator.sync`), never reused: the calls
    that name it are answered by exactly those weights, or refused."""

    name: str  # unique within its engine
    adapter: str | None = None  # the LoRA adapter the servers answer as (None: their base)


class Generator(Protocol):
    """What every generation backend offers its callers. Which policy answers is explicit:
    `sync` hands the engine a policy and returns its handle, and a `generate` call names the
    handle it is to be answered by; an engine that no longer holds it refuses the call rather
    than answer as another policy. An engine holds the policy of its last `sync`; the servers'
    client also keeps older ones while a call made later (`pinned`) names them."""

    stop_ids: list[int]

    def generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None = None,
        policy: PolicyVersion | None = None,
    ) -> Generations:
        """Answers to `queries` (token ids of each prompt) sampled with `gen` by `policy` (by
        default the last synced, or the model the engine was built from); with `seeds`, each
        row's draws come from its own seed, whatever else is in the batch."""
        ...

    def sync(self, model: Any) -> PolicyVersion:
        """Give the engine `model` as it is now, under a new handle: the live policy's current
        weights before each rollout, or the reference (the policy with its adapter disabled,
        or a frozen copy of the same architecture) for the audit's comparison."""
        ...


def row_seed(seed: int, round_: int, row: int) -> int:
    """The sampling seed of row `row` of a round's batch (the backends hash it further): the
    same whichever process or batch generates the row. PPO's rollouts are rounds 1, 2, ... (the
    iteration); the audit and compare sample round 0, the same draws each time they run."""
    return ((seed * 1_000_003 + round_) * 65_537 + row) % 2**63


# ── prompts in, token tensors out ───────────────────────────────────────────────────────────────


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


def generations_from(
    tokenizer: Any,
    stop_ids: list[int],
    queries: list[list[int]],
    tokens: list[list[int]],
    logprobs: list[list[float]],
) -> Generations:
    """An engine's answers as `Generations` on the CPU: each row's drawn `tokens` and their
    sampler log-probs (`logprobs`, one per token), padded after each response's first stop
    token; the queries left-padded."""
    pad_id = tokenizer.pad_token_id
    query_ids, query_mask = left_pad(queries, pad_id, torch.device("cpu"))
    tokens = [ids or [pad_id] for ids in tokens]
    width = max(len(t) for t in tokens)
    response_ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    sampler = torch.zeros(len(tokens), width)
    for row, (ids, drawn) in enumerate(zip(tokens, logprobs, strict=True)):
        response_ids[row, : len(ids)] = torch.tensor(ids)
        sampler[row, : len(drawn)] = torch.tensor(drawn, dtype=torch.float32)
    response_mask, ended = response_mask_from(response_ids, stop_ids)
    response_ids = torch.where(response_mask, response_ids, pad_id)
    texts = decode(tokenizer, response_ids, response_mask)
    return Generations(query_ids, query_mask, response_ids, response_mask, ended, texts, sampler)


# ── the distribution the tokens were drawn from ─────────────────────────────────────────────────


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only: left-padded rows start at 0 on their first token,
    exactly as `generate()` numbers them, so every forward pass sees generation's positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0
) -> Tensor:
    """Logits (b, t, vocab) of a causal LM at generation's positions, without a KV cache; with
    `logits_to_keep` only the last that many positions (b, logits_to_keep, vocab)."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        use_cache=False,
        logits_to_keep=logits_to_keep,
    ).logits


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability (b, t) of ``labels`` (b, t) under ``log_softmax(logits)`` (b, t, vocab).
    [TRL ``logprobs_from_logits``]"""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def score_temperature(gen: GenerationSection) -> float:
    """The temperature the sampler divided the logits by (1 for greedy decoding)."""
    return gen.temperature if gen.do_sample else 1.0


def sampling_warpers(gen: GenerationSection) -> Any:
    """The sampler's logits warpers (transformers' own classes, in `generate`'s order:
    temperature, top-k, top-p); empty for greedy decoding."""
    warpers = LogitsProcessorList()
    if not gen.do_sample:
        return warpers
    if gen.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(gen.temperature))
    if gen.top_k:
        warpers.append(TopKLogitsWarper(top_k=gen.top_k))
    if gen.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=gen.top_p))
    return warpers


LOGPROB_CHUNK_ROWS = 128  # token positions per chunk of the warped log-softmax


def response_logprobs(
    logits: Tensor,
    response_ids: Tensor,
    gen: GenerationSection,
    support: Literal["sampled", "full"] = "sampled",
) -> Tensor:
    """Log-probs (b, r) of the response tokens under the distribution the sampler drew them
    from (`support="sampled"`), or under the temperature-scaled softmax over the whole
    vocabulary (`"full"`: top-k and top-p ignored, TRL's choice).

    logits (b, r, vocab) are the ones predicting each response token (`response_logits`). The
    sampler's warpers decide, without gradient, which tokens each row keeps (the sampled token
    is put back if they cut it: a policy that moved since sampling keeps a finite log-prob);
    the log-softmax then runs over the kept tokens. The work runs in chunks of
    `LOGPROB_CHUNK_ROWS` positions; with autograd on, each chunk's masked log-softmax is
    recomputed in the backward pass instead of keeping its fp32 copies alive.
    """
    b, r, vocab = logits.shape
    flat_logits, flat_ids = logits.reshape(-1, vocab), response_ids.reshape(-1)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    temperature, chunks = score_temperature(gen), []
    for start in range(0, flat_ids.numel(), LOGPROB_CHUNK_ROWS):
        rows, ids = (
            flat_logits[start : start + LOGPROB_CHUNK_ROWS],
            flat_ids[start : start + LOGPROB_CHUNK_ROWS],
        )
        keep = sampler_support(rows, ids, gen) if support == "sampled" else None
        if recompute:
            chunks.append(torch.utils.checkpoint.checkpoint(
                _kept_logprobs, rows, ids, keep, temperature, use_reentrant=False
            ))  # fmt: skip
        else:
            chunks.append(_kept_logprobs(rows, ids, keep, temperature))
    return torch.cat(chunks).view(b, r) if chunks else logits.new_zeros(b, r).float()


@torch.no_grad()
def sampler_support(logits: Tensor, token_ids: Tensor, gen: GenerationSection) -> Tensor | None:
    """(n, vocab) bool: the tokens the sampler's warpers keep for each row of `logits`
    (n, vocab), plus the row's own token (n,); None when nothing is cut (temperature only)."""
    warpers = sampling_warpers(gen)  # temperature first: top-p's nucleus depends on it
    if all(isinstance(w, TemperatureLogitsWarper) for w in warpers):
        return None
    processed = warpers(None, logits.float())
    return (processed != float("-inf")).scatter(1, token_ids[:, None], True)


def _kept_logprobs(
    logits: Tensor, token_ids: Tensor, keep: Tensor | None, temperature: float
) -> Tensor:
    """(n,) log-probs of `token_ids` under the softmax of `logits / temperature` over `keep`."""
    scaled = logits.float() / temperature
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return logprobs_from_logits(scaled, token_ids)


def response_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor, response_width: int
) -> Tensor:
    """Logits (b, r, vocab) that predict the last `response_width` tokens of `input_ids`, from a
    forward that only materialises those positions (`logits_to_keep`)."""
    logits = forward_logits(model, input_ids, attention_mask, logits_to_keep=response_width + 1)
    return logits[:, :-1]
