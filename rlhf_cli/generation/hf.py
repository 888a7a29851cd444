"""The transformers backend: `generate` on the model itself, left-padded batches with the KV
cache, the sampler built from the recipe alone, each row's draws from its own seed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlhf_cli.generation.core import (
    Generations,
    PolicyVersion,
    decode,
    left_pad,
    response_mask_from,
    sampling_warpers,
)
from rlhf_cli.recipe import GenerationSection


def generation_config(
    gen: GenerationSection, stop_ids: list[int], pad_id: int, greedy: bool = False
) -> Any:
    """A complete `GenerationConfig` from the recipe. Sampling itself (temperature, top-k,
    top-p) is left neutral here and done by `sampling_warpers`, so the processors that run are
    exactly the ones `response_logprobs` reproduces. `greedy`: argmax decoding even when the
    recipe samples (the draw is then made by `SeededGumbel`). Top-k is 0 (off) when sampling,
    unset otherwise (transformers warns about a sampling flag set for argmax decoding)."""
    sample = gen.do_sample and not greedy
    return GenerationConfig(
        max_new_tokens=gen.max_new_tokens,
        do_sample=sample,
        num_beams=1,
        temperature=1.0,
        top_k=0 if sample else None,
        top_p=1.0,
        typical_p=1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_length=0,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=False,
    )


@contextlib.contextmanager
def checkpoint_settings_off(model: Any) -> Iterator[None]:
    """`generate` fills every setting the call leaves unset from the model's own
    `generation_config` (the checkpoint's `generation_config.json`); a blank one stands in for
    it while we sample, so nothing but the recipe shapes the samples."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved


class SampledLogprobs(LogitsProcessor):
    """Last in the sampler's list: keeps the log-softmax of each step's processed scores and,
    when the next step shows which token was drawn, that token's log-prob."""

    def __init__(self) -> None:
        self.pending: Tensor | None = None
        self.steps: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, tokens[:, None]).squeeze(1))
            self.pending = None

    def result(self, last_tokens: Tensor) -> Tensor:
        """(b, steps): the log-prob of every generated token under the scores it came from."""
        self._take(last_tokens)
        return torch.stack(self.steps, dim=1)


# splitmix64's constants as signed 64-bit integers (torch has no uint64 arithmetic)
_GOLDEN, _MIX1, _MIX2 = (
    c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    """Steele et al.'s splitmix64 finaliser: a well-mixed 64-bit hash (int64 wraps around)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def hashed_uniform(seeds: Tensor, step: int, vocab: int) -> Tensor:
    """(b, vocab) uniforms in (0, 1), a pure function of (row seed, step, token id): the same
    numbers on any device, in any batch, on any process."""
    row = _splitmix64(seeds.long() * 1_000_003 + step)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    bits = _shift_right(_splitmix64(row[:, None] * 65_537 + tokens), 11)  # 53 random bits
    return (bits.double() + 0.5) / 2.0**53


class SeededGumbel(LogitsProcessor):
    """Last in the list when each row has its own seed: adds Gumbel noise
    -log(-log U), U = `hashed_uniform(seed, step, token)`, to the warped scores, so that taking
    the argmax (greedy decoding) draws from their softmax (the Gumbel-max trick). A row's tokens
    then depend on its seed alone, not on the rows it is batched with, the padding or the
    process it runs in: one and N processes sample the same responses."""

    def __init__(self, seeds: Tensor) -> None:
        self.seeds, self.step = seeds, 0

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        uniform = hashed_uniform(self.seeds, self.step, scores.shape[1])
        self.step += 1
        return scores.float() - torch.log(-torch.log(uniform)).float()


@dataclass
class OneVersion:
    """The policy an engine that holds one set of weights answers as (`HFGenerator`, the
    colocated vLLM engine): the handle of its last `sync`. A call naming an older handle is
    refused: it would get another policy's answers."""

    synced: int = 0
    held: PolicyVersion | None = None  # None: the model the engine was built from

    def publish(self) -> PolicyVersion:
        """The handle of the policy the engine was just given."""
        self.synced += 1
        self.held = PolicyVersion(f"v{self.synced}")
        return self.held

    def check(self, asked: PolicyVersion | None) -> None:
        """Refuse a call for a policy the engine no longer holds (a caller's bug)."""
        if asked is not None and asked != self.held:
            holds = self.held.name if self.held else "the model it was built from"
            raise RuntimeError(
                f"a generate call names policy {asked.name}, but the engine holds {holds}: "
                "another caller synced it since"
            )


@dataclass
class HFGenerator:
    """transformers `generate`: left-padded batches with the KV cache."""

    model: Any
    tokenizer: Any
    stop_ids: list[int]
    versions: OneVersion = field(default_factory=OneVersion)

    def sync(self, model: Any) -> PolicyVersion:
        """`generate` runs `model` itself from now on."""
        self.model = model
        return self.versions.publish()

    @torch.inference_mode()
    def generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None = None,
        policy: PolicyVersion | None = None,
    ) -> Generations:
        """Answers to `queries` by `policy` (refused unless it is the last synced); responses
        trimmed to the longest, pads after each stop. With `seeds` (one per query) each row
        samples from its own seed (`SeededGumbel`)."""
        self.versions.check(policy)
        pad_id = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        query_ids, query_mask = left_pad(queries, pad_id, device)
        recorder = SampledLogprobs()
        processors = LogitsProcessorList([*sampling_warpers(gen), recorder])
        seeded = gen.do_sample and seeds is not None
        if seeded:
            processors.append(SeededGumbel(torch.tensor(seeds, device=device)))
        with checkpoint_settings_off(self.model):
            output = self.model.generate(
                input_ids=query_ids,
                attention_mask=query_mask,
                generation_config=generation_config(gen, self.stop_ids, pad_id, greedy=seeded),
                logits_processor=processors,
                # the weights are whole here (sharded engines gather them first), so processes
                # need not step together: transformers' default under ZeRO-3 / FSDP steps every
                # process until the longest generation ends
                synced_gpus=False,
            )
        response_ids = output[:, query_ids.shape[1] :]
        sampler_logprobs = recorder.result(response_ids[:, -1])
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
            sampler_logprobs[:, :width],
        )
