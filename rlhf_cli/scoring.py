"""Reward scoring of (prompt, response) text, batched, with truncation counted (never silent).

The reward model may have its own tokenizer (DeBERTa beside Mistral in the guide, MiniLM beside
the tiny Llama): scoring always works on decoded text run through `reward.template`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RewardScorer:
    model: Any
    tokenizer: Any
    template: str
    max_length: int
    batch_size: int = 16

    def texts(self, prompts: list[str], responses: list[str]) -> list[str]:
        return [
            self.template.format(prompt=p, response=r)
            for p, r in zip(prompts, responses, strict=True)
        ]

    def encode(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Token ids truncated to `max_length`, and how many texts were truncated."""
        if not texts:  # fast tokenizers raise on an empty batch
            return [], 0
        ids = self.tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]
        n_truncated = sum(len(x) > self.max_length for x in ids)
        return self.tokenizer(texts, truncation=True, max_length=self.max_length)[
            "input_ids"
        ], n_truncated

    @torch.inference_mode()
    def score(self, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, int]:
        """Scores (n,) float32 on the CPU, and the number of truncated inputs."""
        ids, n_truncated = self.encode(self.texts(prompts, responses))
        device = next(self.model.parameters()).device
        scores = []
        for start in range(0, len(ids), self.batch_size):
            batch = self.tokenizer.pad(
                {"input_ids": ids[start : start + self.batch_size]}, return_tensors="pt"
            ).to(device)
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return (torch.cat(scores) if scores else torch.zeros(0)), n_truncated
