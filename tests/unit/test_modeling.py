"""Model loading: tokenizer padding, 4-bit NF4 + LoRA on the CPU, clear errors where it cannot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.modeling import (
    assert_quantised,
    bnb_config,
    load_causal_lm,
    load_tokenizer,
    pick_device,
    resolve_dtype,
    resolve_model_path,
)
from rlhf_cli.recipe import ModelSection, QuantizationSection

CPU = torch.device("cpu")


def tiny_cfg(**quantization: object) -> ModelSection:
    return ModelSection(
        name_or_path="builtin:tiny-lm",
        dtype="float32",
        quantization=QuantizationSection(**quantization),
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )


def save_word_tokenizer(folder: Path, **specials: str) -> Path:
    """A minimal word-level tokenizer saved with only the given special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **specials)
    tokenizer.save_pretrained(folder)
    return folder


# ── tokenizers ──────────────────────────────────────────────────────────────────────────────


def test_tiny_tokenizer_pads_left_with_its_pad_token() -> None:
    tokenizer = load_tokenizer("builtin:tiny-lm")
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token != tokenizer.eos_token
    batch = tokenizer(["hello", "hello there my friend"], padding=True, return_tensors="pt")
    short = batch["input_ids"][0]
    assert short[0].item() == tokenizer.pad_token_id  # padding at the start
    assert short[-1].item() != tokenizer.pad_token_id
    assert batch["attention_mask"][0, 0].item() == 0 and batch["attention_mask"][0, -1].item() == 1


def test_padding_side_right_on_request() -> None:
    assert load_tokenizer("builtin:tiny-lm", padding_side="right").padding_side == "right"


def test_tokenizer_without_pad_gets_eos(tmp_path: Path) -> None:
    folder = save_word_tokenizer(tmp_path / "tok", eos_token="</s>")
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == 1
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["hello", "hello world"], padding=True)
    assert batch["input_ids"][0] == [1, 2]


def test_tokenizer_without_pad_or_eos_is_an_error(tmp_path: Path) -> None:
    folder = save_word_tokenizer(tmp_path / "tok")
    with pytest.raises(ModelLoadError, match="neither a pad nor an EOS token"):
        load_tokenizer(str(folder))


def test_missing_model_folder_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_unknown_builtin() -> None:
    with pytest.raises(ModelLoadError, match="builtin:tiny-lm, builtin:minilm"):
        resolve_model_path("builtin:huge-lm")
    assert resolve_model_path("org/name") == "org/name"


def test_devices_and_dtypes() -> None:
    assert pick_device("cpu") == CPU
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            pick_device("cuda")
        assert pick_device("auto") == CPU


def test_auto_is_bfloat16_only_on_gpus_that_compute_it_natively(monkeypatch) -> None:
    cuda = torch.device("cuda")

    def before_ampere(including_emulation: bool = True) -> bool:  # T4, V100: emulated only
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", before_ampere)
    assert resolve_dtype("auto", cuda) == torch.float32
    assert resolve_dtype("bfloat16", cuda) == torch.bfloat16  # asked for, it is what it gets
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", cuda) == torch.bfloat16  # Ampere and later


# ── 4-bit ───────────────────────────────────────────────────────────────────────────────────


def test_bnb_config_off_and_on() -> None:
    assert bnb_config(QuantizationSection(), CPU) is None
    config = bnb_config(QuantizationSection(load_in_4bit=True, compute_dtype="float32"), CPU)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant is True
    assert config.bnb_4bit_compute_dtype == torch.float32


def test_bnb_config_without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    with pytest.raises(ModelLoadError) as info:
        bnb_config(QuantizationSection(load_in_4bit=True), CPU)
    message = str(info.value)
    assert "load_in_4bit needs a working bitsandbytes" in message
    assert "ModuleNotFoundError" in message and "turn 4-bit off" in message


def test_bnb_config_on_an_unsupported_device() -> None:
    with pytest.raises(ModelLoadError, match="cannot quantise to 4-bit on 'mps'"):
        bnb_config(QuantizationSection(load_in_4bit=True), torch.device("mps"))


def test_assert_quantised_rejects_full_precision() -> None:
    model = load_causal_lm("builtin:tiny-lm", tiny_cfg(), CPU, trainable=False)
    with pytest.raises(ModelLoadError, match="'tiny' was asked for in 4-bit but no layer"):
        assert_quantised(model, "tiny")


