"""The sections of the two TRL-trained stages, `sft` and `reward`, and `audit.judge`: a second
reward, built as `reward` is, that the policy never trains against."""

from __future__ import annotations

import string
from typing import Any, Literal

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
        "Write a resumable checkpoint (`<stage>/checkpoints/checkpoint-N`, stage `sft`, `rm`, "
        "`dpo`, `kto`, `orpo` or `simpo`: weights, optimizer, scheduler, RNG) every N optimiser "
        "steps, keeping the newest two; Ctrl-C and SIGTERM write one too, and `--resume` "
        "continues from the newest. 0: only on Ctrl-C. A completed stage removes them.",
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
        "(prompts, responses) and returning one float per response; keyword arguments it "
        "accepts get each extra column of the prompt data (`solution`, ...: a list, one value "
        "per response), `completion_ids` and `step` (TRL's convention). Or a built-in: "
        "`builtin:math_accuracy`, `builtin:think_format`, `builtin:overlong` (docs/rewards.md).",
    )
    weight: float = described(1.0, "Multiplies this function's rewards before they are summed.")
    options: dict[str, Any] = described(
        {},
        "Keyword arguments bound to the function: `{marker: '####'}` for "
        "`builtin:math_accuracy`, `{max_length: 256, cache: 64}` for `builtin:overlong`.",
    )

    @field_validator("function")
    @classmethod
    def _importable(cls, value: str, info: ValidationInfo) -> str:
        from rlhf_cli.rewards import named_function

        module, sep, name = value.rpartition(":")
        if not sep or not module or not name:
            raise ValueError(f"write it as module:callable, not {value!r}")
        if module.endswith(".py"):
            file = near_recipe(module, info)
            if not file.is_file():
                raise ValueError(f"reward function file not found: {file}")
            value = f"{file.resolve()}:{name}"
        named_function(value)  # a recipe that validates can score
        return value

    @model_validator(mode="after")
    def _options(self) -> RewardFunctionSpec:
        self.load()  # the options are the function's
        return self

    def load(self) -> Any:
        """The callable, its options bound."""
        from rlhf_cli.rewards import load_reward_function

        return load_reward_function(self.function, self.options)


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
    judge_fraction: float = described(
        0.0,
        "Share of the training pairs' prompts (drawn with `run.seed`) that `train-rm` keeps from "
        "the reward model to train a second one on, with the same settings: the judge "
        "(`rm/judge/`, `audit.judge.from_rm`). The two share no prompt; 0: no judge.",
        ge=0.0,
        le=0.5,
    )

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

    @model_validator(mode="after")
    def _judge_is_trained(self) -> RewardSection:
        if self.judge_fraction > 0 and self.base_model is None:
            raise ValueError(
                "judge_fraction: the judge is trained by `rlhf train-rm`, which needs "
                "reward.base_model; with reward.pretrained give the judge as "
                "audit.judge.pretrained instead"
            )
        return self

    @property
    def has_model(self) -> bool:
        return self.pretrained is not None or self.base_model is not None


class JudgeSection(Section):
    """`audit.judge`: a second reward the policy never trains against, scored at every held-out
    evaluation and by `rlhf audit` beside the proxy (`reward`). Its model, when it has one, reads
    (prompt, response) with `reward`'s template, max_length, dtype and batch size."""

    pretrained: str | None = described(
        None, "Any sequence-classification reward model (a folder or hub id) as the judge."
    )
    tokenizer: str | None = described(
        None, "The judge model's tokenizer when it differs from the model's (with `pretrained`)."
    )
    from_rm: bool = described(
        False,
        "The judge is the reward model `rlhf train-rm` trained on the `reward.judge_fraction` "
        "of the preference prompts that the proxy never saw (`rm/judge/`).",
    )
    input: Literal["auto", "pair", "template"] | None = described(
        None,
        "How the judge model reads (prompt, response), as in `reward.input`; unset: "
        "`reward.input` (a `from_rm` judge always reads what it was trained on).",
    )
    functions: list[RewardFunctionSpec] = described(
        [],
        "Rule-based rewards added to the judge model's score, each times its weight (as "
        "`reward.functions`); with no judge model they are the whole judge.",
    )
    window: int = described(
        3,
        "K: `overoptimization` is flagged when over the last K held-out evaluations the proxy's "
        "reward rose while the judge's fell.",
        ge=2,
    )
    margin: float = described(
        0.1,
        "How much each must move over those K evaluations (the least-squares line's change), "
        "in units of the std of its scores of the reference's held-out answers, to count as a "
        "rise or a fall; the judge's fall must also pass twice its standard error (the "
        "held-out answers' spread over the root of their number).",
        ge=0.0,
    )

    @field_validator("pretrained", "tokenizer")
    @classmethod
    def _local_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_local(value, info, "judge model folder")

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeSection:
        if self.pretrained is not None and self.from_rm:
            raise ValueError(
                "from_rm: set one of audit.judge.pretrained (a reward model) or "
                "audit.judge.from_rm (train-rm's judge), not both"
            )
        if self.pretrained is None and not self.from_rm and not self.functions:
            raise ValueError(
                "pretrained: the judge needs audit.judge.pretrained (a reward model), "
                "audit.judge.from_rm: true (train-rm's, with reward.judge_fraction) or "
                "audit.judge.functions (rule-based)"
            )
        if self.from_rm and (self.input is not None or self.tokenizer is not None):
            raise ValueError(
                "from_rm: train-rm's judge reads what it was trained on with its own tokenizer: "
                "drop audit.judge.input and audit.judge.tokenizer"
            )
        return self
