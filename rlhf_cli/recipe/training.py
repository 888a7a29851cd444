"""The sections of the two TRL-trained stages: `sft` and `reward`."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import (
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_cli.recipe.base import Section, described, near_recipe, resolve_local
from rlhf_cli.recipe.model import LoraSection


class TrainerSection(Section):
    """What the two TRL-trained stages (`sft`, `reward`) share."""

    learning_rate: float = described(2e-4, "AdamW learning rate.", gt=0.0)
    epochs: float = described(1.0, "Passes over the stage's data.", gt=0.0)
    batch_size: int = described(8, "Per-device batch size (examples, or preference pairs).", gt=0)
    gradient_accumulation_steps: int = described(1, "Micro-batches per optimiser step.", gt=0)
    logging_steps: int = described(
        10, "Log training loss every N optimiser steps, and at every checkpoint.", gt=0
    )
    save_steps: int = described(
        500,
        "Write a resumable checkpoint (`<stage>/checkpoints/checkpoint-N`, stage `sft` or "
        "`rm`: weights, optimizer, scheduler, RNG) every N optimiser steps, keeping the newest "
        "two; Ctrl-C and SIGTERM write one too, and `--resume` continues from the newest. 0: "
        "only on Ctrl-C. A completed stage removes them.",
        ge=0,
    )


class SftSection(TrainerSection):
    enabled: bool = described(True, "False when `model.name_or_path` is already instruction-tuned.")
    max_length: int = described(1024, "Truncate tokenised examples to this length.", gt=0)
    warmup_ratio: float = described(0.03, "Share of steps with linear warm-up.", ge=0.0, lt=1.0)
    full_finetune: bool = described(
        False, "Train and save all weights instead of a LoRA adapter (for tiny or small models)."
    )


class RewardFunctionSpec(Section):
    function: str = described(
        ...,
        "`module:callable` (importable, or a `.py` file relative to the recipe) taking "
        "(prompts, responses) and returning one float per response.",
    )
    weight: float = described(1.0, "Multiplies this function's rewards before they are summed.")

    @field_validator("function")
    @classmethod
    def _importable(cls, value: str, info: ValidationInfo) -> str:
        from rlhf_cli.rewards import load_reward_function

        module, sep, name = value.rpartition(":")
        if not sep or not module or not name:
            raise ValueError(f"write it as module:callable, not {value!r}")
        if module.endswith(".py"):
            file = near_recipe(module, info)
            if not file.is_file():
                raise ValueError(f"reward function file not found: {file}")
            value = f"{file.resolve()}:{name}"
        load_reward_function(value)  # a recipe that validates can score
        return value


class RewardSection(TrainerSection):
    pretrained: str | None = described(
        None, "A frozen, already-trained reward model; when set, `train-rm` is skipped."
    )
    base_model: str | None = described(
        None, "Backbone to train with a 1-logit head (`builtin:minilm` ships offline)."
    )
    tokenizer: str | None = described(None, "Reward tokenizer when it differs from the model's.")
    trust_remote_code: bool = described(
        False, "Run modelling code shipped with the reward checkpoint."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = described(
        "auto", "Reward model dtype (`auto` as in `model.dtype`)."
    )
    input: Literal["auto", "pair", "template"] = described(
        "auto",
        "How (prompt, response) reaches the reward model: `pair` tokenises them as a text pair, "
        "`tokenizer(prompt, response)` (what sequence-pair classifiers such as the OpenAssistant "
        "DeBERTa were trained on); `template` tokenises `reward.template`'s one text; `auto` is "
        "`pair` when the reward tokenizer has CLS and SEP tokens (BERT-, DeBERTa-, RoBERTa-like "
        "encoders), else `template`. train-rm and scoring use the same.",
    )
    template: str = described(
        "Human: {prompt}\n\nAssistant: {response}",
        "How (prompt, response) becomes one text: the reward model's input with "
        "`reward.input: template`, and the `query` sent to `reward.url`.",
    )
    max_length: int = described(
        512, "Reward tokenizer max length; longer texts are truncated and counted.", gt=0
    )
    learning_rate: float = described(5e-5, "AdamW learning rate.", gt=0.0)
    lora: LoraSection = described(
        LoraSection(enabled=False), "LoRA for the reward backbone (off: full)."
    )
    score_batch_size: int = described(
        16, "Texts per reward forward pass during PPO and audit.", gt=0
    )
    functions: list[RewardFunctionSpec] = described(
        [],
        "Rule-based rewards added to the reward model's score, each times its weight (TRL's "
        "`reward_funcs`); with no reward model they are the whole reward.",
    )
    url: str | None = described(
        None,
        "A remote reward model over HTTP (OpenRLHF's remote_rm_url protocol: POST "
        "{query, prompts, responses}, read {rewards}); added to the other rewards.",
        pattern=r"^https?://",
    )
    url_timeout: float = described(30.0, "Seconds to wait for each answer of `reward.url`.", gt=0.0)
    url_retries: int = described(2, "Retries of a failed `reward.url` request before exit 2.", ge=0)

    @field_validator("pretrained", "base_model", "tokenizer")
    @classmethod
    def _local_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_local(value, info, "reward model folder")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        literal = "a literal brace is written {{ or }}"
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
        except ValueError as exc:
            raise ValueError(f"{exc} ({literal})") from None
        unknown = sorted({f for f in fields if f not in ("prompt", "response")})
        if unknown:
            raise ValueError(
                f"unknown placeholder {{{unknown[0]}}}: only {{prompt}} and {{response}} are "
                f"filled in ({literal})"
            )
        if "prompt" not in fields or "response" not in fields:
            raise ValueError("must contain both {prompt} and {response}")
        try:
            value.format(prompt="", response="")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{exc} ({literal})") from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> RewardSection:
        if self.pretrained is not None and self.base_model is not None:
            raise ValueError(
                "pretrained: set one of reward.pretrained (a frozen, trained reward model) or "
                "reward.base_model (to run `rlhf train-rm`), not both"
            )
        if self.pretrained is None and self.base_model is None and not self.functions:
            if self.url is None:
                raise ValueError(
                    "pretrained: set reward.pretrained (a frozen, trained reward model), "
                    "reward.base_model (to run `rlhf train-rm`), reward.functions "
                    "(rule-based) or reward.url (remote)"
                )
        return self

    @property
    def has_model(self) -> bool:
        return self.pretrained is not None or self.base_model is not None