def test_qlora_on_cpu_trains_only_the_adapter() -> None:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = load_causal_lm(
        "builtin:tiny-lm", tiny_cfg(load_in_4bit=True, compute_dtype="float32"), CPU
    )
    quantised = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7  # two layers × (q, k, v, o, gate, up, down)
    assert quantised[0].weight.quant_type == "nf4"

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    ids = torch.randint(10, 200, (2, 12))
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=ids).logits

    optimiser = torch.optim.AdamW(trainable.values(), lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    optimiser.step()

    changed = [n for n, p in trainable.items() if not torch.equal(p.detach(), before[n])]
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    with torch.no_grad():
        with model.disable_adapter():  # the frozen 4-bit base computes what it did before
            torch.testing.assert_close(model(input_ids=ids).logits, base_logits)
        assert not torch.allclose(model(input_ids=ids).logits, base_logits)  # the adapter acts


def test_frozen_load_has_no_trainable_parameters() -> None:
    model = load_causal_lm("builtin:tiny-lm", tiny_cfg(), CPU, trainable=False)
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_full_precision_lora_freezes_the_base() -> None:
    model = load_causal_lm("builtin:tiny-lm", tiny_cfg(), CPU)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert model.peft_config["default"].r == 4


# ── precision: what trains keeps fp32 master weights ───────────────────────────────────────


@pytest.fixture(scope="module")
def bf16_lm(tmp_path_factory: pytest.TempPathFactory, llama_config) -> str:
    """A tiny Llama saved in bf16, as most hub checkpoints are."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bf16_lm")
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def section(path: str, **fields: object) -> ModelSection:
    base: dict[str, object] = {
        "name_or_path": path,
        "dtype": "bfloat16",  # what `auto` resolves to on CUDA
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"},
    }
    return ModelSection(**{**base, **fields})


def test_full_weights_load_in_fp32_and_frozen_ones_in_the_recipe_dtype(bf16_lm: str) -> None:
    cfg = section(bf16_lm, lora={"enabled": False})
    trained = load_causal_lm(bf16_lm, cfg, CPU)
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in trained.parameters())
    frozen = load_causal_lm(bf16_lm, cfg, CPU, trainable=False)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}


def test_lora_on_a_bf16_base_trains_fp32_adapters(bf16_lm: str) -> None:
    model = load_causal_lm(bf16_lm, section(bf16_lm), CPU)
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert set(trained.values()) == {torch.float32} and frozen == {torch.bfloat16}
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()  # no autocast on the CPU: still runs


def test_a_peft_head_left_in_bf16_is_upcast_and_runs_outside_autocast(llama_config) -> None:
    """peft's `modules_to_save` head (a reward model's score) stays in the base dtype."""
    from peft import get_peft_model
    from transformers import LlamaForSequenceClassification

    from rlhf_cli.modeling import lora_config, upcast_trainable
    from rlhf_cli.recipe import LoraSection

    config = llama_config(num_labels=1, pad_token_id=0)
    base = LlamaForSequenceClassification(config).to(torch.bfloat16)
    model = get_peft_model(base, lora_config(LoraSection(r=4, alpha=8), "SEQ_CLS"))
    assert torch.bfloat16 in {p.dtype for p in model.parameters() if p.requires_grad}
    upcast_trainable(model)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    scores = model(input_ids=torch.randint(1, 64, (2, 6))).logits
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()


def test_4bit_weights_without_lora_cannot_train() -> None:
    cfg = tiny_cfg(load_in_4bit=True, compute_dtype="float32").variant(lora=False)
    with pytest.raises(ModelLoadError, match="4-bit weights cannot be trained directly"):
        load_causal_lm("builtin:tiny-lm", cfg, CPU)


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        (torch.bfloat16, "cuda", "bf16"),
        (torch.float16, "cuda", "fp16"),
        (torch.float32, "cuda", "no"),
        (torch.bfloat16, "cpu", "no"),
    ],
)
def test_mixed_precision_is_autocast_on_cuda_only(dtype, device, expected) -> None:
    from rlhf_cli.modeling import mixed_precision

    assert mixed_precision(dtype, torch.device(device)) == expected


# ── gradient checkpointing ─────────────────────────────────────────────────────────────────


def _grads_and_layer_calls(model, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of a train-mode forward + backward, and how often decoder layer 0's MLP ran
    (twice when the layer was recomputed in the backward pass; module hooks do not run in the
    recomputation, so its forward is wrapped)."""
    mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    del mlp.forward
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return grads, len(calls)


