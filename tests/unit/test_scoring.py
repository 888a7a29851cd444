"""RewardScorer on a word-level tokenizer and a tiny Llama reward model, both built offline."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from rlhf_cli.scoring import RewardScorer

# One id a word, so token counts can be worked out by hand: "<s>" first, then one id a word.
VOCAB = {
    "<pad>": 0,
    "<s>": 1,
    "</s>": 2,
    "<unk>": 3,
    "Q": 4,
    "A": 5,
    ":": 6,
    **{w: i + 7 for i, w in enumerate("abcdefgh")},
}  # a=7, b=8, ..., h=14
TEMPLATE = "Q : {prompt} A : {response}"


def word_tokenizer(padding_side: str = "right") -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side=padding_side,
    )


@pytest.fixture(scope="module")
def reward_model():
    torch.manual_seed(0)
    # config.pad_token_id equals the tokenizer's pad id: Llama scores the last non-pad token.
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=1,
    )
    return LlamaForSequenceClassification(config).eval()


def scorer(
    model=None,
    max_length: int = 64,
    batch_size: int = 16,
    padding_side: str = "right",
    template: str = TEMPLATE,
) -> RewardScorer:
    return RewardScorer(model, word_tokenizer(padding_side), template, max_length, batch_size)


# Mixed lengths (5 to 17 tokens), so a batch of 16 pads all but the longest.
PROMPTS = ["a", "a b c d e f", "b c", "g h a b c d e f g h", "c", "h"]
RESPONSES = ["b", "c", "d e f g h", "a", "h g f", "a b"]


# ── text and tokens ─────────────────────────────────────────────────────────────────────────


def test_texts_fill_the_template():
    assert scorer().texts(["a b", "c"], ["d", "e f"]) == ["Q : a b A : d", "Q : c A : e f"]
    guide = RewardScorer(None, None, "Human: {prompt}\n\nAssistant: {response}", 16)
    assert guide.texts(["How?"], ["Like so."]) == ["Human: How?\n\nAssistant: Like so."]


def test_braces_in_the_text_are_kept_and_doubled_braces_in_the_template_are_literal():
    plain = scorer(template="{{score}} {prompt} -> {response}")
    assert plain.texts(["use {response} here"], ["{prompt}"]) == [
        "{score} use {response} here -> {prompt}"
    ]


def test_texts_refuse_unequal_lists():
    with pytest.raises(ValueError):
        scorer().texts(["a", "b"], ["c"])


def test_encode_truncates_to_max_length_and_counts_only_longer_texts():
    # "<s>" + words: 4, 5, 6 and 8 tokens against max_length 5
    ids, n_truncated = scorer(max_length=5).encode(
        ["a b c", "a b c d", "a b c d e", "a b c d e f g"]
    )
    assert n_truncated == 2  # exactly max_length is not truncated
    assert ids == [[1, 7, 8, 9], [1, 7, 8, 9, 10], [1, 7, 8, 9, 10], [1, 7, 8, 9, 10]]


def test_encode_without_truncation():
    ids, n_truncated = scorer(max_length=64).encode(["Q : a z", "h"])
    assert n_truncated == 0
    assert ids == [[1, 4, 6, 7, 3], [1, 14]]  # z is unknown: <unk> = 3


# ── scores ──────────────────────────────────────────────────────────────────────────────────


def test_scores_are_one_float32_per_pair_on_the_cpu(reward_model):
    scores, n_truncated = scorer(reward_model).score(PROMPTS, RESPONSES)
    assert scores.shape == (6,) and scores.dtype == torch.float32
    assert scores.device.type == "cpu" and n_truncated == 0
    assert len(set(scores.tolist())) == 6  # six different texts, six different scores


def test_each_score_is_the_models_logit_on_that_text_alone(reward_model):
    s = scorer(reward_model)
    scores, _ = s.score(PROMPTS, RESPONSES)
    ids, _ = s.encode(s.texts(PROMPTS, RESPONSES))
    with torch.no_grad():
        alone = [reward_model(input_ids=torch.tensor([x])).logits[0, 0] for x in ids]
    assert_close(scores, torch.stack(alone), rtol=1e-5, atol=1e-6)


# Both sides hold here because config.pad_token_id is the tokenizer's pad id (Llama then scores
# the last non-pad token) and RoPE is shift-invariant; with a config pad id that differs from the
# tokenizer's, scores in padded batches change with the batch size (the scorer does not check).
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_scores_do_not_depend_on_the_batch_size(reward_model, padding_side):
    scores = [
        scorer(reward_model, batch_size=n, padding_side=padding_side).score(PROMPTS, RESPONSES)[0]
        for n in (1, 4, 16)
    ]
    assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-6)
    assert_close(scores[2], scores[0], rtol=1e-5, atol=1e-6)


def test_truncated_inputs_are_scored_on_their_first_max_length_tokens(reward_model):
    s = scorer(reward_model, max_length=5, template="{prompt} {response}")
    # "<s> a b c d" is 5 tokens; the other two are 6 and 9 tokens and cut to the same 5
    scores, n_truncated = s.score(["a b", "a b", "a b c"], ["c d", "c d e", "d e f g h"])
    assert n_truncated == 2
    assert_close(scores[1:], scores[:1].expand(2), rtol=1e-6, atol=1e-7)


def test_a_bfloat16_model_still_gives_float32_scores(reward_model):
    import copy

    half = copy.deepcopy(reward_model).to(torch.bfloat16)
    scores, _ = scorer(half).score(PROMPTS[:2], RESPONSES[:2])
    full, _ = scorer(reward_model).score(PROMPTS[:2], RESPONSES[:2])
    assert scores.dtype == torch.float32
    assert_close(scores, full, rtol=0.1, atol=0.02)


def test_no_pairs_give_an_empty_float32_tensor(reward_model):
    scores, n_truncated = scorer(reward_model).score([], [])
    assert scores.shape == (0,) and scores.dtype == torch.float32 and n_truncated == 0


def test_reward_truncation_is_counted_not_silent():
    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.scoring import RewardScorer

    tokenizer = load_tokenizer("builtin:minilm", padding_side="right")
    scorer = RewardScorer(
        model=None, tokenizer=tokenizer, template="{prompt} {response}", max_length=16
    )
    ids, n_truncated = scorer.encode(scorer.texts(["short", "long " * 40], ["ok", "ok"]))
    assert n_truncated == 1
    assert max(len(x) for x in ids) == 16
