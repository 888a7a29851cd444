"""Reward scoring of (prompt, response) text, batched, with truncation counted (never silent).

The reward model may have its own tokenizer (DeBERTa beside Mistral in the guide, MiniLM beside
the tiny Llama): scoring always works on decoded text run through `reward.template`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_cli.generation import position_ids_from
from rlhf_cli.rewards import RewardFn, call_reward_function


@dataclass
class RewardScorer:
    """The reward: the reward model's score of each text (when there is a model) plus each
    rule-based function's reward times its weight (`functions`: (spec, callable, weight))."""

    model: Any
    tokenizer: Any
    template: str
    max_length: int
    batch_size: int = 16
    functions: list[tuple[str, RewardFn, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Make the model pad with the tokenizer's pad id, once, for every path that scores.

        A decoder's sequence-classification head (transformers' `*ForSequenceClassification`)
        scores the last token that is not `config.pad_token_id`, whatever the attention mask
        says; a pretrained reward model keeps its own pad id (or EOS), so padding with another id
        would score a pad token. A tokenizer without a pad token is given its EOS token as pad
        (as `modeling.load_tokenizer` does); one with neither is refused.
        """
        if self.tokenizer is None:
            return
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError("the reward tokenizer has neither a pad nor an EOS token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config = getattr(self.model, "config", None)
        if config is not None:
            config.pad_token_id = self.tokenizer.pad_token_id
            if hasattr(config, "get_text_config"):  # the head reads the text config's pad id
                config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    def texts(self, prompts: list[str], responses: list[str]) -> list[str]:
        return [
            self.template.format(prompt=p, response=r)
            for p, r in zip(prompts, responses, strict=True)
        ]

    def encode(self, prompts: list[str], responses: list[str]) -> tuple[list[list[int]], int]:
        """Token ids of each pair's template text within `max_length`, and how many texts were
        longer and cut. A text that fits is tokenised as it is; one that does not keeps its whole
        response and loses the start of its prompt (see `_fit`)."""
        texts = self.texts(prompts, responses)
        if not texts:  # fast tokenizers raise on an empty batch
            return [], 0
        ids = self.tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]
        n_truncated = 0
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            if len(ids[i]) > self.max_length:
                ids[i] = self._fit(prompt, response)
                n_truncated += 1
        return ids, n_truncated

    def _fit(self, prompt: str, response: str) -> list[int]:
        """Ids of a pair too long for `max_length`, cut to fit: the prompt loses its start (its
        end, next to the response, stays) so that the whole response survives. Where the
        response with the template's own text is too long alone, the prompt goes and the
        response loses its start instead: its end (whether it finished, its conclusion) and the
        template stay. Only a template longer than `max_length` by itself is cut by the
        tokenizer (on its `truncation_side`)."""
        ids = self._longest_end(prompt, lambda s: self.template.format(prompt=s, response=response))
        if ids is None:
            ids = self._longest_end(response, lambda s: self.template.format(prompt="", response=s))
        if ids is None:
            text = self.template.format(prompt="", response="")
            ids = self.tokenizer(text, truncation=True, max_length=self.max_length)["input_ids"]
        return ids

    def _longest_end(self, piece: str, fill: Callable[[str], str]) -> list[int] | None:
        """Ids of `fill(end of piece)` for the longest end of `piece` (cut where one of its
        tokens starts; whitespace at the cut dropped) whose whole text fits `max_length`, or None
        when even `fill("")` does not. A binary search, each candidate checked on the whole
        text's tokens (pieces tokenised apart can differ at the seams); the whole piece is known
        not to fit."""
        best = self._ids(fill(""))
        if len(best) > self.max_length:
            return None
        starts = self._token_starts(piece)  # starts[-1] == len(piece), the empty end, fits
        lo, hi = -1, len(starts) - 1  # -1: the whole piece, too long
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ids = self._ids(fill(piece[starts[mid] :].lstrip()))
            if len(ids) <= self.max_length:
                hi, best = mid, ids
            else:
                lo = mid
        return best

    def _token_starts(self, piece: str) -> Sequence[int]:
        """Where `piece` may be cut, ascending, after 0 and ending with `len(piece)`: where its
        tokens start (fast tokenizers give offsets), else at every character."""
        if not getattr(self.tokenizer, "is_fast", False):
            return range(1, len(piece) + 1)
        offsets = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        starts = {start for start, _ in offsets["offset_mapping"] if 0 < start < len(piece)}
        return [*sorted(starts), len(piece)]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, truncation=False, add_special_tokens=True)["input_ids"]

    @torch.inference_mode()
    def score(self, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, int]:
        """Rewards (n,) float32 on the CPU, and the number of truncated reward-model inputs."""
        if self.model is None:
            total, n_truncated = torch.zeros(len(responses)), 0
        else:
            total, n_truncated = self.model_scores(prompts, responses)
        for spec, fn, weight in self.functions:
            total = total + weight * call_reward_function(spec, fn, prompts, responses)
        return total, n_truncated

    def model_scores(self, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, int]:
        """The reward model's scores (n,) float32 on the CPU, and the number of truncated inputs.

        Left-padded batches also get positions counted over real tokens (where the model's
        forward takes `position_ids`), so a model with absolute positions scores a text the same
        padded or alone. Right-padded batches keep the model's own positions (an encoder such as
        RoBERTa numbers its positions from an offset)."""
        ids, n_truncated = self.encode(prompts, responses)
        device = next(self.model.parameters()).device
        positions = self.tokenizer.padding_side == "left" and (
            "position_ids" in inspect.signature(self.model.forward).parameters
        )
        scores = []
        for start in range(0, len(ids), self.batch_size):
            batch = self.tokenizer.pad(
                {"input_ids": ids[start : start + self.batch_size]}, return_tensors="pt"
            ).to(device)
            if positions:
                batch["position_ids"] = position_ids_from(batch["attention_mask"])
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return (torch.cat(scores) if scores else torch.zeros(0)), n_truncated
