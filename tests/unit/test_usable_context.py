"""A RoBERTa-style reward model's usable context (#50 item 13b): its config reports
`max_position_embeddings` 514 and it takes 512 tokens, as positions start at `pad_token_id + 1`;
a `reward.max_length` past the usable length is refused up front, not an index error at the
first long text."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.errors import ModelLoadError

POSITIONS = 18  # the config's `max_position_embeddings`; pad id 1: 16 tokens fit, as 514 -> 512


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf_cli.modeling import load_tokenizer

    return load_tokenizer("builtin:tiny-lm", padding_side="right")


def _roberta(vocab: int):
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=vocab,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=POSITIONS,
        pad_token_id=1,
        num_labels=1,
    )
    return RobertaForSequenceClassification(config).eval()


def test_a_roberta_model_takes_two_positions_fewer_than_its_config_says(tokenizer) -> None:
    from rlhf_cli.model_checks import check_context, model_context

    model = _roberta(len(tokenizer))
    assert model_context(model) == POSITIONS - 2
    model(torch.full((1, POSITIONS - 2), 5))  # 16 tokens run
    with pytest.raises((IndexError, RuntimeError)):  # 17 do not: the context said 18 before
        model(torch.full((1, POSITIONS - 1), 5))
    with pytest.raises(ModelLoadError) as refused:
        check_context(model, {"reward.max_length": POSITIONS - 1}, "the reward model")
    assert str(refused.value) == (
        "reward.max_length (17) exceeds the reward model's context of 16 tokens: make it at most 16"
    )


def test_a_bert_model_takes_every_position_its_config_says() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    from rlhf_cli.model_checks import model_context

    config = BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=POSITIONS,
    )
    model = BertForSequenceClassification(config).eval()
    assert model_context(model) == POSITIONS
    model(torch.full((1, POSITIONS), 5))  # every position is usable


def test_the_reward_scorer_refuses_a_max_length_a_roberta_model_cannot_take(tokenizer) -> None:
    from rlhf_cli.scoring import RewardScorer

    model = _roberta(len(tokenizer))
    with pytest.raises(ModelLoadError, match="reward.max_length \\(17\\) exceeds .* of 16 tokens"):
        RewardScorer(model, tokenizer, "{prompt} {response}", max_length=POSITIONS - 1)
    scorer = RewardScorer(model, tokenizer, "{prompt} {response}", max_length=POSITIONS - 2)
    features, cut = scorer.encode(["a long prompt " * 10], ["and a long answer " * 10])
    assert cut == 1 and len(features["input_ids"][0]) == POSITIONS - 2
    with torch.inference_mode():
        model(torch.tensor(features["input_ids"]))  # what the scorer keeps runs
