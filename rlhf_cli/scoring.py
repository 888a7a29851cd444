"""Reward scoring of (prompt, response) text, batched, with truncation counted (never silent).

The reward model may have its own tokenizer (DeBERTa beside Mistral in the guide, MiniLM beside
the tiny Llama): scoring always works on decoded text, tokenised as `reward.input` says: the
text pair `tokenizer(prompt, response)` (`pair`), or `reward.template`'s one text (`template`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlhf_cli.generation import position_ids_from
from rlhf_cli.model_checks import check_context, check_vocab
from rlhf_cli.rewards import RewardFn, call_reward_function

Features = dict[str, list[list[int]]]  # `input_ids`, and `token_type_ids` where encoded as pairs


class Scores(NamedTuple):
    """`RewardScorer.scored`'s answer."""

    rewards: torch.Tensor  # (n,) float32, on the CPU
    n_truncated: int  # reward-model inputs cut to `max_length`
    metrics: dict[str, float]  # what the reward functions counted, `reward/<name>`


def completion_ids(answers: Any) -> list[list[int]]:
    """Each response's token ids, its padding left out (`Generations`' `response_ids` under
    `response_mask`): the reward functions' `completion_ids`, as TRL gives them."""
    return [
        ids[mask].tolist()
        for ids, mask in zip(answers.response_ids, answers.response_mask.bool(), strict=True)
    ]


def pair_input(tokenizer: Any) -> str:
    """`reward.input: auto`'s choice for this reward tokenizer: `pair` when it has both a CLS and
    a SEP token, the mark of an encoder that reads text pairs as `[CLS] a [SEP] b [SEP]` (BERT,
    DeBERTa, RoBERTa, ELECTRA; the guide's OpenAssistant reward model), else `template` (decoders
    such as Llama, Mistral, Qwen or GPT-2 have no SEP token and read one text)."""
    if tokenizer is not None and tokenizer.cls_token is not None:
        if tokenizer.sep_token is not None:
            return "pair"
    return "template"