@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(four_bit: bool) -> None:
    from rlhf_cli.modeling import is_checkpointing

    quant = {"load_in_4bit": True, "compute_dtype": "float32"} if four_bit else {}
    ids = torch.randint(10, 200, (2, 12))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = tiny_cfg(**quant).model_copy(update={"gradient_checkpointing": checkpointing})
        model = load_causal_lm("builtin:tiny-lm", cfg, CPU)
        for name, param in model.named_parameters():  # LoRA B starts at 0: make every grad count
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(1))
        assert is_checkpointing(model) is checkpointing
        results.append(_grads_and_layer_calls(model, ids))
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results
    assert (plain_calls, checkpointed_calls) == (1, 2)
    assert plain.keys() == checkpointed.keys() and all(g is not None for g in plain.values())
    torch.testing.assert_close(checkpointed, plain)


# ── dropout ────────────────────────────────────────────────────────────────────────────────


def _two_train_forwards(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    with torch.no_grad():
        return model(input_ids=ids)[0], model(input_ids=ids)[0]


def test_set_dropout_stops_llama_attention_dropout_in_train_mode(llama_config) -> None:
    """Llama's attention keeps its own copy of `attention_dropout`, read in forward."""
    from transformers import LlamaForCausalLM

    from rlhf_cli.modeling import set_dropout

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(attention_dropout=0.3))
    ids = torch.randint(0, 64, (2, 12))
    first, second = _two_train_forwards(model, ids)
    assert not torch.equal(first, second)  # the dropout is real before
    set_dropout(model, 0.0)
    first, second = _two_train_forwards(model, ids)
    assert torch.equal(first, second)
    assert all(m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "q_proj"))
    assert model.config.attention_dropout == 0.0


def test_set_dropout_stops_bert_hidden_and_attention_dropout() -> None:
    from transformers import BertConfig, BertModel

    from rlhf_cli.modeling import set_dropout

    config = BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=64,
        hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.3,
    )
    torch.manual_seed(0)
    model = BertModel(config)
    ids = torch.randint(0, 64, (2, 12))
    assert not torch.equal(*_two_train_forwards(model, ids))
    set_dropout(model, 0.0)
    assert torch.equal(*_two_train_forwards(model, ids))
    assert model.config.hidden_dropout_prob == 0.0


# ── chat templates for tokenizers without one ────────────────────────────────────────────────


@pytest.fixture
def bare_tokenizer(tmp_path):
    """The tiny tokenizer saved without its chat template (as a base model's comes)."""
    from rlhf_cli.modeling import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-lm")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    return str(tmp_path / "bare")


def test_chat_prompts_without_a_template_are_refused_not_sent_plain(bare_tokenizer):
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.modeling import load_policy_tokenizer
    from rlhf_cli.recipe import ModelSection

    cfg = ModelSection(name_or_path="builtin:tiny-lm")
    with pytest.raises(ModelLoadError, match="has no chat template: set model.chat_template"):
        load_policy_tokenizer(cfg, bare_tokenizer, "left")
    plain = cfg.model_copy(update={"prompt_format": "plain"})
    assert load_policy_tokenizer(plain, bare_tokenizer, "left").chat_template is None


@pytest.mark.parametrize(
    "choice, rendered",
    [
        ("hh", "\n\nHuman: hello there\n\nAssistant:"),
        ("chatml", "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"),
    ],
)
def test_a_builtin_chat_template_wraps_the_prompts(bare_tokenizer, choice, rendered):
    from rlhf_cli.generation import tokenize_prompts
    from rlhf_cli.modeling import load_policy_tokenizer
    from rlhf_cli.recipe import ModelSection

    cfg = ModelSection(name_or_path="builtin:tiny-lm", chat_template=choice)
    tokenizer = load_policy_tokenizer(cfg, bare_tokenizer, "left")
    ids = tokenize_prompts(tokenizer, ["hello there"], chat=True, max_tokens=64)[0]
    assert tokenizer.decode(ids) == tokenizer.decode(
        tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )


def test_a_chat_template_file_is_read_relative_to_the_recipe(make_recipe, tmp_path, bare_tokenizer):
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.modeling import load_policy_tokenizer
    from rlhf_cli.recipe import load_recipe

    (tmp_path / "mine.jinja").write_text(
        "{% for m in messages %}{{ 'Q: ' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ ' A:' }}{% endif %}"
    )
    recipe = load_recipe(make_recipe({"model": {"chat_template": "mine.jinja"}}))
    tokenizer = load_policy_tokenizer(recipe.model, bare_tokenizer, "left")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "Q: hi A:"
    with pytest.raises(RecipeError, match="model.chat_template: not one of chatml, llama2, hh"):
        load_recipe(make_recipe({"model": {"chat_template": "nope.jinja"}}, name="bad.yaml"))
