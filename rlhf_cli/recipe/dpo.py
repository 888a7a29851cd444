"""The offline methods' sections, `dpo`, `kto`, `orpo` and `simpo`: preference optimisation on
`data.preferences` without a reward model or rollouts, through TRL's trainers (DPOTrainer,
KTOTrainer, and `trl.experimental`'s ORPOTrainer and CPOTrainer), on a base they share
(`OfflineSection`)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from rlhf_cli.recipe.base import described
from rlhf_cli.recipe.training import TrainerSection

# TRL 1.16's `DPOConfig.loss_type` names (tests/unit/test_dpo_loss.py pins them against TRL's
# own list, so a TRL change breaks a test, not a user); declared here so that validating a
# recipe imports no TRL.
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
SMOOTHED_LOSSES = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses that read it


class OfflineSection(TrainerSection):
    """What the offline methods share: the strength of the preference term (`beta`, each
    method's own default), and the optimiser and length of a preference stage."""

    beta: float = described(
        0.1, "β: the weight of the preference term (each method reads it its way).", gt=0.0
    )
    learning_rate: float = described(5e-6, "AdamW learning rate.", gt=0.0)
    max_length: int = described(
        1024,
        "Prompt plus answer, in tokens, cut to this (the answer's end goes); a pair whose "
        "prompt alone fills it is dropped by TRL and counted.",
        gt=0,
    )
    warmup_ratio: float = described(0.1, "Share of steps with linear warm-up.", ge=0.0, lt=1.0)


class DpoSection(OfflineSection):
    beta: float = described(
        0.1,
        "β: how far the policy may move from the reference (higher: closer). For `ipo` the "
        "regulariser τ.",
        gt=0.0,
    )
    loss_type: list[str] = described(
        ["sigmoid"],
        "TRL's DPO losses by name, summed with `loss_weights`: "
        + ", ".join(f"`{name}`" for name in DPO_LOSSES)
        + ". With Δ the chosen answer's log-prob ratio to the reference minus the rejected "
        "one's: `sigmoid` is DPO (-log σ(β Δ)), `hinge` SLiC (relu(1 - β Δ)), `ipo` IPO ((Δ "
        "per token - 1/(2β))²), `robust` rDPO; [sigmoid, sft] adds the chosen answers' NLL "
        "(RPO).",
        min_length=1,
    )
    loss_weights: list[float] | None = described(
        None, "One weight per `loss_type` entry (unset: 1 each).", min_length=1
    )
    label_smoothing: float = described(
        0.0,
        "Share of preference labels taken to be flipped: read by `robust` (in [0, 0.5)), "
        "`exo_pair` (above 0), `aot` and `aot_unpaired` only; TRL's `sigmoid` has none "
        "(conservative DPO is `robust` or `aot` here).",
        ge=0.0,
        lt=1.0,
    )

    @field_validator("loss_type")
    @classmethod
    def _known_losses(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in DPO_LOSSES]
        if unknown:
            raise ValueError(f"unknown loss {unknown[0]!r}: one of {', '.join(DPO_LOSSES)}")
        if len(set(value)) < len(value):
            raise ValueError("names a loss twice: give it one entry and a weight instead")
        return value

    @model_validator(mode="after")
    def _weights_and_smoothing(self) -> DpoSection:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights: {len(self.loss_weights)} weights for {len(self.loss_type)} "
                "losses in dpo.loss_type: give one each"
            )
        smoothed = [name for name in self.loss_type if name in SMOOTHED_LOSSES]
        if self.label_smoothing and not smoothed:
            raise ValueError(
                f"label_smoothing: no loss in dpo.loss_type reads it (only "
                f"{', '.join(SMOOTHED_LOSSES)} do): TRL's sigmoid would ignore it silently"
            )
        if "robust" in self.loss_type and self.label_smoothing >= 0.5:
            raise ValueError("label_smoothing: the robust loss needs it below 0.5")
        if "exo_pair" in self.loss_type and not self.label_smoothing:
            raise ValueError("label_smoothing: the exo_pair loss needs it above 0 (EXO: 1e-3)")
        return self


class KtoSection(OfflineSection):
    """`rlhf kto`: thumbs-up / thumbs-down rows (`prompt`, `completion`, `label`), not pairs."""

    beta: float = described(
        0.1,
        "β: how far the policy may move from the reference (higher: closer); each answer's "
        "loss is 1 - σ(β (log-ratio - z)) for a desirable one, 1 - σ(β (z - log-ratio)) for an "
        "undesirable one, with z the batch's KL to the reference (KTO's baseline).",
        gt=0.0,
    )
    desirable_weight: float = described(
        1.0,
        "Weight of the thumbs-up answers' losses (raise it when they are fewer: KTO's paper "
        "keeps desirable × weight / (undesirable × weight) in [1, 1.33]).",
        gt=0.0,
    )
    undesirable_weight: float = described(1.0, "Weight of the thumbs-down answers' losses.", gt=0.0)


class OrpoSection(OfflineSection):
    """`rlhf orpo`: SFT and preference in one loss, no reference model."""

    beta: float = described(
        0.1,
        "λ of ORPO: the weight of the odds-ratio term, -λ log σ(log odds(chosen) - log "
        "odds(rejected)), added to the chosen answers' NLL (odds from each answer's mean "
        "token log-prob).",
        gt=0.0,
    )
    start: Literal["sft", "base"] = described(
        "sft",
        "The policy it starts from: `sft` (the SFT stage's model) or `base` "
        "(`model.name_or_path`: ORPO's own recipe, the NLL term doing the SFT's work).",
    )


class SimpoSection(OfflineSection):
    """`rlhf simpo`: a length-normalised margin, no reference model."""

    beta: float = described(
        2.0,
        "β of SimPO: the scale of the length-normalised log-prob margin (the paper: 2 to 2.5).",
        gt=0.0,
    )
    gamma: float = described(
        0.5,
        "γ: the target margin, -log σ(β (mean log-prob chosen - mean log-prob rejected) - γ) "
        "(the paper: γ/β about 0.5).",
        ge=0.0,
    )
