"""One loader for every model of the pipeline: policy, reference, value and reward.

dtype, device placement, 4-bit NF4 through bitsandbytes, LoRA through peft, and a tokenizer that
pads on the left with a pad token (the EOS when the checkpoint has none). The reference policy is
the policy with its adapter disabled when LoRA is on, so no second copy of the weights is loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.generation import forward_logits
from rlhf_cli.recipe import BUILTIN_PREFIX, LoraSection, ModelSection, QuantizationSection
from rlhf_cli.tiny import BUILTINS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name: str) -> str:
    """`builtin:<name>` becomes the folder built or shipped offline; anything else is kept."""
    if not name.startswith(BUILTIN_PREFIX):
        return name
    key = name.removeprefix(BUILTIN_PREFIX)
    if key not in BUILTINS:
        raise ModelLoadError(
            f"unknown built-in model '{name}': choose one of "
            + ", ".join(BUILTIN_PREFIX + k for k in BUILTINS)
        )
    return str(BUILTINS[key]())


def pick_device(device: str) -> torch.device:
    """`auto`: CUDA when present, else the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("run.device is 'cuda' but no CUDA device is visible")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ModelLoadError(f"cannot load '{path}': {first}") from None


def load_tokenizer(
    name_or_path: str, trust_remote_code: bool = False, padding_side: str = "left"
) -> Any:
    """A tokenizer with a pad token (EOS when missing) and the padding side enforced."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = _from_pretrained(
        AutoTokenizer, path, trust_remote_code=trust_remote_code, padding_side=padding_side
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"tokenizer of '{name_or_path}' has neither a pad nor an EOS token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    if tokenizer.padding_side != padding_side:
        raise ModelLoadError(f"tokenizer of '{name_or_path}' refuses padding_side={padding_side}")
    return tokenizer


def bnb_config(q: QuantizationSection, device: torch.device) -> Any:
    """BitsAndBytesConfig for 4-bit, or None. Fails loudly where bitsandbytes cannot quantise."""
    if not q.load_in_4bit:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # an ImportError or a broken native library
        raise ModelLoadError(
            "model.quantization.load_in_4bit needs a working bitsandbytes "
            f"({exc.__class__.__name__}: {exc}); install it or turn 4-bit off"
        ) from None
    if device.type not in ("cuda", "cpu", "xpu"):
        raise ModelLoadError(
            f"bitsandbytes cannot quantise to 4-bit on '{device.type}'; "
            "set model.quantization.load_in_4bit: false"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
    )


def assert_quantised(model: torch.nn.Module, name: str) -> None:
    """No silent full-precision fallback: a 4-bit load must contain 4-bit linear layers."""
    import bitsandbytes as bnb

    if not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()):
        raise ModelLoadError(f"'{name}' was asked for in 4-bit but no layer was quantised")


def lora_config(lora: LoraSection, task_type: str, no_dropout: bool = False) -> Any:
    """peft's LoraConfig from the recipe; `no_dropout` for PPO, whose ratio needs deterministic
    log-probs (the recipe's dropout applies to SFT)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=0.0 if no_dropout else lora.dropout,
        target_modules=lora.target_modules,
        bias=lora.bias,
        task_type=task_type,
    )


def load_causal_lm(
    name_or_path: str, model_cfg: ModelSection, device: torch.device, *, trainable: bool = True
) -> Any:
    """Base weights (4-bit if asked); when `trainable`, a fresh LoRA adapter if
    `model.lora.enabled` (on 4-bit weights prepared for k-bit training). Frozen otherwise."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    quant = bnb_config(model_cfg.quantization, device)
    kwargs: dict[str, Any] = {
        "dtype": resolve_dtype(model_cfg.dtype, device),
        "trust_remote_code": model_cfg.trust_remote_code,
    }
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = model_cfg.device_map or {"": str(device)}
    elif model_cfg.device_map:
        kwargs["device_map"] = model_cfg.device_map
    model = _from_pretrained(AutoModelForCausalLM, path, **kwargs)
    if quant is not None:
        assert_quantised(model, name_or_path)
    elif not model_cfg.device_map:
        model.to(device)
    if quant is not None and trainable:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if model_cfg.lora.enabled and trainable:
        model = get_peft_model(model, lora_config(model_cfg.lora, "CAUSAL_LM"))
    if not trainable:
        freeze(model)
    return model


def load_sft_model(
    model_cfg: ModelSection, base: str, sft_adapter: Path | None, device: torch.device
) -> Any:
    """The SFT model, frozen: base weights with the SFT adapter (if any) merged in. It is the
    PPO reference, and the base the PPO adapter is trained and merged on."""
    from peft import PeftModel

    model = load_causal_lm(base, model_cfg.variant(lora=False), device, trainable=False)
    if sft_adapter is not None:
        model = PeftModel.from_pretrained(model, str(sft_adapter)).merge_and_unload()
    return model


class Reference:
    """The frozen reference policy: the policy with its LoRA adapter disabled (no second copy of
    the weights), or a separate frozen model when the policy has no adapter."""

    def __init__(self, policy: nn.Module, frozen_copy: nn.Module | None = None):
        self.policy, self.frozen_copy = policy, frozen_copy

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        if self.frozen_copy is not None:
            yield self.frozen_copy
            return
        with self.policy.disable_adapter():
            yield self.policy

    @torch.inference_mode()
    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        with self.model() as ref:
            return forward_logits(ref, input_ids, attention_mask)


def load_reward_model(
    name_or_path: str,
    device: torch.device,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    num_labels: int = 1,
) -> Any:
    """A sequence-classification model with one logit (the score)."""
    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(name_or_path)
    model = _from_pretrained(
        AutoModelForSequenceClassification,
        path,
        num_labels=num_labels,
        dtype=resolve_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
    )
    if model.config.pad_token_id is None and getattr(model.config, "eos_token_id", None):
        model.config.pad_token_id = model.config.eos_token_id
    return model.to(device)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Frozen models (reward, reference) never get gradients and run in eval mode."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set every dropout probability (PPO turns dropout off: log-probs must be deterministic)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    for config in {id(c): c for c in _configs(model)}.values():
        for key in (
            "attention_dropout",
            "hidden_dropout",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "dropout",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
        ):
            if hasattr(config, key):
                setattr(config, key, p)


def _configs(model: torch.nn.Module) -> list[Any]:
    return [
        m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")
    ]
