"""The sections `audit`, `merge`, `push`, and the whole `Recipe` with its cross-section rules."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_cli.guide import GUIDE_AUDIT_PROMPTS, GUIDE_SYCOPHANTIC_OPENERS
from rlhf_cli.recipe.base import Section, described, resolve_local
from rlhf_cli.recipe.data import DataSection
from rlhf_cli.recipe.dpo import DpoSection, KtoSection, OrpoSection, SimpoSection
from rlhf_cli.recipe.eval import EvalSection
from rlhf_cli.recipe.model import ModelSection, RunSection
from rlhf_cli.recipe.names import VLLM_BACKENDS
from rlhf_cli.recipe.ppo import GenerationSection, PpoSection
from rlhf_cli.recipe.training import JudgeSection, RewardSection, SftSection


class AuditSection(Section):
    prompts: list[str] = described(list(GUIDE_AUDIT_PROMPTS), "Audit prompts (the guide's five).")
    prompts_file: str | None = described(
        None, "A text file with one prompt a line, instead of `prompts`."
    )
    samples: int = described(1, "Responses sampled per prompt.", gt=0)
    every: int | None = described(
        None, "Audit the live policy every N PPO iterations (guide: 50).", gt=0
    )
    kl_coef_step: float = described(
        0.05,
        "Raise β by this much when an in-training audit flags (`on_hacking: raise_beta`).",
        ge=0.0,
    )
    on_hacking: Literal["raise_beta", "rollback", "stop"] = described(
        "raise_beta",
        "What an in-training flag does (the guide's detectors at `every`, overoptimization at a "
        "held-out evaluation): raise β by `kl_coef_step`; `rollback` to the newest checkpoint "
        "written before the flag (weights, optimiser, β, RNG) with β × `rollback_kl_factor` and "
        "the learning rate × `rollback_lr_factor`, at most `max_rollbacks` times, then stop; "
        "`stop`: checkpoint and exit 1 naming the best checkpoint.",
    )
    rollback_to: Literal["newest", "best"] = described(
        "newest",
        "The checkpoint a rollback restores: the newest written before the flag, or the best "
        "one before it (the highest judge reward, else held-out reward: `checkpoints/best.json`; "
        "the newest when none is kept). A flag over K evaluations comes after the judge has "
        "fallen for a while, so the newest can hold hacked weights already.",
    )
    rollback_kl_factor: float = described(
        2.0, "β in force at a flag is multiplied by this at its rollback (compounding).", ge=1.0
    )
    rollback_lr_factor: float = described(
        0.5,
        "The learning rate in force at a flag is multiplied by this at its rollback (compounding).",
        gt=0.0,
        le=1.0,
    )
    max_rollbacks: int = described(
        3, "Rollbacks before a further flag stops the run (exit 1).", ge=0
    )
    verbosity_words: int = described(200, "A response over this many words is verbose.", gt=0)
    verbosity_threshold: float = described(
        0.3, "Flag when the verbose share exceeds this.", ge=0, le=1
    )
    sycophancy_threshold: float = described(
        0.2, "Flag when the sycophantic share exceeds this.", ge=0, le=1
    )
    repetition_threshold: float = described(
        0.15, "Flag when the repetitive share exceeds this.", ge=0, le=1
    )
    sycophancy_phrases: list[str] = described(
        list(GUIDE_SYCOPHANTIC_OPENERS), "Openers searched in the first 150 characters."
    )
    min_length_ratio: float = described(
        0.5,
        "Flag a length collapse when the policy's mean answer, in words, is under this share of "
        "the reference's on the same prompts and seeds (only where the reference is at hand; 0: "
        "off). β is not raised for it.",
        ge=0,
        le=1,
    )
    generation: GenerationSection = described(
        GenerationSection(temperature=0.7, top_p=1.0), "Audit generation settings."
    )
    judge: JudgeSection | None = described(
        None,
        "A second reward the policy never trains against, scored beside the proxy at every "
        "held-out evaluation and by `rlhf audit`; it flags `overoptimization` "
        "(docs/ppo.md#judge). Unset: no judge.",
    )

    @field_validator("prompts_file")
    @classmethod
    def _local_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        path = resolve_local(value, info, "audit prompts file")
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text") from None
        if not any(line.strip() for line in lines):
            raise ValueError(f"{path} holds no prompt (one a line)")
        return path


class MergeSection(Section):
    device: Literal["auto", "cpu"] = described(
        "auto",
        "`cpu`: merge on the CPU even where the other stages use a GPU (a 16-bit 7B base takes "
        "about 14 GiB, which host memory usually has and a small card does not); `auto` follows "
        "`run.device`.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = described(
        "auto",
        "dtype the merged model is saved in (`auto` as in `model.dtype`: bfloat16 on GPUs that "
        "compute it natively, else float32); the merge itself runs in float32, then the model is "
        "cast once; never 4-bit.",
    )
    atol: float = described(
        1e-3,
        "Largest allowed absolute logit difference of the float32 merge vs the adapter model, and "
        "the floor of the bf16/fp16 check (16 rounding steps of the dtype at the largest logit).",
        gt=0,
    )


class PushSection(Section):
    repo_id: str | None = described(
        None, "Hub repository id, `user/name`.", pattern=r"^[\w.-]+/[\w.-]+$"
    )
    private: bool = described(True, "Create the repository as private.")
    commit_message: str = described("PPO-aligned model via RLHF", "Commit message of the upload.")

    @field_validator("commit_message")
    @classmethod
    def _a_message(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty")
        control = sorted({c for c in value if ord(c) < 32 and c not in "\n\t"})
        if control:
            raise ValueError(f"holds a control character ({control[0]!r})")
        return value


class Recipe(Section):
    run: RunSection = described(RunSection(), "Run name, output folder, seed, device, trackers.")
    model: ModelSection = described(..., "The policy model: base, dtype, quantisation, LoRA.")
    data: DataSection = described(DataSection(), "Datasets of each stage.")
    sft: SftSection = described(SftSection(), "Supervised fine-tuning.")
    reward: RewardSection = described(..., "Reward model: trained here or frozen pretrained.")
    ppo: PpoSection = described(PpoSection(), "PPO alignment.")
    dpo: DpoSection = described(
        DpoSection(), "Offline preference optimisation (`rlhf dpo`): DPO and its losses."
    )
    kto: KtoSection = described(
        KtoSection(), "KTO on thumbs-up / thumbs-down rows (`rlhf kto`), with a reference."
    )
    orpo: OrpoSection = described(
        OrpoSection(), "ORPO (`rlhf orpo`): NLL plus an odds-ratio term, no reference."
    )
    simpo: SimpoSection = described(
        SimpoSection(), "SimPO (`rlhf simpo`): a length-normalised margin, no reference."
    )
    audit: AuditSection = described(AuditSection(), "Reward-hacking audit.")
    merge: MergeSection = described(MergeSection(), "Merging LoRA into the base.")
    push: PushSection = described(PushSection(), "Publishing to the hub.")
    eval: EvalSection = described(
        EvalSection(), "Yardsticks outside the reward model (`rlhf eval`)."
    )

    @model_validator(mode="after")
    def _vllm_full_precision(self) -> Recipe:
        four_bit = self.model.quantization.load_in_4bit
        generating = (
            ("ppo", self.ppo.generation),
            ("audit", self.audit.generation),
            ("eval", self.eval.generation),
        )
        for name, gen in generating:
            if four_bit and gen.backend in VLLM_BACKENDS:
                raise ValueError(
                    f"{name}.generation.backend: {gen.backend} serves the policy's "
                    "full-precision weights: set model.quantization.load_in_4bit: false (or "
                    "backend: hf)"
                )
        for name, gen in generating[1:]:
            if gen.async_steps:
                raise ValueError(f"{name}.generation.async_steps: only PPO's rollouts overlap")
        for name, gen in generating:
            if (
                gen.backend == "vllm_server"
                and gen.server.sync == "lora"
                and not (self.model.lora.enabled)
            ):
                raise ValueError(
                    f"{name}.generation.server.sync: lora sends the policy's LoRA adapter, but "
                    "model.lora.enabled is false: use sync: weights (or auto)"
                )
        return self

    @model_validator(mode="after")
    def _stage_data(self) -> Recipe:
        if self.sft.enabled and self.data.sft is None:
            raise ValueError("data: sft.enabled is true but data.sft is not set")
        if self.reward.base_model is not None and self.data.preferences is None:
            raise ValueError(
                "data: reward.base_model is set (train-rm) but data.preferences is not"
            )
        if self.data.prompts is None:
            raise ValueError("data: data.prompts is required for PPO")
        if self.ppo.eval_every is not None and self.data.prompts.eval_fraction == 0:
            raise ValueError(
                "ppo: ppo.eval_every is set but no prompts are held out: set "
                "data.prompts.eval_fraction (e.g. 0.1)"
            )
        return self

    def sha256(self) -> str:
        """Hash of the resolved recipe, recorded in every manifest."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
