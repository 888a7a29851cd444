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