@dataclass
class RewardScorer:
    """The reward: the reward model's score of each text (when there is a model) plus each
    rule-based function's reward times its weight (`functions`: (spec, callable, weight)).
    `input` is `pair`, `template` or `auto` (resolved once, by `pair_input`)."""

    model: Any
    tokenizer: Any
    template: str
    max_length: int
    batch_size: int = 16
    functions: list[tuple[str, RewardFn, float]] = field(default_factory=list)
    input: str = "template"

    def __post_init__(self) -> None:
        """Resolve `input: auto`, refuse a `reward.max_length` over the model's context or a
        tokenizer with ids past its embeddings (`modeling.check_context`, `check_vocab`), and
        make the model pad with the tokenizer's pad id, once, for every path that scores.

        A decoder's sequence-classification head (transformers' `*ForSequenceClassification`)
        scores the last token that is not `config.pad_token_id`, whatever the attention mask
        says; a pretrained reward model keeps its own pad id (or EOS), so padding with another id
        would score a pad token. A tokenizer without a pad token is given its EOS token as pad
        (as `modeling.load_tokenizer` does); one with neither is refused.
        """
        if self.input == "auto":
            self.input = pair_input(self.tokenizer)
        if self.tokenizer is None:
            return
        if self.model is not None:  # the recipe's values the model would refuse mid-run
            check_context(self.model, {"reward.max_length": self.max_length}, "the reward model")
            check_vocab(self.model, self.tokenizer, "reward.tokenizer", "the reward model")
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

    def encode(self, prompts: list[str], responses: list[str]) -> tuple[Features, int]:
        """Each pair's tokens within `max_length`, and how many pairs were longer and cut. A pair
        that fits is tokenised as it is: `tokenizer(prompt, response)` with `input: pair` (its
        `input_ids`, and its `token_type_ids` where the tokenizer gives them), the template's
        text with `input: template` (`input_ids` alone); one that does not fit keeps its whole
        response and loses the start of its prompt (see `_fit`)."""
        pairs = list(zip(prompts, responses, strict=True))
        if not pairs:  # fast tokenizers raise on an empty batch
            return {"input_ids": []}, 0
        if self.input == "pair":
            features = self._tokenize(prompts, responses)
        else:
            features = self._tokenize(self.texts(prompts, responses))
        n_truncated = 0
        for i, (prompt, response) in enumerate(pairs):
            if len(features["input_ids"][i]) > self.max_length:
                for key, value in self._fit(prompt, response).items():
                    features[key][i] = value
                n_truncated += 1
        return features, n_truncated

    def _fit(self, prompt: str, response: str) -> dict[str, list[int]]:
        """Tokens of a pair too long for `max_length`, cut to fit: the prompt loses its start (its
        end, next to the response, stays) so that the whole response survives. Where the
        response is too long even with an empty prompt, the prompt goes and the response loses
        its start instead: its end (whether it finished, its conclusion) and the template (or
        the pair's special tokens) stay. Only a template longer than `max_length` by itself is
        cut by the tokenizer (on its `truncation_side`)."""
        ids = self._longest_end(prompt, lambda s: self._one(s, response))
        if ids is None:
            ids = self._longest_end(response, lambda s: self._one("", s))
        if ids is None:
            ids = self._one("", "", truncation=True, max_length=self.max_length)
        return ids

    def _longest_end(
        self, piece: str, fill: Callable[[str], dict[str, list[int]]]
    ) -> dict[str, list[int]] | None:
        """Tokens of `fill(end of piece)` for the longest end of `piece` (cut where one of its
        tokens starts; whitespace at the cut dropped) whose whole input fits `max_length`, or
        None when even `fill("")` does not. A binary search, each candidate checked on the whole
        input's tokens (pieces tokenised apart can differ at the seams); the whole piece is known
        not to fit."""
        best = fill("")
        if len(best["input_ids"]) > self.max_length:
            return None
        starts = self._token_starts(piece)  # starts[-1] == len(piece), the empty end, fits
        lo, hi = -1, len(starts) - 1  # -1: the whole piece, too long
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ids = fill(piece[starts[mid] :].lstrip())
            if len(ids["input_ids"]) <= self.max_length:
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

    def _one(self, prompt: str, response: str, **truncation: Any) -> dict[str, list[int]]:
        """One pair's tokens, as `encode` tokenises a pair that fits."""
        if self.input == "pair":
            return self._tokenize(prompt, response, **truncation)
        return self._tokenize(self.template.format(prompt=prompt, response=response), **truncation)

    def _tokenize(self, *texts: Any, truncation: bool = False, **kwargs: Any) -> dict[str, Any]:
        """The tokenizer's `input_ids` of `texts` (one text, a text pair, or batches of either),
        with its `token_type_ids` too when it gives them for pairs (`input: pair`)."""
        out = self.tokenizer(*texts, truncation=truncation, add_special_tokens=True, **kwargs)
        keys = ("input_ids", "token_type_ids") if self.input == "pair" else ("input_ids",)
        return {key: out[key] for key in keys if key in out}

    def score(
        self, prompts: list[str], responses: list[str], keywords: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, int]:
        """Rewards (n,) float32 on the CPU, and the number of truncated reward-model inputs;
        `keywords` as `scored` takes them."""
        scores = self.scored(prompts, responses, keywords)
        return scores.rewards, scores.n_truncated

    @torch.inference_mode()
    def scored(
        self, prompts: list[str], responses: list[str], keywords: dict[str, Any] | None = None
    ) -> Scores:
        """Rewards (n,) float32 on the CPU, the number of truncated reward-model inputs, and
        what the reward functions counted (`reward/no_answer_rate`, ...). `keywords` go to the
        functions that accept them (rewards.py): the rows' extra columns, `completion_ids` and
        `step`."""
        if self.model is None:
            total, n_truncated = torch.zeros(len(responses)), 0
        else:
            total, n_truncated = self.model_scores(prompts, responses)
        metrics: dict[str, float] = {}
        for spec, fn, weight in self.functions:
            rewards, counted = call_reward_function(spec, fn, prompts, responses, keywords)
            total = total + weight * rewards
            metrics.update({f"reward/{key}": value for key, value in counted.items()})
        return Scores(total, n_truncated, metrics)

    def model_scores(self, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, int]:
        """The reward model's scores (n,) float32 on the CPU, and the number of truncated inputs.

        Left-padded batches also get positions counted over real tokens (where the model's
        forward takes `position_ids`), so a model with absolute positions scores a text the same
        padded or alone. Right-padded batches keep the model's own positions (an encoder such as
        RoBERTa numbers its positions from an offset)."""
        features, n_truncated = self.encode(prompts, responses)
        device = next(self.model.parameters()).device
        positions = self.tokenizer.padding_side == "left" and (
            "position_ids" in inspect.signature(self.model.forward).parameters
        )
        scores = []
        for start in range(0, len(features["input_ids"]), self.batch_size):
            rows = {key: value[start : start + self.batch_size] for key, value in features.items()}
            batch = self.tokenizer.pad(rows, return_tensors="pt").to(device)
            if positions:
                batch["position_ids"] = position_ids_from(batch["attention_mask"])
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return (torch.cat(scores) if scores else torch.zeros(0)), n_truncated
