"""The losses behind `rlhf kto`, `rlhf orpo` and `rlhf simpo`, as the stage asks TRL for them
(`METHODS[...].options` of the recipe's section), against values computed here by hand: ORPO's
odds-ratio term and SimPO's length-normalised margin with γ on a fixed batch of log-probs, and
KTO's loss with its KL baseline on the tiny model's log-probs of a fixed batch. ORPO and SimPO
live in `trl.experimental`: a TRL change breaks these tests, not a user."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dpo_loss import sequence_logps

from rlhf_cli.recipe import KtoSection, OrpoSection, SimpoSection
from rlhf_cli.stages.dpo import METHODS

# mean token log-probs of two pairs (ORPO and SimPO score each answer by its mean)
CHOSEN = torch.tensor([-0.5, -1.2])
REJECTED = torch.tensor([-1.5, -0.9])
ROWS = [{"prompt": "Could you help me", "chosen": " gladly, here is how", "rejected": " no."}]


def trainer(method: str, section, **extra):
    """TRL's trainer for `method` on the tiny model, configured as the stage configures it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_cli.tiny import tiny_lm_path

    trainer_class, config_class = METHODS[method].classes()
    trainer_class = extra.pop("trainer_class", trainer_class)
    path = tiny_lm_path()
    args = config_class(
        output_dir="unused", use_cpu=True, bf16=False, report_to=[], max_length=64,
        **METHODS[method].options(section),
    )  # fmt: skip
    return trainer_class(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(path),
        train_dataset=Dataset.from_list(extra.pop("rows", ROWS)),
        **extra,
    )


def test_orpo_odds_ratio_term_by_hand() -> None:
    orpo = trainer("orpo", OrpoSection(beta=0.25))
    losses, chosen_rewards, _, _, log_odds = orpo.odds_ratio_loss(CHOSEN, REJECTED)

    def log_odds_of(p: float) -> float:  # log(p / (1 - p)) from log p
        return p - math.log(1 - math.exp(p))

    by_hand = [
        log_odds_of(c) - log_odds_of(r) for c, r in zip([-0.5, -1.2], [-1.5, -0.9], strict=True)
    ]
    assert by_hand[0] == pytest.approx(1.68027, abs=1e-5)  # 1.0 + log(0.776870 / 0.393469)
    # the full loss is the NLL minus this mean: β log σ(log odds ratio) per pair
    expected = [0.25 * math.log(1 / (1 + math.exp(-x))) for x in by_hand]
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert log_odds.item() == pytest.approx(sum(by_hand) / 2, rel=1e-5)
    torch.testing.assert_close(chosen_rewards, 0.25 * CHOSEN)


def test_simpo_margin_with_gamma_by_hand() -> None:
    simpo = trainer("simpo", SimpoSection(beta=2.0, gamma=0.8))
    assert simpo.loss_type == "simpo" and simpo.cpo_alpha == 0.0  # SimPO: no NLL term
    losses, _, _ = simpo.cpo_loss(CHOSEN, REJECTED)
    # -log σ(β (mean log p chosen - mean log p rejected) - γ)
    margins = [2.0 * (-0.5 + 1.5) - 0.8, 2.0 * (-1.2 + 0.9) - 0.8]
    assert margins == pytest.approx([1.2, -1.4])
    expected = [math.log(1 + math.exp(-m)) for m in margins]
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_simpo_scores_answers_by_their_mean_token_log_prob() -> None:
    simpo = trainer("simpo", SimpoSection())
    logits = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, -100, 3, 5]])  # two answer tokens
    logps = torch.log_softmax(logits, -1)
    by_hand = (logps[0, 1, 3] + logps[0, 2, 5]) / 2  # token t scored by the logits at t - 1
    got = simpo.get_batch_logps(logits, labels, average_log_prob=simpo.loss_type == "simpo")
    torch.testing.assert_close(got[0], by_hand)


THUMBS = [
    {"prompt": "Could you help me plan", "completion": " a calm week, please?", "label": True},
    {"prompt": "Thank you for", "completion": " nothing at all today", "label": False},
    {"prompt": "How do I water", "completion": " the plants weekly", "label": True},
]


def test_kto_loss_with_its_kl_baseline_by_hand() -> None:
    from transformers import AutoModelForCausalLM

    from rlhf_cli.tiny import tiny_lm_path

    beta = 0.3
    reference = AutoModelForCausalLM.from_pretrained(tiny_lm_path()).eval()
    from trl import KTOTrainer  # TRL's own: no cache, the reference's forward in the loss

    section = KtoSection(beta=beta)
    kto = trainer("kto", section, rows=THUMBS, ref_model=reference, trainer_class=KTOTrainer)
    policy = kto.model.eval()
    torch.manual_seed(0)  # a perturbed reference, which scores the mismatched answers lower
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    batch = kto.data_collator([kto.train_dataset[i] for i in range(len(THUMBS))])
    pi, _ = sequence_logps(policy, batch)
    ref, _ = sequence_logps(reference, batch)
    mismatched = {
        "input_ids": batch["KL_input_ids"],
        "attention_mask": batch["KL_attention_mask"],
        "completion_mask": batch["KL_completion_mask"],
    }
    kl_pi, _ = sequence_logps(policy, mismatched)
    kl_ref, _ = sequence_logps(reference, mismatched)
    z = (kl_pi - kl_ref).mean().clamp(min=0)  # KTO's baseline: the batch's KL, not below 0
    assert z > 0  # a batch on which the baseline counts
    ratio = pi - ref
    label = torch.tensor([row["label"] for row in THUMBS])
    losses = torch.where(
        label, 1 - F.sigmoid(beta * (ratio - z)), 1 - F.sigmoid(beta * (z - ratio))
    )
    with torch.no_grad():
        got = kto.compute_loss(policy, batch)
    torch.testing.assert_close(got, losses.mean(), rtol=1e-4, atol=1e-5)
