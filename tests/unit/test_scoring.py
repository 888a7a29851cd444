"""RewardScorer on a word-level tokenizer and a tiny Llama reward model, both built offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.testing import assert_close
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from rlhf_cli.scoring import RewardScorer, pair_input

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


def tiny_llama(pad_token_id: int | None = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=pad_token_id,
        num_labels=1,
    )
    return LlamaForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def reward_model():
    # config.pad_token_id equals the tokenizer's pad id: Llama scores the last non-pad token.
    return tiny_llama(pad_token_id=0)


def scorer(
    model=None,
    max_length: int = 64,
    batch_size: int = 16,
    padding_side: str = "right",
    template: str = TEMPLATE,
) -> RewardScorer:
    return RewardScorer(model, word_tokenizer(padding_side), template, max_length, batch_size)


def encode_ids(s: RewardScorer, prompts: list[str], responses: list[str]):
    """(input ids, n truncated) of a template-mode scorer, which gives input ids alone."""
    features, n_truncated = s.encode(prompts, responses)
    assert list(features) == ["input_ids"]
    return features["input_ids"], n_truncated


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


def test_encode_counts_only_longer_texts_and_keeps_fitting_ones_as_tokenised():
    s = scorer(max_length=5, template="{prompt} {response}")
    # "<s>" + words: 4, 5, 6 and 8 tokens against max_length 5
    ids, n_truncated = encode_ids(
        s, ["a", "a b", "a b c", "a b c d e"], ["b c", "c d", "d e", "f g"]
    )
    assert n_truncated == 2  # exactly max_length is not truncated
    tokenizer = word_tokenizer()
    assert ids[:2] == [tokenizer("a b c")["input_ids"], tokenizer("a b c d")["input_ids"]]
    assert ids[:2] == [[1, 7, 8, 9], [1, 7, 8, 9, 10]]
    # the prompts lose their start; the responses stay whole
    assert ids[2:] == [[1, 8, 9, 10, 11], [1, 10, 11, 12, 13]]


def test_encode_without_truncation():
    ids, n_truncated = encode_ids(
        scorer(max_length=64, template="{prompt} {response}"), ["Q : a", "h"], ["z", ""]
    )
    assert n_truncated == 0
    assert ids == [[1, 4, 6, 7, 3], [1, 14]]  # z is unknown: <unk> = 3


def test_encode_refuses_unequal_lists():
    with pytest.raises(ValueError):
        scorer().encode(["a", "b"], ["c"])


def test_encode_of_no_pairs():
    assert scorer().encode([], []) == ({"input_ids": []}, 0)


class SlowTokenizer:
    """The word-level tokenizer seen as a slow one: no offsets, so cuts are tried per character."""

    is_fast = False

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        assert "return_offsets_mapping" not in kwargs
        return self._tokenizer(*args, **kwargs)


def cut_scorer(max_length: int, slow: bool, template: str = TEMPLATE) -> RewardScorer:
    s = scorer(max_length=max_length, template=template)
    if slow:
        s.tokenizer = SlowTokenizer(s.tokenizer)
    return s


# ── truncation: the response survives, the prompt loses its start ───────────────────────────


@pytest.mark.parametrize("slow", [False, True])
def test_a_long_prompt_loses_its_start_and_the_response_survives_whole(slow):
    # "<s> Q : a b c d e f g h A : b c" is 15 tokens; without the prompt 7, so 1 prompt word fits
    ids, n_truncated = encode_ids(cut_scorer(8, slow), ["a b c d e f g h"], ["b c"])
    assert n_truncated == 1
    assert ids == [[1, 4, 6, 14, 5, 6, 8, 9]]  # <s> Q : h A : b c
    assert len(ids[0]) == 8


@pytest.mark.parametrize("slow", [False, True])
def test_a_response_too_long_alone_drops_the_prompt_and_keeps_its_own_end(slow):
    # "<s> Q : A :" is 5 tokens, the response 8 words: its last 3 fit
    ids, n_truncated = encode_ids(cut_scorer(8, slow), ["a b"], ["a b c d e f g h"])
    assert n_truncated == 1
    assert ids == [[1, 4, 6, 5, 6, 12, 13, 14]]  # <s> Q : A : f g h


@pytest.mark.parametrize("slow", [False, True])
def test_a_template_too_long_alone_is_cut_by_the_tokenizer(slow):
    ids, n_truncated = encode_ids(cut_scorer(4, slow), ["a"], ["b"])  # "<s> Q : A :": 5 tokens
    assert n_truncated == 1
    assert ids == [[1, 4, 6, 5]]


def test_every_shortened_text_is_counted_and_fitting_ones_are_untouched():
    s = scorer(max_length=8)
    prompts = ["a", "a b c d e f g h", "a b", "a b"]
    responses = ["b", "b c", "a b c d e f g h", "d"]  # fits, prompt cut, response cut, exactly 8
    ids, n_truncated = encode_ids(s, prompts, responses)
    assert n_truncated == 2
    assert all(len(x) <= 8 for x in ids)
    texts = s.texts(prompts, responses)
    assert ids[0] == s.tokenizer(texts[0])["input_ids"] == [1, 4, 6, 7, 5, 6, 8]
    assert ids[3] == s.tokenizer(texts[3])["input_ids"]
    assert ids[1][-2:] == [8, 9] and ids[2][-3:] == [12, 13, 14]


# ── pair encoding: tokenizer(prompt, response), as sequence-pair classifiers read it ─────────

CLS, SEP = 15, 16
PAIR_VOCAB = {**VOCAB, "[CLS]": CLS, "[SEP]": SEP}


def pair_tokenizer(token_types: bool = True) -> PreTrainedTokenizerFast:
    """BERT's layout, one id a word: `[CLS] a [SEP]`, and `[CLS] a [SEP] b [SEP]` with token
    types 0 then 1; `token_types=False` is a tokenizer that does not return them (RoBERTa)."""
    backend = Tokenizer(models.WordLevel(vocab=PAIR_VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)],
    )
    names = ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="right",
        model_input_names=names if token_types else [names[0], names[2]],
    )


def pair_scorer(
    max_length: int = 64, model=None, token_types: bool = True, slow: bool = False
) -> RewardScorer:
    s = RewardScorer(model, pair_tokenizer(token_types), TEMPLATE, max_length, input="pair")
    if slow:
        s.tokenizer = SlowTokenizer(s.tokenizer)
    return s


def test_pair_mode_encodes_the_text_pair_with_its_token_types():
    prompts, responses = ["a b", "c"], ["d", "e f"]
    features, n_truncated = pair_scorer().encode(prompts, responses)
    assert n_truncated == 0
    tokenized = pair_tokenizer()(prompts, responses)
    assert features == {
        "input_ids": tokenized["input_ids"],
        "token_type_ids": tokenized["token_type_ids"],
    }
    assert features["input_ids"] == [[CLS, 7, 8, SEP, 10, SEP], [CLS, 9, SEP, 11, 12, SEP]]
    assert features["token_type_ids"] == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]


def test_pair_mode_passes_no_token_types_where_the_tokenizer_gives_none():
    features, _ = pair_scorer(token_types=False).encode(["a b"], ["d"])
    assert features == {"input_ids": [[CLS, 7, 8, SEP, 10, SEP]]}


@pytest.mark.parametrize("slow", [False, True])
def test_pair_mode_cuts_only_the_prompt_and_counts_it(slow):
    # "a b" + "c d e" is 8 tokens, exactly max_length; "a b c d e f" + "g h" is 11: the prompt
    # keeps its last 3 words, the response stays whole
    prompts, responses = ["a b", "a b c d e f"], ["c d e", "g h"]
    features, n_truncated = pair_scorer(max_length=8, slow=slow).encode(prompts, responses)
    assert n_truncated == 1
    tokenizer = pair_tokenizer()
    assert features["input_ids"][0] == tokenizer("a b", "c d e")["input_ids"]
    assert features["input_ids"][1] == tokenizer("d e f", "g h")["input_ids"]
    assert features["input_ids"][1] == [CLS, 10, 11, 12, SEP, 13, 14, SEP]
    assert features["token_type_ids"][1] == [0, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("slow", [False, True])
def test_pair_mode_keeps_the_end_of_a_response_too_long_alone(slow):
    # "[CLS] [SEP] ... [SEP]" is 3 tokens: the prompt goes, the response keeps its last 5 words
    features, n_truncated = pair_scorer(max_length=8, slow=slow).encode(["a"], ["a b c d e f g h"])
    assert n_truncated == 1
    assert features["input_ids"] == [[CLS, SEP, 10, 11, 12, 13, 14, SEP]]
    assert features["token_type_ids"] == [[0, 0, 1, 1, 1, 1, 1, 1]]


def test_auto_is_pair_for_tokenizers_with_cls_and_sep_and_template_otherwise():
    from rlhf_cli.modeling import load_tokenizer

    assert pair_input(pair_tokenizer()) == "pair"
    assert pair_input(load_tokenizer("builtin:minilm")) == "pair"  # BERT's WordPiece
    assert pair_input(word_tokenizer()) == "template"  # a decoder's: BOS and EOS only
    assert pair_input(None) == "template"  # rule-based rewards alone
    no_cls = pair_tokenizer()
    no_cls.cls_token = None
    assert pair_input(no_cls) == "template"
    assert RewardScorer(None, pair_tokenizer(), TEMPLATE, 8, input="auto").input == "pair"
    assert RewardScorer(None, word_tokenizer(), TEMPLATE, 8, input="auto").input == "template"


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(PAIR_VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        type_vocab_size=2,
        num_labels=1,
    )
    return BertForSequenceClassification(config).eval()


def test_pair_scores_are_the_models_logits_on_each_pair_with_its_token_types():
    model = tiny_bert()
    batched, _ = pair_scorer(model=model).score(PROMPTS, RESPONSES)
    tokenizer = pair_tokenizer()
    with torch.no_grad():
        alone = [
            model(**tokenizer(p, r, return_tensors="pt")).logits[0, 0]
            for p, r in zip(PROMPTS, RESPONSES, strict=True)
        ]
        untyped = model(
            **tokenizer(PROMPTS[0], RESPONSES[0], return_token_type_ids=False, return_tensors="pt")
        ).logits[0, 0]
    assert_close(batched, torch.stack(alone), rtol=1e-5, atol=1e-5)
    assert not torch.isclose(batched[0], untyped)  # the token types reached the model


def test_an_unknown_reward_input_is_one_line_naming_the_choices(make_recipe):
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    with pytest.raises(RecipeError) as info:
        load_recipe(make_recipe({"reward": {"input": "pairs"}}))
    (problem,) = info.value.problems
    assert "\n" not in problem
    assert "reward.input: " in problem and "'auto', 'pair' or 'template'" in problem


# ── scores ──────────────────────────────────────────────────────────────────────────────────


def test_scores_are_one_float32_per_pair_on_the_cpu(reward_model):
    scores, n_truncated = scorer(reward_model).score(PROMPTS, RESPONSES)
    assert scores.shape == (6,) and scores.dtype == torch.float32
    assert scores.device.type == "cpu" and n_truncated == 0
    assert len(set(scores.tolist())) == 6  # six different texts, six different scores


def test_each_score_is_the_models_logit_on_that_text_alone(reward_model):
    s = scorer(reward_model)
    scores, _ = s.score(PROMPTS, RESPONSES)
    ids, _ = encode_ids(s, PROMPTS, RESPONSES)
    with torch.no_grad():
        alone = [reward_model(input_ids=torch.tensor([x])).logits[0, 0] for x in ids]
    assert_close(scores, torch.stack(alone), rtol=1e-5, atol=1e-6)


# Llama scores the last token that is not config.pad_token_id; left-padded rows get positions
# counted over their real tokens, as they would alone.
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_scores_do_not_depend_on_the_batch_size(reward_model, padding_side):
    scores = [
        scorer(reward_model, batch_size=n, padding_side=padding_side).score(PROMPTS, RESPONSES)[0]
        for n in (1, 4, 16)
    ]
    assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-6)
    assert_close(scores[2], scores[0], rtol=1e-5, atol=1e-6)


# ── padding: a pretrained reward model's own pad id, absolute positions ─────────────────────


def alone_and_batched(model, padding_side: str, tokenizer=None) -> tuple[torch.Tensor, ...]:
    s = scorer(model, padding_side=padding_side)
    if tokenizer is not None:
        s = RewardScorer(model, tokenizer, TEMPLATE, 64)
    alone = torch.cat([s.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    return alone, s.score(PROMPTS, RESPONSES)[0]


# A pretrained model keeps its own pad id: EOS (never in these texts), or a word that is.
@pytest.mark.parametrize("config_pad_id", [VOCAB["</s>"], VOCAB["a"]])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_model_with_its_own_pad_id_scores_a_text_the_same_alone_and_batched(
    config_pad_id, padding_side
):
    model = tiny_llama(pad_token_id=config_pad_id)
    alone, batched = alone_and_batched(model, padding_side)
    assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert model.config.pad_token_id == VOCAB["<pad>"]  # made the tokenizer's, once


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_tokenizer_without_a_pad_token_pads_with_its_eos(padding_side):
    tokenizer = word_tokenizer(padding_side)
    tokenizer.pad_token = None
    model = tiny_llama(pad_token_id=VOCAB["<pad>"])
    alone, batched = alone_and_batched(model, padding_side, tokenizer)
    assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert tokenizer.pad_token == "</s>" and model.config.pad_token_id == VOCAB["</s>"]


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused():
    tokenizer = word_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        RewardScorer(tiny_llama(), tokenizer, TEMPLATE, 64)


def test_absolute_positions_are_counted_over_real_tokens_in_left_padded_batches():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(VOCAB), n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=1
    )
    config.pad_token_id = VOCAB["<pad>"]
    model = GPT2ForSequenceClassification(config).eval()
    for padding_side in ("left", "right"):
        alone, batched = alone_and_batched(model, padding_side)
        assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_truncated_inputs_are_scored_on_their_whole_response(reward_model):
    s = scorer(reward_model, max_length=5, template="{prompt} {response}")
    # "<s> a b c d" is 5 tokens; the other two are 6 and 7 tokens and lose their prompts' start
    scores, n_truncated = s.score(["a b", "h a b", "g h a b"], ["c d", "c d", "c d"])
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
    ids, n_truncated = encode_ids(scorer, ["short", "long " * 40], ["ok", "all done"])
    assert n_truncated == 1
    assert max(len(x) for x in ids) == 16
    # WordPiece: [CLS] ... the response's tokens [SEP]
    response = tokenizer("all done", add_special_tokens=False)["input_ids"]
    assert ids[1][-len(response) - 1 : -1] == response
    assert ids[1][-1] == tokenizer.sep_token_id and ids[1][0] == tokenizer.cls_token_id
    assert ids[1][1 : -len(response) - 1] == [tokenizer.convert_tokens_to_ids("long")] * 12


# ── rule-based reward functions ──────────────────────────────────────────────────────────────


def _reward_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return path


def test_reward_functions_are_summed_with_their_weights(tmp_path: Path) -> None:
    from rlhf_cli.rewards import load_reward_function
    from rlhf_cli.scoring import RewardScorer

    path = _reward_file(
        tmp_path,
        "def length(prompts, responses):\n    return [len(r) for r in responses]\n"
        "def one(prompts, responses):\n    return [1] * len(responses)\n",
    )
    specs = [f"{path}:length", f"{path}:one"]
    functions = [(s, load_reward_function(s), w) for s, w in zip(specs, (0.5, -2.0), strict=True)]
    scorer = RewardScorer(None, None, "{prompt} {response}", 64, functions=functions)
    scores, truncated = scorer.score(["p", "q"], ["abcd", "ab"])
    assert scores.tolist() == [0.5 * 4 - 2.0, 0.5 * 2 - 2.0] and truncated == 0


def test_a_reward_file_runs_once_per_process_until_it_changes(tmp_path: Path) -> None:
    """Validation and the scorer both load the file: its top level (which may load a model,
    or count calls as here) runs once; an edited file is read again."""
    from rlhf_cli.rewards import load_reward_function

    log = tmp_path / "imports.log"
    body = f"open({str(log)!r}, 'a').write('x')\ndef f(p, r):\n    return [VALUE] * len(r)\n"
    path = _reward_file(tmp_path, body.replace("VALUE", "1.0"))
    first, second = load_reward_function(f"{path}:f"), load_reward_function(f"{path}:f")
    assert first is second and log.read_text() == "x"
    path.write_text(body.replace("VALUE", "2.0"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert load_reward_function(f"{path}:f")(["p"], ["r"]) == [2.0] and log.read_text() == "xx"


@pytest.mark.parametrize(
    "body, message",
    [
        ("def f(p, r):\n    return [1.0]\n", "returned 1 rewards for 2 responses"),
        ("def f(p, r):\n    return [float('nan')] * len(r)\n", "returned a non-finite reward"),
        ("def f(p, r):\n    return [None] * len(r)\n", "failed: "),
        ("def f(p, r):\n    raise KeyError('boom')\n", "failed: 'boom'"),
    ],
)
def test_a_reward_function_that_misbehaves_is_named(tmp_path: Path, body, message) -> None:
    from rlhf_cli.errors import DataError
    from rlhf_cli.rewards import load_reward_function
    from rlhf_cli.scoring import RewardScorer

    spec = f"{_reward_file(tmp_path, body)}:f"
    scorer = RewardScorer(
        None, None, "{prompt}{response}", 8, functions=[(spec, load_reward_function(spec), 1.0)]
    )
    with pytest.raises(DataError, match=f"reward function .*my_rewards.py:f {message}"):
        scorer.score(["a", "b"], ["x", "y"])


@pytest.mark.parametrize(
    "function, message",
    [
        ("my_rewards.py:missing", "has no callable 'missing'"),
        ("nowhere.py:f", "reward function file not found"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
        ("just_a_name", "write it as module:callable"),
    ],
)
def test_a_reward_function_that_cannot_load_fails_validation(
    make_recipe, tmp_path: Path, function, message
) -> None:
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    _reward_file(tmp_path, "def f(p, r):\n    return [0.0] * len(r)\n")
    path = make_recipe({"reward": {"functions": [{"function": function}]}})
    with pytest.raises(RecipeError, match=f"reward.functions.0.function: .*{message}"):
        load_recipe(path)


def test_the_reward_needs_a_model_or_functions(make_recipe) -> None:
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    path = make_recipe({"reward": {"base_model": None}})
    with pytest.raises(RecipeError, match="reward.functions"):
        load_recipe(path)
    example = Path(__file__).resolve().parents[2] / "examples" / "rewards.py"
    fine = make_recipe(
        {"reward": {"base_model": None, "functions": [{"function": f"{example}:politeness"}]}},
        name="fine.yaml",
    )
    assert not load_recipe(fine).reward.has_model


# ── a remote reward model over HTTP ──────────────────────────────────────────────────────────


@pytest.fixture
def reward_server():
    """`serve(answer)`: a local HTTP server whose POST handler returns `answer(request)` (bytes)
    and counts its requests; yields its URL."""
    import http.server
    import json
    import threading

    servers = []

    def serve(answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(request)
                body = answer(request)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.requests = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/score", server

    yield serve
    for server in servers:
        server.shutdown()


def test_a_remote_reward_scores_the_template_texts(reward_server) -> None:
    import json

    from rlhf_cli.rewards import RemoteReward
    from rlhf_cli.scoring import RewardScorer

    url, server = reward_server(
        lambda req: json.dumps({"rewards": [len(r) for r in req["responses"]]}).encode()
    )
    remote = RemoteReward(url, "Q: {prompt} A: {response}", timeout=5, retries=0)
    scorer = RewardScorer(None, None, "unused", 8, functions=[(url, remote, 2.0)])
    scores, _ = scorer.score(["p", "q"], ["abc", "a"])
    assert scores.tolist() == [6.0, 2.0]
    assert server.requests[0]["query"] == ["Q: p A: abc", "Q: q A: a"]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>oops</html>", "failed after 2 attempts: Expecting value"),
        (b'{"answer": 1}', "answered without a `rewards` list"),
    ],
)
def test_a_remote_reward_that_answers_garbage_is_named(reward_server, body, message) -> None:
    from rlhf_cli.errors import DataError
    from rlhf_cli.rewards import RemoteReward

    url, _ = reward_server(lambda req: body)
    with pytest.raises(DataError, match=f"remote reward {url} {message}"):
        RemoteReward(url, "{prompt}{response}", timeout=5, retries=1)(["p"], ["r"])


def test_a_dead_remote_reward_fails_within_its_timeout_and_retries() -> None:
    import socket
    import time

    from rlhf_cli.errors import DataError
    from rlhf_cli.rewards import RemoteReward

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    start = time.perf_counter()
    with pytest.raises(DataError, match=f"remote reward {url} failed after 3 attempts"):
        RemoteReward(url, "{prompt}{response}", timeout=1.0, retries=2)(["p"], ["r"])
    backoff = 0.5 + 1.0  # the waits between the three attempts
    assert time.perf_counter() - start < 3 * 1.0 + backoff + 1.0
