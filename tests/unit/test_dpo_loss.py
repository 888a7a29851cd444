"""The DPO losses `rlhf dpo` asks TRL for, by name, against the formulas computed here from the
tiny model's log-probs on a fixed batch; and the names the recipe accepts against TRL's own
list, so a TRL change breaks a test, not a user."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from rlhf_cli.recipe import DPO_LOSSES, DpoSection

PAIRS = [
    {"prompt": "Could you help me plan", "chosen": " a calm week, please?", "rejected": " no."},
    {"prompt": "Thank you for", "chosen": " your kind words", "rejected": " nothing at all today"},
]
BETA = 0.2


@pytest.fixture(scope="module")
def batch_and_models():
    """(collated batch, policy, reference, tokenizer): the tiny model as the reference and a
    perturbed copy of it as the policy, so the log-ratios are not zero."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from rlhf_cli.tiny import tiny_lm_path

    path = tiny_lm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    args = DPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(PAIRS),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    return batch, trainer.model, trainer.ref_model, tokenizer


def sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the answer tokens' log-probs, answer lengths), each `(2 * pairs,)`: chosen rows
    first. Token t is scored by the logits at t - 1."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tokens = batch["input_ids"][:, 1:]
    mask = batch["completion_mask"][:, 1:].float()
    per_token = logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(dim=1), mask.sum(dim=1)


def trl_loss(batch_and_models, section: DpoSection) -> torch.Tensor:
    """The loss TRL's DPOTrainer computes for the recipe section's losses on the batch."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    batch, policy, reference, tokenizer = batch_and_models
    args = DPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        report_to=[],
        beta=section.beta,
        loss_type=list(section.loss_type),
        loss_weights=section.loss_weights,
        label_smoothing=section.label_smoothing,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(PAIRS),
    )
    with torch.no_grad():
        return trainer.compute_loss(policy, batch)


def log_ratios(batch_and_models):
    """Each pair's (chosen log-ratio, rejected log-ratio, chosen length, rejected length)."""
    batch, policy, reference, _ = batch_and_models
    pi, lengths = sequence_logps(policy, batch)
    ref, _ = sequence_logps(reference, batch)
    ratio = pi - ref
    n = len(PAIRS)
    return ratio[:n], ratio[n:], lengths[:n], lengths[n:]


def test_sigmoid_loss_is_dpo_by_hand(batch_and_models):
    chosen, rejected, _, _ = log_ratios(batch_and_models)
    delta = chosen - rejected
    assert delta.abs().min() > 1e-3  # a batch on which the loss is not log 2
    expected = -F.logsigmoid(BETA * delta).mean()
    got = trl_loss(batch_and_models, DpoSection(beta=BETA))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_ipo_loss_is_per_token_ipo_by_hand(batch_and_models):
    chosen, rejected, chosen_len, rejected_len = log_ratios(batch_and_models)
    delta = chosen / chosen_len - rejected / rejected_len
    expected = ((delta - 1 / (2 * BETA)) ** 2).mean()
    got = trl_loss(batch_and_models, DpoSection(beta=BETA, loss_type=["ipo"]))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_weighted_losses_sum_sigmoid_and_hinge_by_hand(batch_and_models):
    chosen, rejected, _, _ = log_ratios(batch_and_models)
    delta = chosen - rejected
    sigmoid = -F.logsigmoid(BETA * delta).mean()
    hinge = torch.relu(1 - BETA * delta).mean()
    section = DpoSection(beta=BETA, loss_type=["sigmoid", "hinge"], loss_weights=[0.7, 0.3])
    torch.testing.assert_close(
        trl_loss(batch_and_models, section), 0.7 * sigmoid + 0.3 * hinge, rtol=1e-4, atol=1e-5
    )


def test_the_recipe_accepts_exactly_trls_loss_names():
    from trl import DPOConfig

    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert set(re.findall(r"`'(\w+)'`", help_text)) == set(DPO_LOSSES)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": ["dpo"]}, "unknown loss 'dpo'"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "1 weights for 2 losses"),
        ({"label_smoothing": 0.1}, "no loss in dpo.loss_type reads it"),
        ({"loss_type": ["exo_pair"]}, "exo_pair loss needs it above 0"),
    ],
)
def test_the_section_refuses_what_trl_would_ignore_or_fail_on(fields, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(message)):
        DpoSection(**fields)
